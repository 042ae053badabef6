"""The eager engine's capture as a dry run of a CUDA capture: what a CUDA graph cannot contain is
refused there, with the error a CUDA capture would raise.

A CUDA stream capture records kernels without running them, so work that needs a result on the
host fails (``cudaErrorStreamCaptureUnsupported``): a scalar read (``.item()``, ``.tolist()``,
``bool(t)``, printing a tensor, ``torch.equal``), an op whose output size is data-dependent
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
``output_size``), a copy to the host (``.cpu()``, ``.numpy()``), and a device or stream
synchronize, and a random op that draws from a generator the capture does not carry (the default
generator is carried; another one, a tensor-parallel RNG tracker's, only once registered:
``CudaEngine(generators=...)``; the dry run takes the same list, ``EagerEngine(generators=...)``).
The eager engine runs the callable at "capture" on the CPU, where each of these works:
:func:`capture_checked` makes them fail there too, so a CPU test run says whether the model will
capture.

Only the eager engine's captures run under it (warmup may synchronize, on CUDA too), and only on
the capturing thread: the synchronize functions are wrapped for the capture's duration and defer
to torch's own on every other thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CaptureUnsupportedError", "capture_checked"]

_CUDA_ERROR = "CUDA error: operation not permitted when stream is capturing"

_aten = torch.ops.aten

#: aten ops that need a result on the host (a scalar, or an output size that depends on data).
_HOST_SYNC: dict[Any, str] = {
    _aten._local_scalar_dense.default: "reads a tensor's value on the host (.item(), .tolist(), bool(t), printing)",
    _aten.is_nonzero.default: "reads a tensor's truth value on the host (bool(t), `if t:`)",
    _aten.equal.default: "compares tensors on the host (torch.equal)",
    _aten.nonzero.default: "has an output size that depends on the data (nonzero, torch.where(cond))",
    _aten.masked_select.default: "has an output size that depends on the data (masked_select)",
    _aten._unique2.default: "has an output size that depends on the data (unique)",
    _aten.unique_dim.default: "has an output size that depends on the data (unique)",
    _aten.unique_consecutive.default: "has an output size that depends on the data (unique_consecutive)",
}

#: Tensor methods that copy to the host (a no-op on a CPU tensor, a device-to-host copy on CUDA).
_HOST_COPY = {
    torch.Tensor.cpu: ".cpu()",
    torch.Tensor.numpy: ".numpy()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.__repr__: "printing a tensor",
    torch.Tensor.__str__: "printing a tensor",
    torch.Tensor.__format__: "formatting a tensor",
}


class CaptureUnsupportedError(RuntimeError):
    """Work a CUDA graph capture cannot contain, found by the eager engine's dry run."""


def _refuse(what: str) -> CaptureUnsupportedError:
    return CaptureUnsupportedError(
        f"{_CUDA_ERROR} (the eager engine's capture is a dry run of a CUDA capture: this {what}, which a "
        "CUDA graph cannot contain; move it out of the graphed callable, before or after the call, or "
        "keep the callable eager)"
    )


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Ops(TorchDispatchMode):
    """Refuses, per aten op, what needs the host, and draws from generators not carried."""

    def __init__(self, generators: tuple[torch.Generator, ...]) -> None:
        super().__init__()
        self.generators = generators

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for g in (*args, *kwargs.values()):
            if isinstance(g, torch.Generator) and not self._carried(g):
                raise _refuse(
                    f"op ({func}) draws from a generator the capture does not carry (register it: "
                    "CudaEngine(generators=[g]), and EagerEngine(dry_run=True, generators=[g]) for this check)"
                )
        what = _HOST_SYNC.get(func)
        if what is not None:
            raise _refuse(f"op ({func}) {what}")
        if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and _bool_index(args):
            raise _refuse(f"op ({func}) indexes with a boolean mask, whose output size depends on the data")
        if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise _refuse(f"op ({func}) without output_size has an output size that depends on the data")
        return func(*args, **kwargs)

    def _carried(self, g: torch.Generator) -> bool:
        # The dispatcher hands over a new Python object for the generator: the carried ones are
        # recognised by device and state (two generators in one state draw the same numbers).
        state = g.get_state()
        return any(
            c.device == g.device and torch.equal(c.get_state(), state)
            for c in (torch.default_generator, *self.generators)
        )


class _Methods(TorchFunctionMode):
    """Refuses the tensor methods that copy to the host."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        what = _HOST_COPY.get(func)
        if what is not None:
            raise _refuse(f"call ({what}) copies to the host")  # on CUDA: a device-to-host copy
        return func(*args, **(kwargs or {}))


_capturing = threading.local()


def _checked_sync(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def sync(*args: Any, **kwargs: Any) -> Any:
        if getattr(_capturing, "on", False):
            raise _refuse(f"{what} waits for the device on the host")
        return original(*args, **kwargs)

    sync.__wrapped__ = original  # type: ignore[attr-defined]
    return sync


def _sync_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, what) of each synchronize a capture cannot contain."""
    cuda = torch.cuda
    return [
        (cuda, "synchronize", "torch.cuda.synchronize()"),
        (cuda.Stream, "synchronize", "Stream.synchronize()"),
        (cuda.Event, "synchronize", "Event.synchronize()"),
    ]


class _SyncWrappers:
    """The synchronize functions wrapped while any thread captures, counted, so that concurrent
    captures neither unwrap each other nor leave a wrapper behind."""

    def __init__(self) -> None:
        self.installed: list[tuple[Any, str, Any]] = []  # (owner, attribute, torch's own)
        self.users = 0
        self.lock = threading.Lock()

    def acquire(self) -> None:
        with self.lock:
            if self.users == 0:
                for owner, name, what in _sync_points():
                    original = getattr(owner, name)
                    self.installed.append((owner, name, original))
                    setattr(owner, name, _checked_sync(original, what))
            self.users += 1

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                for owner, name, original in self.installed:
                    setattr(owner, name, original)
                self.installed.clear()


_SYNCS = _SyncWrappers()


@contextlib.contextmanager
def _syncs_refused() -> Iterator[None]:
    """The synchronize functions refuse on this thread (and defer to torch's on the others)."""
    _SYNCS.acquire()
    outer, _capturing.on = getattr(_capturing, "on", False), True
    try:
        yield
    finally:
        _capturing.on = outer
        _SYNCS.release()


@contextlib.contextmanager
def capture_checked(generators: tuple[torch.Generator, ...] = ()) -> Iterator[None]:
    """Runs the body inside as a CUDA capture would accept it: each refused op raises
    :class:`CaptureUnsupportedError` (a RuntimeError, as CUDA's) naming what and why.
    ``generators``: those, besides the default one, that the capture carries."""
    with _syncs_refused(), _Methods(), _Ops(generators):
        yield
