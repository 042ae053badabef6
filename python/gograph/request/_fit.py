"""The checks of a request that depend on the engine chosen: devices, the pool token, autocast.

:mod:`gograph.request._args` checks everything that needs no engine; once the engine is resolved
(:func:`gograph.engines.resolve_engine`), :func:`check_for_engine` checks what only that engine
refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runtime import _pool
from ..runtime.engines import CudaEngine, EagerEngine, Engine
from ._args import PassSpec, Request

__all__ = ["check_for_engine"]


def check_for_engine(req: Request, specs: Sequence[PassSpec], engine: Engine) -> None:
    """Devices, pool token, autocast and the options an engine does not run, against the engine
    chosen."""
    if isinstance(engine, CudaEngine):
        _check_devices(specs, engine.device)
    _pool.check(req.pool, engine.name)
    cache = torch.is_autocast_enabled() and torch.is_autocast_cache_enabled()
    if isinstance(engine, EagerEngine):
        cache = cache or (torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled())
    if cache:
        raise RuntimeError(
            "make_graphed_callables does not support the autocast caching. Please set `cache_enabled=False`."
        )


def _check_devices(specs: Sequence[PassSpec], device: torch.device) -> None:
    for spec in specs:
        for j, t in enumerate(spec.flat_args):
            if t.device != device:
                raise ValueError(
                    f"gograph: sample arg leaf {j} of callable {spec.index} ({spec.label}) is on {t.device}, "
                    f"but the CUDA engine captures on {device}; move it there (e.g. .to('{device}')): "
                    "graphs read their inputs from that device's memory"
                )
        for k, p in enumerate(spec.params):
            if p.device != device:
                names = (
                    {id(q): n for n, q in spec.func.named_parameters()}
                    if isinstance(spec.func, torch.nn.Module)
                    else {}
                )
                raise ValueError(
                    f"gograph: parameter {names.get(id(p), k)!r} of callable {spec.index} ({spec.label}) "
                    f"is on {p.device}, but the CUDA engine captures on {device}; move the module there "
                    f"first (module.to('{device}'))"
                )
