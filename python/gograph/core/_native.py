"""Loads exactly one flavor of the Go core (a gopy-built extension).

Two flavors exist (see docs/CORE_API.md):

* ``gograph._core_cuda`` -- built with the ``cuda`` tag; links the CUDA driver. Its Go
  ``init`` (gorgonia.org/cu) calls ``cuInit(0)`` and **terminates the process** with
  ``os.Exit(1)`` when that fails, so it must never be imported on a machine without a usable
  driver.
* ``gograph._core_cpu`` -- no CUDA code; pass records work, capture calls return errors.

This module decides once, at import, which one to load:

1. ``GOGRAPH_DISABLE_CUDA=1`` forces the CPU flavor.
2. Otherwise the driver is probed with :mod:`ctypes` *before* the CUDA flavor is imported:
   ``libcuda.so.1`` must load (directly, or -- when only torch knows where it is -- from the path
   torch's CUDA runtime mapped into this process), ``cuInit(0)`` must return 0 and
   ``cuDeviceGetCount`` must report at least one device.
3. If the probe passes, ``gograph._core_cuda.gographcore`` is imported; an ImportError (flavor
   not built) falls back to the CPU flavor.

Both flavors are never loaded in one process. The outcome is exposed as :data:`core`,
:data:`flavor`, :func:`cuda_available` and :func:`cuda_unavailable_reason`, and logged on the
``"gograph"`` logger.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from types import ModuleType

__all__ = ["core", "cuda_available", "cuda_unavailable_reason", "flavor", "probe_driver"]

log = logging.getLogger("gograph")

_DISABLE_ENV = "GOGRAPH_DISABLE_CUDA"
_CPU_PACKAGE = "gograph._core_cpu"
_CUDA_PACKAGE = "gograph._core_cuda"
# gopy names the generated wrapper after the Go package ("gograph.py"); the build installs it
# as "gographcore.py" (the -name given to gopy). Either is accepted, the latter first.
_MODULE_NAMES = ("gographcore", "gograph")

# A few CUresult codes, for readable reasons (the full list lives in cuda.h).
_CU_ERROR_NAMES = {
    3: "CUDA_ERROR_NOT_INITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    999: "CUDA_ERROR_UNKNOWN",
}


def _env_disabled() -> bool:
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _libcuda_path_from_maps() -> str | None:
    """The path of the libcuda that is already mapped into this process, if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and "/libcuda.so" in parts[-1]:
                    return parts[-1]
    except OSError:
        return None
    return None


def _load_libcuda() -> tuple[ctypes.CDLL | None, str | None]:
    """Returns (library, None) or (None, reason)."""
    try:
        return ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL), None
    except OSError as first:
        direct_error = str(first)
    # libcuda.so.1 is not on the loader path. torch may still know where it is (its CUDA
    # runtime dlopen()s it from a driver-specific location): initialise CUDA through torch
    # and take the path from this process's mappings.
    try:
        import torch  # only on this fallback path: loading the core must not need torch first

        torch_sees_cuda = bool(torch.cuda.is_available())
    except Exception as e:  # pragma: no cover - torch broken
        return None, f"libcuda.so.1 could not be loaded ({direct_error}) and torch could not be asked ({e})"
    if not torch_sees_cuda:
        return None, f"no CUDA driver: libcuda.so.1 could not be loaded ({direct_error})"
    try:
        torch.cuda.init()
    except Exception as e:
        return None, f"libcuda.so.1 could not be loaded ({direct_error}) and torch.cuda.init() failed ({e})"
    path = _libcuda_path_from_maps()
    if path is None:
        return None, (
            f"libcuda.so.1 could not be loaded ({direct_error}) and torch's CUDA "
            "initialisation did not map a libcuda into this process"
        )
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL), None
    except OSError as e:
        return None, f"libcuda found at {path} (via torch) could not be loaded: {e}"


def _cu_error_text(lib: ctypes.CDLL, code: int) -> str:
    name = _CU_ERROR_NAMES.get(code)
    try:
        fn = lib.cuGetErrorName
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        fn.restype = ctypes.c_int
        out = ctypes.c_char_p()
        if fn(code, ctypes.byref(out)) == 0 and out.value:
            name = out.value.decode(errors="replace")
    except (AttributeError, OSError):
        pass
    return f"{name} ({code})" if name else f"error {code}"


def probe_driver() -> str | None:
    """Checks that the CUDA driver is usable without loading any Go code.

    Returns None when ``libcuda.so.1`` loads, ``cuInit(0)`` succeeds and at least one device
    exists; otherwise a sentence naming the cause.
    """
    lib, reason = _load_libcuda()
    if lib is None:
        return reason
    try:
        cu_init = lib.cuInit
        cu_init.argtypes = [ctypes.c_uint]
        cu_init.restype = ctypes.c_int
        count_fn = lib.cuDeviceGetCount
        count_fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        count_fn.restype = ctypes.c_int
    except AttributeError as e:
        return f"the loaded libcuda lacks a driver entry point ({e})"
    rc = cu_init(0)
    if rc != 0:
        return f"cuInit(0) failed with {_cu_error_text(lib, rc)}"
    count = ctypes.c_int(0)
    rc = count_fn(ctypes.byref(count))
    if rc != 0:
        return f"cuDeviceGetCount failed with {_cu_error_text(lib, rc)}"
    if count.value <= 0:
        return "the CUDA driver reports no devices"
    return None


def _import_flavor(package: str) -> ModuleType:
    """Imports the generated wrapper of one flavor package (ImportError when not built)."""
    errors = []
    for name in _MODULE_NAMES:
        full = f"{package}.{name}"
        try:
            return importlib.import_module(full)
        except ModuleNotFoundError as e:
            if e.name not in (full, package):
                raise  # the wrapper exists but something it needs is missing
            errors.append(str(e))
    raise ImportError(f"no generated module in {package} ({'; '.join(errors)})")


def _import_cpu(cuda_reason: str) -> ModuleType:
    try:
        return _import_flavor(_CPU_PACKAGE)
    except ImportError as e:
        raise ImportError(
            f"gograph: the cpu flavor of the Go core ({_CPU_PACKAGE}) is not built or cannot be "
            f"loaded ({e}); build it with `pip install .` or `make` (CUDA flavor not used: {cuda_reason})"
        ) from e


def _load() -> tuple[ModuleType, str, str | None]:
    """Returns (module, flavor, reason CUDA is unavailable or None)."""
    if _env_disabled():
        disabled = f"the CUDA core is disabled by {_DISABLE_ENV}={os.environ.get(_DISABLE_ENV)}"
        return _import_cpu(disabled), "cpu", disabled
    reason = probe_driver()
    if reason is None:
        try:
            mod = _import_flavor(_CUDA_PACKAGE)
        except ImportError as e:
            reason = f"the cuda flavor of the Go core is not built or cannot be loaded ({e})"
        else:
            return mod, "cuda", None
    return _import_cpu(reason), "cpu", reason


core, flavor, _reason = _load()
if flavor == "cuda":
    log.info("loaded the cuda flavor of the Go core (%s)", getattr(core, "__file__", "?"))
else:
    log.info("loaded the cpu flavor of the Go core; CUDA unavailable: %s", _reason)


def cuda_available() -> bool:
    """True when the CUDA flavor of the core is loaded (driver probed, devices present)."""
    return flavor == "cuda"


def cuda_unavailable_reason() -> str | None:
    """None when :func:`cuda_available`; otherwise a sentence naming why (no libcuda, a cuInit
    error code, no devices, flavor not built, disabled by ``GOGRAPH_DISABLE_CUDA``)."""
    return _reason
