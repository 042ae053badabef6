"""Find a CUDA driver header that gorgonia.org/cu compiles against, and make a link stub.

Why a stub: cgo links a helper binary to resolve the CUDA flavor's imports, so `-lcuda` must
find a `libcuda.so` at build time, and build machines (CI) have no NVIDIA driver. The stub
defines every `CUresult cu*(...)` function of the header, returns an error from each, and is
named `libcuda.so.1` (soname) so the extension records `DT_NEEDED libcuda.so.1`: at run time
the real driver library is what gets loaded. The stub is never shipped.

Why a 11.8-12.x header: gorgonia.org/cu v0.9.6 does not compile against CUDA 13's cuda.h
(several driver functions changed signature), which is what CUDA 13 machines and torch 2.11's
wheels carry. PyPI's `nvidia-cuda-runtime-cu12` wheel ships a 12.x cuda.h; it is a build
requirement in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: gorgonia.org/cu v0.9.6 compiles with CUDA 11.8 through 12.x headers, not 13.
MIN_HEADER_VERSION = 11080
MAX_HEADER_VERSION_EXCLUSIVE = 13000


@dataclass(frozen=True)
class CudaHeader:
    include_dir: Path
    version: int  # CUDA_VERSION, e.g. 12090


def header_version(include_dir: Path) -> int | None:
    """CUDA_VERSION of `include_dir/cuda.h`, or None when there is none."""
    header = include_dir / "cuda.h"
    try:
        text = header.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else None


def _candidate_include_dirs() -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    env = os.environ.get("GOGRAPH_CUDA_INCLUDE")
    if env:
        out.append(("GOGRAPH_CUDA_INCLUDE", Path(env)))
    # nvidia-cuda-runtime-cu12 installs the namespace package nvidia.cuda_runtime.
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            out.append(("nvidia-cuda-runtime-cu12", Path(loc) / "include"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append((var, Path(os.environ[var]) / "include"))
    out.append(("/usr/local/cuda", Path("/usr/local/cuda/include")))
    out.append(("/usr/include", Path("/usr/include")))
    return out


def find_cuda_header() -> tuple[CudaHeader | None, list[str]]:
    """First usable header and, for the log, why every other candidate was rejected."""
    notes: list[str] = []
    for origin, inc in _candidate_include_dirs():
        v = header_version(inc)
        if v is None:
            notes.append(f"{origin}: no cuda.h in {inc}")
            continue
        if not (MIN_HEADER_VERSION <= v < MAX_HEADER_VERSION_EXCLUSIVE):
            notes.append(
                f"{origin}: {inc}/cuda.h is CUDA_VERSION {v}; gorgonia.org/cu needs "
                f"{MIN_HEADER_VERSION} <= version < {MAX_HEADER_VERSION_EXCLUSIVE}"
            )
            continue
        return CudaHeader(inc, v), notes
    return None, notes


_DRIVER_FN = re.compile(r"\bCUresult\s+(cu[A-Za-z0-9_]+)\s*\(")


def driver_symbols(header: CudaHeader, cc: str = "cc") -> list[str]:
    """Every driver entry point the header declares, after its #define renames (…_v2)."""
    pre = subprocess.run(
        [cc, "-E", "-P", "-I", str(header.include_dir), str(header.include_dir / "cuda.h")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sorted(set(_DRIVER_FN.findall(pre)))


def build_link_stub(header: CudaHeader, out_dir: Path, cc: str | None = None) -> Path:
    """Compile `out_dir/libcuda.so` (soname libcuda.so.1) exporting the header's functions."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or "gcc"
    out_dir.mkdir(parents=True, exist_ok=True)
    syms = driver_symbols(header, cc)
    if not syms:
        raise RuntimeError(f"no CUresult functions found in {header.include_dir}/cuda.h")
    src = out_dir / "libcuda_stub.c"
    # 999 is CUDA_ERROR_UNKNOWN: if the stub were ever loaded, every call fails cleanly.
    src.write_text("".join(f"int {s}(void) {{ return 999; }}\n" for s in syms))
    lib = out_dir / "libcuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), "-Wl,-soname,libcuda.so.1", str(src)], check=True)
    return lib
