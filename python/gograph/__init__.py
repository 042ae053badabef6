"""gograph: CUDA-graphed PyTorch callables, captured by a Go core.

``gograph.make_graphed_callables`` is a drop-in for ``torch.cuda.make_graphed_callables``. The
graphs are captured on PyTorch's own stream and launched by a Go extension (gopy) through the
CUDA driver API; each graphed callable's lifecycle is an explicit record in Go. Without a usable
CUDA driver the CPU flavor of the core is loaded and CPU tensors run on the eager reference
engine (same API and lifecycle, replays re-run the callable).

Public names:

* :func:`make_graphed_callables`, :class:`GraphedCallable`
* :func:`graph_pool_handle` -- a pool token to share between calls
* :func:`cuda_available`, :func:`cuda_unavailable_reason` -- which core flavor was loaded, and why
* :func:`live_graphs`, :func:`live_passes` -- leak checks against the core's registries
* :func:`memory_report` -- what graphed callables hold, pass by pass (:mod:`gograph.memory`)
* :class:`BufferReuse`, :class:`ScheduleError`, :func:`megatron_order` -- TransformerEngine's pipeline
  schedules (``_order``) and buffer reuse, planned by the Go core (:mod:`gograph._schedule`)
* :mod:`gograph.engines` -- :class:`~gograph.engines.CudaEngine`, :class:`~gograph.engines.EagerEngine`
"""
from __future__ import annotations

from . import _native
from ._native import cuda_available, cuda_unavailable_reason
from .engines import CudaEngine, EagerEngine, EagerPool, Engine
from .memory import MemoryReport, memory_report
from ._schedule import BufferReuse, ScheduleError, megatron_order
from .graphs import (
    GraphedCallable,
    StaticInputMismatchError,
    graph_pool_handle,
    live_graphs,
    live_passes,
    make_graphed_callables,
)


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("gograph")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    try:
        return str(_native.core.core_version())
    except Exception:  # pragma: no cover - core without version
        return "0.0.0"


__version__: str = _version()
flavor: str = _native.flavor
"""Which flavor of the Go core is loaded: "cuda" or "cpu"."""


def core_flavor() -> str:
    """Which flavor of the Go core is loaded: "cuda" or "cpu" (as reported by the core)."""
    return str(_native.core.flavor())

__all__ = [
    "BufferReuse",
    "ScheduleError",
    "megatron_order",
    "CudaEngine",
    "EagerEngine",
    "EagerPool",
    "Engine",
    "GraphedCallable",
    "MemoryReport",
    "StaticInputMismatchError",
    "__version__",
    "cuda_available",
    "core_flavor",
    "cuda_unavailable_reason",
    "flavor",
    "graph_pool_handle",
    "live_graphs",
    "live_passes",
    "make_graphed_callables",
    "memory_report",
]
