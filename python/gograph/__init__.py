"""gograph: CUDA-graphed PyTorch callables, captured by a Go core.

``gograph.make_graphed_callables`` is a drop-in for ``torch.cuda.make_graphed_callables`` (and
TransformerEngine's, all but quantization). The graphs are captured on PyTorch's own stream and
launched by a Go extension (gopy) through the CUDA driver API; the Go core also plans every
buffer's lifetime and keeps each graphed pass's record. Without a usable CUDA driver the CPU
flavor of the core is loaded and CPU tensors run on the eager reference engine (same API and
lifecycle; replays re-run the callable).

Public names:

* :func:`make_graphed_callables`, :class:`GraphedCallable`, :class:`GraphedModule` (its typing)
* :class:`StaticInputMismatchError`, :class:`ChainedInputError`, :class:`SharedInputError`, :class:`ScheduleError`,
  :class:`CaptureUnsupportedError` (the eager engine's dry run of a CUDA capture)
* :func:`graph_pool_handle` -- a pool token to share between calls
* :func:`cuda_available`, :func:`cuda_unavailable_reason`, :func:`core_flavor` -- which core flavor was loaded, and why
* :func:`live_graphs`, :func:`live_passes`, :func:`live_plans` -- leak checks against the core's registries
* :func:`memory_report` -- what graphed callables hold in memory, pass by pass (:mod:`gograph.memory`)
* :class:`BufferReuse`, :func:`megatron_order` -- the buffer plan of a call; Megatron-LM's pipeline ``_order``
* :mod:`gograph.engines` -- :class:`~gograph.engines.CudaEngine`, :class:`~gograph.engines.EagerEngine`
* :mod:`gograph.integrations.megatron` -- Megatron-Core's own graph path captured by gograph (imported on demand)
"""

from __future__ import annotations

from .core import _core, _native
from .core._native import cuda_available, cuda_unavailable_reason
from .core._plan import ScheduleError, megatron_order
from .graphs import GraphedModule, graph_pool_handle, live_graphs, live_passes, live_plans, make_graphed_callables
from .memory import MemoryReport, memory_report
from .planning import MemoryPlan, plan_memory
from .replay._buffer_reuse import BufferReuse
from .replay._shared_inputs import SharedInputError
from .replay.graphed import ChainedInputError, GraphedCallable, StaticInputMismatchError
from .runtime._dry_run import CaptureUnsupportedError
from .runtime.engines import CudaEngine, EagerEngine, EagerPool, Engine

#: The distribution that installs this package (``pip install torch-gograph``; the name
#: "gograph" on PyPI is another project's).
DISTRIBUTION = "torch-gograph"


def _version() -> str:
    try:
        # here, not at the top: only the version lookup needs it, and it may be missing (ImportError below)
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(DISTRIBUTION)
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    return str(_core.core_version())


__version__: str = _version()
flavor: str = _native.flavor
"""Which flavor of the Go core is loaded: "cuda" or "cpu"."""


def core_flavor() -> str:
    """Which flavor of the Go core is loaded: "cuda" or "cpu" (as reported by the core)."""
    return str(_core.flavor())


__all__ = [
    "BufferReuse",
    "CaptureUnsupportedError",
    "ChainedInputError",
    "CudaEngine",
    "EagerEngine",
    "EagerPool",
    "Engine",
    "GraphedCallable",
    "GraphedModule",
    "MemoryPlan",
    "MemoryReport",
    "ScheduleError",
    "SharedInputError",
    "StaticInputMismatchError",
    "__version__",
    "core_flavor",
    "cuda_available",
    "cuda_unavailable_reason",
    "flavor",
    "graph_pool_handle",
    "live_graphs",
    "live_passes",
    "live_plans",
    "make_graphed_callables",
    "megatron_order",
    "memory_report",
    "plan_memory",
]
