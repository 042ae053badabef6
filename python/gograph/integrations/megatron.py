"""Megatron-Core's own CUDA-graph path, captured by gograph: a one-line switch.

Megatron-Core graphs its transformer layers with ``cuda_graph_impl="transformer_engine"``:
``TECudaGraphHelper.create_cudagraphs()`` calls the ``make_graphed_callables`` that
``megatron/core/transformer/cuda_graphs.py`` imported from ``transformer_engine.pytorch.graph``.
:func:`use_gograph` binds :func:`gograph.make_graphed_callables` itself there (no adapter: the
same arguments Megatron passes TransformerEngine), so the helper's graphs are gograph's::

    import gograph.integrations.megatron

    gograph.integrations.megatron.use_gograph()  # once, before the helper's create_cudagraphs()

Megatron then still needs TransformerEngine importable (its helper asserts TE's graph names at
import) and its stream setup for that path (``initialize.py`` makes a side stream current and
``get_model`` builds DDP under its own stream). On the eager engine (CPU) the switch also
records, at each capture, Megatron's capture state -- its capture flag set and the layer's graph
list empty, the state in which ``GraphableMegatronModule.__call__`` runs the layer's graphed
work -- so that every eager replay re-runs that work (a CUDA replay runs no Python).

:func:`use_transformer_engine` binds back what Megatron had bound.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from ..graphs import make_graphed_callables
from ..runtime import _capture_state

__all__ = [
    "SUPPORTED_VERSIONS",
    "chain_allowed",
    "in_use",
    "megatron_core_version",
    "megatron_make_graphed_callables",
    "use_gograph",
    "use_transformer_engine",
]

log = logging.getLogger("gograph")

#: The Megatron-Core releases whose TransformerEngine graph path gograph was tested with.
SUPPORTED_VERSIONS = ("0.19.2",)

_CUDA_GRAPHS = "megatron.core.transformer.cuda_graphs"
_lock = threading.Lock()
_bound_before: list[Callable[..., Any]] = []  # what Megatron had bound, while gograph's is bound


def megatron_core_version() -> str:
    """The version of the Megatron-Core that ``import megatron.core`` loads (its
    ``package_info``, which a source checkout has too), without a VCS suffix."""
    info = _import("megatron.core.package_info")
    short = getattr(info, "__shortversion__", None)
    return str(short if short is not None else info.__version__).split("+")[0]


def use_gograph(*, strict: bool = True) -> None:
    """Megatron-Core's ``cuda_graph_impl="transformer_engine"`` path captures with gograph.

    Binds :func:`megatron_make_graphed_callables` (:func:`gograph.make_graphed_callables` with the
    memory plan Megatron's schedule allows) as
    ``megatron.core.transformer.cuda_graphs.make_graphed_callables`` (calling it again changes
    nothing) and, for the eager engine, records Megatron's capture state at each capture.

    Raises:
        ImportError: Megatron-Core is not importable.
        RuntimeError: the Megatron-Core version is not one of :data:`SUPPORTED_VERSIONS` (with
            ``strict=False`` it is bound anyway, with a warning), or Megatron imported no
            TransformerEngine graph names (``HAVE_TE_GRAPHS`` is False: its helper would refuse).
    """
    cuda_graphs = _import(_CUDA_GRAPHS)
    version = megatron_core_version()
    if version not in SUPPORTED_VERSIONS:
        if strict:
            raise RuntimeError(
                f"gograph.integrations.megatron: Megatron-Core {version} is not a version this switch was tested "
                f"with ({', '.join(SUPPORTED_VERSIONS)}). Install a tested one (pip install "
                f"megatron-core=={SUPPORTED_VERSIONS[-1]}), or call use_gograph(strict=False) to bind gograph into "
                f"{_CUDA_GRAPHS}.make_graphed_callables anyway and check the training against eager"
            )
        log.warning("gograph: binding into Megatron-Core %s, which this switch was not tested with", version)
    if not getattr(cuda_graphs, "HAVE_TE_GRAPHS", False) or not hasattr(cuda_graphs, "make_graphed_callables"):
        raise RuntimeError(
            f"gograph.integrations.megatron: {_CUDA_GRAPHS} imported no TransformerEngine graph names "
            "(HAVE_TE_GRAPHS is False: transformer_engine.pytorch was not importable when Megatron-Core was "
            "imported), so its TECudaGraphHelper refuses cuda_graph_impl='transformer_engine'. Install "
            "TransformerEngine (pip install transformer-engine[pytorch]) and import Megatron-Core after it"
        )
    with _lock:
        current = cuda_graphs.make_graphed_callables
        if current is not megatron_make_graphed_callables:
            _bound_before[:] = [current]
            setattr(cuda_graphs, "make_graphed_callables", megatron_make_graphed_callables)  # noqa: B010
        _capture_state.register(record_capture_state)
    log.info("gograph: Megatron-Core %s's TECudaGraphHelper now captures with gograph", version)


def use_transformer_engine() -> None:
    """Binds back the ``make_graphed_callables`` Megatron-Core had bound before :func:`use_gograph`
    (TransformerEngine's), and stops recording its capture state. Graphs already made stay."""
    cuda_graphs = _import(_CUDA_GRAPHS)
    with _lock:
        if _bound_before and getattr(cuda_graphs, "make_graphed_callables", None) is megatron_make_graphed_callables:
            setattr(cuda_graphs, "make_graphed_callables", _bound_before[0])  # noqa: B010
        _bound_before.clear()
        _capture_state.unregister(record_capture_state)


def in_use() -> bool:
    """Whether Megatron-Core's TransformerEngine graph path is bound to gograph now."""
    cuda_graphs = _import(_CUDA_GRAPHS)
    return getattr(cuda_graphs, "make_graphed_callables", None) is megatron_make_graphed_callables


def megatron_make_graphed_callables(callables: Any, sample_args: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`gograph.make_graphed_callables` as Megatron-Core calls it, with the memory plan its
    schedule allows (:func:`chain_allowed`): ``chain_buffers=True`` where every callable is a
    whole transformer layer of a pipeline ``_order`` (each layer of a chunk reads the previous
    one's output in place; with Megatron's ``_reuse_graph_input_output_buffers`` the lowest peak a
    pipeline rank has, and one sample per microbatch in flight). An option Megatron passes itself
    is left as it is."""
    if "chain_buffers" not in kwargs and chain_allowed(callables, kwargs):
        kwargs["chain_buffers"] = True
    return make_graphed_callables(callables, sample_args, *args, **kwargs)


def chain_allowed(callables: Any, kwargs: dict[str, Any]) -> bool:
    """Whether Megatron's call graphs whole transformer layers in a pipeline ``_order`` (with at
    least one warmup iteration and no shared graphs): then its ``TransformerBlock`` calls each
    layer of a chunk with the previous layer's output itself, which ``chain_buffers`` reads in
    place. Partial layers (``cuda_graph_modules``), multi-token-prediction or other layers, and
    anything else keep Megatron's own options."""
    layer_mod = sys.modules.get("megatron.core.transformer.transformer_layer")
    layer_cls = getattr(layer_mod, "TransformerLayer", None)
    if layer_cls is None or kwargs.get("_order") is None or kwargs.get("share_microbatch_graphs"):
        return False
    if kwargs.get("num_warmup_iters", 3) < 1 or not isinstance(callables, tuple) or not callables:
        return False
    return all(
        type(c) is layer_cls and not getattr(getattr(c, "config", None), "cuda_graph_modules", None) for c in callables
    )


def record_capture_state(module: torch.nn.Module) -> _capture_state.StateFactory | None:
    """At an eager capture: a Megatron layer captured while Megatron's capture flag is set ran
    its graphed work (``_te_cuda_graph_capture``) through ``__call__``; its replays re-enter that
    state (flag set, the layer's ``cuda_graphs`` empty). None for anything else."""
    cuda_graphs = sys.modules.get(_CUDA_GRAPHS)
    module_mod = sys.modules.get("megatron.core.transformer.module")
    if cuda_graphs is None or module_mod is None:
        return None
    graphable = getattr(module_mod, "GraphableMegatronModule", None)
    if graphable is None or not isinstance(module, graphable) or not cuda_graphs.is_graph_capturing():
        return None
    return functools.partial(_capturing, cuda_graphs, weakref.ref(module))


@contextlib.contextmanager
def _capturing(cuda_graphs: ModuleType, module_ref: weakref.ReferenceType[torch.nn.Module]) -> Iterator[None]:
    module = module_ref()
    state: dict[str, Any] = module.__dict__ if module is not None else {}
    was_capturing = bool(cuda_graphs.is_graph_capturing())
    graphs = state.get("cuda_graphs")
    if not was_capturing:
        cuda_graphs._set_capture_start()
    if graphs:
        state["cuda_graphs"] = []
    try:
        yield
    finally:
        if graphs:
            state["cuda_graphs"] = graphs
        if not was_capturing:
            cuda_graphs._set_capture_end()


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"gograph.integrations.megatron needs Megatron-Core ({name} did not import: {e}); "
            f"pip install megatron-core=={SUPPORTED_VERSIONS[-1]}"
        ) from e
