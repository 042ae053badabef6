"""The engines a graphed callable runs on (public): :class:`CudaEngine`, :class:`EagerEngine`,
:class:`EagerPool`, the :class:`Engine` base, and the pass kinds. Defined in
:mod:`gograph.runtime.engines`; this module is their public path."""

from __future__ import annotations

from .runtime.engines import (
    BACKWARD,
    FORWARD,
    KIND_NAMES,
    WGRAD,
    CudaEngine,
    EagerEngine,
    EagerPool,
    Engine,
    capturing_on_this_thread,
    default_cuda_engine,
    default_eager_engine,
    resolve_engine,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KIND_NAMES",
    "WGRAD",
    "CudaEngine",
    "EagerEngine",
    "EagerPool",
    "Engine",
    "capturing_on_this_thread",
    "default_cuda_engine",
    "default_eager_engine",
    "resolve_engine",
]
