"""TransformerEngine's protocols, as its ``make_graphed_callables`` defines them (d0067d0):

* ``capture_time_hooks``: per callable, hooks run around every warmup and capture step, outside
  any capture, never replayed; each is called ``hook(module)`` and must return None;
* ``sample_kwargs``: keyword args per forward pass, flattened after the positional args;
* delayed weight gradients: submodules with ``need_backward_dw()`` / ``backward_dw()`` get their
  weight-gradient work captured into a separate graph, replayed by ``backward_dw()``;
* the grad rules of its warmup (an unused sample arg is an error unless ``allow_unused_input``;
  parameters that get no grad leave the static input surface);
* the quantization arguments, accepted when they ask for no quantization;
* its capture flag: ``transformer_engine.pytorch.graph.is_graph_capturing()`` is True while
  ``make_graphed_callables`` runs (:func:`graph_capturing`).

The reference is TransformerEngine's graph.py and tests/pytorch/test_cuda_graphs.py.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..runtime import _grad_slots

__all__ = [
    "HOOK_KEYS",
    "QUANTIZATION_ARGS",
    "CallWithKwargs",
    "CaptureTimeHooks",
    "WgradBody",
    "canonicalize_capture_time_hooks",
    "canonicalize_sample_kwargs",
    "check_quantization_args",
    "discover_wgrad_modules",
    "graph_capturing",
    "has_wgrad_protocol",
    "kept_params",
    "modules_needing_dw",
    "wgrad_candidates",
]

# ---------------------------------------------------------------------------------------------
# The capture flag TransformerEngine's modules read
# ---------------------------------------------------------------------------------------------
#: The module whose ``set_capture_start`` / ``set_capture_end`` TransformerEngine's
#: ``make_graphed_callables`` calls, and whose ``is_graph_capturing()`` its modules read.
TE_GRAPH_MODULE = "transformer_engine.pytorch.graph"


@contextlib.contextmanager
def graph_capturing() -> Iterator[None]:
    """Sets TransformerEngine's capture flag for the duration of a build, as its own
    ``make_graphed_callables`` does (``set_capture_start()`` first, ``set_capture_end()`` last),
    and clears it when the build fails too. Only when TransformerEngine is already imported: a
    TransformerEngine module in the callables has imported it, and nothing else reads the flag."""
    graph = sys.modules.get(TE_GRAPH_MODULE)
    start = getattr(graph, "set_capture_start", None)
    end = getattr(graph, "set_capture_end", None)
    if not (callable(start) and callable(end)):
        yield
        return
    start()
    try:
        yield
    finally:
        end()


# ---------------------------------------------------------------------------------------------
# capture_time_hooks
# ---------------------------------------------------------------------------------------------
HOOK_KEYS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


def canonicalize_capture_time_hooks(num_callables: int, hooks: Any) -> list[dict[str, dict[Any, Any]]] | None:
    """TransformerEngine's ``_canonicalize_capture_time_hooks``: one dict per callable with every
    key present (``None`` entries and missing keys allowed), its messages; None when no hooks
    were given. Entries and values of the wrong type are a TypeError here (TransformerEngine
    fails later with an AttributeError)."""
    if hooks is None:
        return None
    if isinstance(hooks, Mapping) or not isinstance(hooks, Sequence):
        raise TypeError(
            "gograph: capture_time_hooks must be a list with one dict (or None) per callable, "
            f"got {type(hooks).__name__}"
        )
    if len(hooks) != num_callables:
        raise ValueError(f"capture_time_hooks has {len(hooks)} entries, but there are {num_callables} callables.")
    out = []
    for idx, h in enumerate(hooks):
        h = {} if h is None else h
        if not isinstance(h, Mapping):
            raise TypeError(f"gograph: capture_time_hooks[{idx}] must be a dict or None, got {type(h).__name__}")
        unexpected = set(h) - set(HOOK_KEYS)
        if unexpected:
            raise ValueError(f"Found unexpected keys in capture_time_hooks ({unexpected}).")
        entry = {}
        for key in HOOK_KEYS:
            value = h.get(key, {})
            value = {} if value is None else value
            if not isinstance(value, Mapping) or not all(callable(f) for f in value.values()):
                raise TypeError(
                    f"gograph: capture_time_hooks[{idx}][{key!r}] must be a dict of hook functions "
                    f"({{hook_id: hook}}), got {type(value).__name__}"
                )
            entry[key] = dict(value)
        out.append(entry)
    return out


class CaptureTimeHooks:
    """Runs the capture-time hooks of one build: ``hook(module)`` for every hook of the key,
    outside any capture (TransformerEngine's ``_run_capture_time_hooks``)."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: list[dict[str, dict[Any, Any]]] | None) -> None:
        self.hooks = hooks

    def run(self, key: str, callable_index: int, module: Any) -> None:
        if self.hooks is None:
            return
        for hook in self.hooks[callable_index][key].values():
            if hook(module) is not None:
                raise RuntimeError(f"capture_time_hooks {key} must not return a value.")


# ---------------------------------------------------------------------------------------------
# sample_kwargs
# ---------------------------------------------------------------------------------------------
def canonicalize_sample_kwargs(
    sample_kwargs: Any, num: int, just_one: bool, ordered: bool, num_callables: int
) -> tuple[dict[str, Any], ...]:
    """One dict per forward pass (TransformerEngine's checks and messages)."""
    if sample_kwargs is None:
        return tuple({} for _ in range(num))
    if just_one:
        sample_kwargs = (sample_kwargs,)
    if isinstance(sample_kwargs, Mapping) or not isinstance(sample_kwargs, (tuple, list)):
        raise TypeError(
            "gograph: sample_kwargs must be a dict for a single callable, or a tuple/list with one dict "
            f"per {'forward pass' if ordered else 'callable'}; got {type(sample_kwargs).__name__}"
        )
    if len(sample_kwargs) != num:
        if ordered:
            raise ValueError(
                "Pipeline-parallel schedule requires sample_kwargs and sample_args to have "
                f"the same length, but got {len(sample_kwargs)} sample_kwargs for {num} sample_args"
            )
        raise ValueError(
            "Expected sample_kwargs to have the same length as callables, "
            f"but got {len(sample_kwargs)} sample_kwargs for {num_callables} callables"
        )
    out = []
    for i, kw in enumerate(sample_kwargs):
        kw = {} if kw is None else kw
        if not isinstance(kw, Mapping) or not all(isinstance(k, str) for k in kw):
            raise TypeError(f"gograph: sample_kwargs[{i}] must be a dict with str keys, got {type(kw).__name__}")
        out.append(dict(kw))
    return tuple(out)


class CallWithKwargs:
    """A forward body called with the positional sample args followed by the values of the
    captured kwargs (in key order): engines record bodies with positional args only."""

    __slots__ = ("body", "keys", "n_args")

    def __init__(self, body: Any, n_args: int, keys: tuple[str, ...]) -> None:
        self.body = body
        self.n_args = n_args
        self.keys = keys

    @property
    def out_spec(self) -> Any:
        return self.body.out_spec

    @property
    def label(self) -> str:
        return str(self.body.label)

    @property
    def module(self) -> Any:
        return getattr(self.body, "module", None)

    def __call__(self, *args: Any) -> Any:
        n = self.n_args
        return self.body(*args[:n], **dict(zip(self.keys, args[n:])))


# ---------------------------------------------------------------------------------------------
# Quantization arguments (accepted when they ask for none)
# ---------------------------------------------------------------------------------------------
#: TransformerEngine's FP8/FP4 arguments of make_graphed_callables (old names, then new ones).
QUANTIZATION_ARGS = (
    "fp8_enabled",
    "fp8_calibrating",
    "fp8_recipe",
    "fp8_group",
    "fp8_weight_caching",
    "enabled",
    "calibrating",
    "recipe",
    "amax_reduction_group",
    "cache_quantized_params",
)
_SWITCHES = ("fp8_enabled", "enabled", "fp8_calibrating", "calibrating", "fp8_weight_caching", "cache_quantized_params")


def _asks_for_quantization(name: str, value: Any) -> bool:
    if value is None or value is False:
        return False
    return not (name in ("fp8_enabled", "enabled") and isinstance(value, tuple) and all(v is False for v in value))


def check_quantization_args(args: Mapping[str, Any]) -> None:
    """Accepts TransformerEngine's quantization arguments (Megatron-LM passes
    ``fp8_enabled=False``) when none asks for quantization: switches False/None (or a tuple of
    False), recipes, groups and caching None. Anything that asks for FP8/FP4 raises
    NotImplementedError naming the argument: gograph graphs without TransformerEngine's
    quantization state."""
    for name, value in args.items():
        if name not in QUANTIZATION_ARGS:
            raise TypeError(f"make_graphed_callables() got an unexpected keyword argument {name!r}")
        if name in _SWITCHES and not (value is None or isinstance(value, (bool, tuple))):
            raise TypeError(f"gograph: {name} must be a bool (or a tuple of bools), got {type(value).__name__}")
        if _asks_for_quantization(name, value):
            raise NotImplementedError(
                f"gograph: {name}={value!r} asks for FP8/FP4 quantization, which gograph does not implement "
                "(it captures no TransformerEngine quantization state); graph with it off "
                f"({name}={'False' if name in _SWITCHES else 'None'}), or use TransformerEngine's "
                "make_graphed_callables for quantized layers"
            )


# ---------------------------------------------------------------------------------------------
# Delayed weight gradients (the protocol, without TransformerEngine's module classes)
# ---------------------------------------------------------------------------------------------
def has_wgrad_protocol(module: Any) -> bool:
    """A submodule takes part when it defines ``need_backward_dw()`` and ``backward_dw()``."""
    if isinstance(module, torch.nn.Module):
        # Instance dict, then class: what getattr finds for methods, without going through
        # nn.Module.__getattr__, whose miss (the common case) builds an AttributeError.
        inst, cls = module.__dict__, type(module)
        return callable(inst.get("need_backward_dw", getattr(cls, "need_backward_dw", None))) and callable(
            inst.get("backward_dw", getattr(cls, "backward_dw", None))
        )
    return callable(getattr(module, "need_backward_dw", None)) and callable(getattr(module, "backward_dw", None))


def wgrad_candidates(func: Any) -> tuple[Any, ...]:
    """The modules :func:`discover_wgrad_modules` watches: ``func``'s submodules implementing the
    protocol, then ``func`` itself when it does (empty for a function, or a module where none
    does)."""
    if not isinstance(func, torch.nn.Module):
        return ()
    subs = tuple(m for m in func.modules() if m is not func and has_wgrad_protocol(m))
    return subs + ((func,) if has_wgrad_protocol(func) else ())


@contextlib.contextmanager
def discover_wgrad_modules(
    func: Any, found: dict[int, Any], candidates: tuple[Any, ...] | None = None
) -> Iterator[None]:
    """While active, every candidate of ``func`` whose forward runs is added to ``found``
    (id -> module, first-seen order); the temporary forward hooks go even when the forward
    raises."""
    candidates = wgrad_candidates(func) if candidates is None else candidates
    if not candidates:
        yield
        return

    def hook(module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        found.setdefault(id(module), module)

    handles = []
    try:
        for m in candidates:
            if m is not func:
                handles.append(m.register_forward_hook(hook))
        yield
        if candidates[-1] is func:  # the graphed module itself gets no hook (it must have none)
            found.setdefault(id(func), func)
    finally:
        for h in reversed(handles):
            h.remove()


def modules_needing_dw(modules: Sequence[Any]) -> list[Any]:
    return [m for m in modules if m.need_backward_dw()]


def _weak_callable(fn: Any) -> Callable[[], Any]:
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


class WgradBody:
    """Capture body of a pass's weight-gradient graph: ``backward_dw()`` of each discovered
    submodule whose ``need_backward_dw()`` is True. Modules are held weakly; their
    ``backward_dw`` methods are bound when the body is made (a graphed module's own
    ``backward_dw`` attribute is then replaced by the graphed callable's).

    Its first run (the capture) also records what the work did to each ``.grad`` and
    ``.main_grad`` of the modules' parameters (:mod:`gograph.runtime._grad_slots`): the tensors it added
    into in place and the tensors it assigned are the graph's ``targets``, each served at replay
    as the core's grad-slot policy says, whatever the caller did to the slot since. A later run
    (the eager engine's replay) writes what the graph writes (:func:`_grad_slots.as_captured`)."""

    __slots__ = ("_calls", "_fillers", "_refs", "label", "targets")

    def __init__(self, modules: Sequence[Any], label: str, fill_empty: bool = False) -> None:
        """``fill_empty``: no warmup ran the work before this capture; each empty ``.grad`` is shown
        a zero tensor (made now, outside the capture), so that the capture sees what the work does
        to an existing one."""
        self._refs = tuple(weakref.ref(m) for m in modules)
        self._calls = tuple(_weak_callable(m.backward_dw) for m in modules)
        self.label = label
        self.targets: tuple[_grad_slots.WgradTarget, ...] | None = None
        self._fillers = _grad_slots.fillers(modules) if fill_empty else []

    def modules(self) -> list[Any]:
        out = []
        for r in self._refs:
            m = r()
            if m is None:
                raise RuntimeError(
                    f"gograph: a submodule of {self.label} with a delayed weight gradient no longer exists"
                )
            out.append(m)
        return out

    def __call__(self) -> tuple[()]:
        mods = self.modules()
        if self.targets is None:  # the capture: what the work does to each slot
            before = _grad_slots.snapshot(mods)
            _grad_slots.show(self._fillers)
            shown = _grad_slots.snapshot(mods) if self._fillers else before
            self._fillers = []
            try:
                self._run(mods)
            finally:
                self.targets = _grad_slots.capture_targets(shown, before)
        elif self.targets:  # an eager replay writes what the graph writes
            _grad_slots.as_captured(self.targets, lambda: self._run(mods), self.label)
        else:
            self._run(mods)
        return ()

    def _run(self, mods: Sequence[Any]) -> None:
        for m, call in zip(mods, self._calls):
            if m.need_backward_dw():
                fn = call()
                if fn is None:
                    raise RuntimeError(
                        f"gograph: a submodule of {self.label} with a delayed weight gradient no longer exists"
                    )
                fn()


# ---------------------------------------------------------------------------------------------
# Grad rules of TransformerEngine's warmup
# ---------------------------------------------------------------------------------------------
def kept_params(
    n_user_requiring_grad: int,
    surface: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    params: tuple[torch.nn.Parameter, ...],
    allow_unused_input: bool,
    it: int,
) -> tuple[torch.nn.Parameter, ...]:
    """TransformerEngine's rules after a warmup backward over ``surface`` (the args and
    parameters that require grad): a sample arg that got no grad is an error unless
    ``allow_unused_input``; parameters that got none in the first iteration leave the static
    input surface (and may not appear later). Returns the parameters kept."""
    kept = []
    for k, g in enumerate(grads):
        if k < n_user_requiring_grad:
            if g is None and not allow_unused_input:
                raise RuntimeError(
                    "The input tensor requires grad, but the grad is None after backward pass. (gograph: the "
                    f"sample arg number {k} of those that require grad does not reach the outputs; pass "
                    "allow_unused_input=True to make_graphed_callables if that is intended)"
                )
        elif g is not None:
            kept.append(surface[k])
    if len(kept) != len(params):
        if it != 0:
            raise RuntimeError(
                "no-grad params should only be used as inputs in the first warmup"
                f" iteration, but found in iteration {it}"
            )
        return tuple(kept)  # type: ignore[arg-type]
    return params
