"""The TransformerEngine names Megatron-Core's graph path uses, for runs without TransformerEngine.

``megatron/core/transformer/cuda_graphs.py`` imports, inside a ``try``, what its
``cuda_graph_impl="transformer_engine"`` path needs from TransformerEngine (``HAVE_TE_GRAPHS``
says whether it could); ``TECudaGraphHelper`` asserts it. Where TransformerEngine is not
installed (CI, a GPU machine without it), :func:`provide` makes that path runnable:

* modules ``transformer_engine``, ``.pytorch``, ``.pytorch.graph``, ``.pytorch.fp8``,
  ``.pytorch.distributed``, ``.pytorch.module.base`` and ``.pytorch.utils`` in ``sys.modules``
  with the names Megatron reads: ``set_capture_start`` / ``set_capture_end`` /
  ``is_graph_capturing`` (a flag), ``make_weak_ref`` (the tensor itself), ``__version__`` (the
  TransformerEngine release whose arguments Megatron then passes), and the FP8 names as inert
  placeholders (FP8 off, nothing saved or restored); its ``make_graphed_callables`` refuses to
  run: the run binds gograph's (or fails loudly);
* those names bound into ``cuda_graphs`` as its ``try`` would have bound them, and
  ``HAVE_TE_GRAPHS`` set.

The modules go in *after* Megatron-Core is imported: installed before, every other ``try: import
transformer_engine`` in Megatron would take its TransformerEngine branch and need the whole
library. Nothing here is TransformerEngine's code.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

__all__ = ["TE_VERSION", "provide", "real_transformer_engine"]

#: The TransformerEngine release the surface claims: Megatron-Core 0.19.2 then passes
#: ``_num_layers_per_chunk`` (>= 2.6), ``_reuse_graph_input_output_buffers`` (>= 2.7) and
#: resets graphs in ``delete_cuda_graphs`` (>= 2.10).
TE_VERSION = "2.10.0"

_SURFACE_MARK = "_gograph_test_surface"


def real_transformer_engine() -> bool:
    """Whether a real TransformerEngine with its PyTorch part is importable."""
    te = sys.modules.get("transformer_engine")
    if te is not None:
        return not getattr(te, _SURFACE_MARK, False)
    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except (ImportError, ValueError):
        return False


class _Capturing:
    flag = False


def _set_capture_start() -> None:
    _Capturing.flag = True


def _set_capture_end() -> None:
    _Capturing.flag = False


def _is_graph_capturing() -> bool:
    return _Capturing.flag


def _make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "the test surface of transformer_engine has no make_graphed_callables: bind gograph's "
        "(gograph.integrations.megatron.use_gograph()) or install TransformerEngine"
    )


class FP8GlobalStateManager:
    """FP8 is off: the only state Megatron's graph path reads."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False


class TransformerEngineBaseModule:
    """No module of the model is a TransformerEngine module (Megatron's local layer spec)."""


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if "." not in name:
        mod.__dict__[_SURFACE_MARK] = True
    sys.modules[name] = mod
    return mod


def _install() -> dict[str, Any]:
    te = _module("transformer_engine", __version__=TE_VERSION, __path__=[])
    pt = _module("transformer_engine.pytorch", __path__=[])
    graph = _module(
        "transformer_engine.pytorch.graph",
        make_graphed_callables=_make_graphed_callables,
        set_capture_start=_set_capture_start,
        set_capture_end=_set_capture_end,
        is_graph_capturing=_is_graph_capturing,
        save_fp8_tensors=lambda modules, fp8_recipe=None: None,
        restore_fp8_tensors=lambda modules, fp8_tensors=None: None,
    )
    fp8 = _module("transformer_engine.pytorch.fp8", FP8GlobalStateManager=FP8GlobalStateManager)
    dist = _module("transformer_engine.pytorch.distributed", is_fp8_activation_recompute_enabled=lambda: False)
    module = _module("transformer_engine.pytorch.module", __path__=[])
    base = _module("transformer_engine.pytorch.module.base", TransformerEngineBaseModule=TransformerEngineBaseModule)
    utils = _module("transformer_engine.pytorch.utils", make_weak_ref=lambda x: x)
    te.pytorch, pt.graph, pt.fp8, pt.distributed, pt.module, pt.utils, module.base = (
        pt,
        graph,
        fp8,
        dist,
        module,
        utils,
        base,
    )
    # cuda_graphs.py's try block, name for name
    return {
        "is_fp8_activation_recompute_enabled": dist.is_fp8_activation_recompute_enabled,
        "FP8GlobalStateManager": FP8GlobalStateManager,
        "make_graphed_callables": graph.make_graphed_callables,
        "restore_fp8_tensors": graph.restore_fp8_tensors,
        "save_fp8_tensors": graph.save_fp8_tensors,
        "te_set_capture_end": graph.set_capture_end,
        "te_set_capture_start": graph.set_capture_start,
        "TransformerEngineBaseModule": TransformerEngineBaseModule,
        "make_weak_ref": utils.make_weak_ref,
    }


def provide() -> bool:
    """Makes Megatron-Core's TransformerEngine graph path runnable without TransformerEngine
    (see the module docstring); call after importing Megatron-Core. Returns False, touching
    nothing, where a real TransformerEngine is importable (Megatron then imported it itself)."""
    if real_transformer_engine():
        return False
    cuda_graphs = importlib.import_module("megatron.core.transformer.cuda_graphs")
    if getattr(cuda_graphs, "HAVE_TE_GRAPHS", False):
        return True  # provided already
    names = _install()
    for name, value in names.items():
        setattr(cuda_graphs, name, value)
    cuda_graphs.HAVE_TE_GRAPHS = True
    importlib.import_module("megatron.core.utils")._te_version = None  # read the surface's version
    _rng_tracker_class()
    return True


class TECudaRNGStatesTracker:
    """No RNG tracker is TransformerEngine's (placeholder for Megatron's ``isinstance`` check)."""


def _rng_tracker_class() -> None:
    """With ``HAVE_TE_GRAPHS`` set, Megatron's own ``CudaGraphManager`` (``cuda_graph_impl="local"``)
    asserts ``isinstance(rng_tracker, TECudaRNGStatesTracker)``, importing the class from
    ``megatron.core.extensions.transformer_engine``; without TransformerEngine that import may
    fail (the class is then None and ``isinstance`` raises TypeError) or give a mock. A class no
    tracker is an instance of keeps the check what it is without TransformerEngine: False."""
    name = "megatron.core.extensions.transformer_engine"
    try:
        ext = importlib.import_module(name)
    except ImportError:
        ext = _module(name)
    if not isinstance(getattr(ext, "TECudaRNGStatesTracker", None), type):
        ext.TECudaRNGStatesTracker = TECudaRNGStatesTracker  # type: ignore[attr-defined]
