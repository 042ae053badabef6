"""Every argument check of ``make_graphed_callables`` and the canonical form of its arguments.

:func:`normalize` checks what needs no engine and no core (torch's and TransformerEngine's
checks and messages, plus gograph's) and returns a frozen :class:`Request`; once the core has
planned the schedule (:mod:`gograph.request._planned`), :func:`pass_specs` gives one frozen
:class:`PassSpec` per graphed pass (the checks that depend on the engine chosen are
:mod:`gograph.request._fit`'s). Nothing here calls an engine or the core.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, Union

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..runtime import _pool
from ..runtime.engines import Engine
from . import _te
from ._marks import GraphedMark

if TYPE_CHECKING:  # pragma: no cover
    from ..core._plan import Schedule

__all__ = [
    "GraphOptions",
    "PassSpec",
    "Request",
    "label_of",
    "normalize",
    "pass_specs",
    "schedule_training",
]

ModuleOrCallable = Union[torch.nn.Module, Callable[..., object]]  # noqa: UP007 (a runtime alias on Python 3.10)

#: CUstreamCaptureMode by torch's name for it (``capture_error_mode``).
CAPTURE_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}


class GraphOptions(TypedDict, total=False):
    """The keyword arguments of ``make_graphed_callables`` (see its docstring)."""

    engine: Any
    clone_param_grads_on_return: bool
    lend_param_grads: bool | None
    debug_replay_order: bool | None
    progress: bool
    chain_buffers: bool
    capture_error_mode: str
    sample_kwargs: Any
    _order: Sequence[int | float] | None
    _num_layers_per_chunk: int | Sequence[int] | None
    retain_graph_in_backward: bool
    _reuse_graph_input_output_buffers: bool
    share_microbatch_graphs: bool
    pre_warmup_hook: Callable[[], Any] | None
    post_warmup_hook: Callable[[], Any] | None
    capture_time_hooks: Sequence[dict[str, dict[Any, Any]] | None] | None
    _clone_param_grads_on_return: bool | None
    fp8_enabled: bool | tuple[bool, ...] | None
    fp8_calibrating: bool | None
    fp8_recipe: Any
    fp8_group: Any
    fp8_weight_caching: bool | None
    enabled: bool | tuple[bool, ...] | None
    calibrating: bool | None
    recipe: Any
    amax_reduction_group: Any
    cache_quantized_params: bool | None


_OPTIONS = frozenset(GraphOptions.__annotations__)


@dataclass(frozen=True)
class Request:
    """The canonical arguments of one call: per forward pass its sample args and kwargs."""

    callables: tuple[ModuleOrCallable, ...]
    sample_args: tuple[tuple[Any, ...], ...]
    sample_kwargs: tuple[dict[str, Any], ...]
    just_one: bool
    num_warmup_iters: int
    allow_unused_input: bool
    pool: Hashable | None
    engine: Any
    clone_param_grads: bool
    lend_param_grads: bool | None
    debug_replay_order: bool | None
    progress: bool
    chain: bool
    reuse: bool
    share: bool
    order: tuple[Any, ...] | None
    layers: Any
    training: bool
    retain_graph: bool
    capture_mode: int
    hooks: _te.CaptureTimeHooks
    pre_warmup_hook: Callable[[], Any] | None
    post_warmup_hook: Callable[[], Any] | None
    #: The caller's own ``sample_args`` and ``sample_kwargs`` (a buffer-reuse build reorganises
    #: a list of them in place, as TransformerEngine does).
    given_sample_args: Any = None
    given_sample_kwargs: Any = None

    @property
    def ordered(self) -> bool:
        return self.order is not None


@dataclass(frozen=True)
class PassSpec:
    """One graphed pass as given: a callable, or with ``_order`` one forward of one callable.

    ``flat_args`` are the positional leaves (``n_pos`` of them) then the leaves of the captured
    kwargs in key order; with the module's ``params`` they are the static input surface.
    ``forward_fn`` is the callable's forward (unbound from its module when ``forward_is_method``):
    what a function's pass runs; a module's pass runs the module through its class's ``__call__``
    (:class:`gograph.runtime._bodies.ForwardBody`), and its graphed callable falls back to this forward."""

    index: int
    callable_index: int
    label: str
    func: ModuleOrCallable
    sample_args: tuple[Any, ...]
    sample_kwargs: Mapping[str, Any]
    kwargs_keys: tuple[str, ...]
    flat_args: tuple[Tensor, ...]
    n_pos: int
    args_spec: pytree.TreeSpec
    kwargs_spec: pytree.TreeSpec | None
    params: tuple[torch.nn.Parameter, ...]
    training: bool | None
    grad_enabled: bool
    forward_fn: Callable[..., Any] = field(repr=False)
    forward_is_method: bool = False
    te_grads: bool = False  # TransformerEngine's grad rules apply (_order)

    @property
    def module(self) -> torch.nn.Module | None:
        return self.func if isinstance(self.func, torch.nn.Module) else None


def label_of(func: Any) -> str:
    if isinstance(func, torch.nn.Module):
        return type(func).__name__
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__)


# ---------------------------------------------------------------------------------------------
# normalize
# ---------------------------------------------------------------------------------------------
def normalize(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: Any,
    allow_unused_input: Any,
    pool: Any,
    options: Mapping[str, Any],
) -> Request:
    """Checks the arguments and returns their canonical form."""
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise TypeError(f"make_graphed_callables() got an unexpected keyword argument {unknown[0]!r}")
    _te.check_quantization_args({k: v for k, v in options.items() if k in _te.QUANTIZATION_ARGS})
    pool, options = _pool_or_sample_kwargs(pool, options)
    _check_bool("allow_unused_input", allow_unused_input)
    order = options.get("_order")
    just_one = not isinstance(callables, tuple)
    callables_t = (callables,) if just_one else callables
    args_t = _sample_args(sample_args, just_one, order is not None, len(callables_t))
    callables_t = _validate_callables(callables_t, num_warmup_iters, ordered=order is not None)
    training = torch.is_grad_enabled() and all(c.training for c in callables_t if isinstance(c, torch.nn.Module))
    flags = _flags(options, order is not None, training, num_warmup_iters)
    for name in ("pre_warmup_hook", "post_warmup_hook"):
        hook = options.get(name)
        if hook is not None and not callable(hook):
            raise TypeError(
                f"gograph: {name} must be callable (called once, without arguments), got {type(hook).__name__}"
            )
    kwargs_t = _te.canonicalize_sample_kwargs(
        options.get("sample_kwargs"), len(args_t), just_one, order is not None, len(callables_t)
    )
    _check_engine_name(options.get("engine"))
    for i, (args, kwargs) in enumerate(zip(args_t, kwargs_t)):
        _check_leaves(i, None if order is not None else callables_t[i], args, kwargs, order is not None)
    return Request(
        callables=callables_t,
        sample_args=args_t,
        sample_kwargs=kwargs_t,
        just_one=just_one,
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=bool(allow_unused_input),
        pool=pool,
        engine=options.get("engine"),
        order=tuple(order) if order is not None else None,
        layers=options.get("_num_layers_per_chunk"),
        training=training,
        hooks=_te.CaptureTimeHooks(
            _te.canonicalize_capture_time_hooks(len(callables_t), options.get("capture_time_hooks"))
        ),
        pre_warmup_hook=options.get("pre_warmup_hook"),
        post_warmup_hook=options.get("post_warmup_hook"),
        given_sample_args=sample_args,
        given_sample_kwargs=options.get("sample_kwargs"),
        **flags,
    )


def _sample_args(sample_args: Any, just_one: bool, ordered: bool, n: int) -> tuple[tuple[Any, ...], ...]:
    if sample_args is None:
        raise TypeError(
            "gograph: sample_args is None; pass the sample args the callable is graphed with: a tuple of "
            "tensors for one callable (e.g. (x,)), or one such tuple per callable"
        )
    args_t = (sample_args,) if just_one else sample_args
    if ordered and isinstance(args_t, list):
        args_t = tuple(args_t)  # TransformerEngine takes a list with _reuse_graph_input_output_buffers
    if not isinstance(args_t, tuple) or (not ordered and len(args_t) != n):
        raise ValueError(
            f"gograph: sample_args must hold one tuple of args per callable ({n} callables, "
            f"got {len(args_t) if isinstance(args_t, tuple) else type(args_t).__name__})"
        )
    for i, a in enumerate(args_t):
        if not isinstance(a, (tuple, list, Tensor)):
            where = "sample_args" if just_one else f"sample_args[{i}]"
            raise TypeError(
                f"gograph: {where} is a {type(a).__name__}; the sample args of a "
                f"{'forward pass' if ordered else 'callable'} are a tuple of tensors (a single tensor is taken "
                "as a tuple of one)"
            )
    return tuple(a if isinstance(a, tuple) else (a,) if isinstance(a, Tensor) else tuple(a) for a in args_t)


#: The options that must be True or False (None, where allowed, means "not given").
_BOOL_OPTIONS = {
    "clone_param_grads_on_return": False,
    "_clone_param_grads_on_return": True,
    "debug_replay_order": True,
    "progress": False,
    "chain_buffers": False,
    "retain_graph_in_backward": False,
    "_reuse_graph_input_output_buffers": False,
    "share_microbatch_graphs": False,
}


def _check_bool(name: str, value: Any, none_ok: bool = False) -> None:
    if isinstance(value, bool) or (none_ok and value is None):
        return
    raise TypeError(
        f"gograph: {name} must be a bool (True or False{' or None' if none_ok else ''}), got {value!r} "
        f"(a {type(value).__name__}); pass a bool"
    )


def _flags(options: Mapping[str, Any], ordered: bool, training: bool, warmup: int) -> dict[str, Any]:
    """The boolean and mode options, checked."""
    for name, none_ok in _BOOL_OPTIONS.items():
        if name in options:
            _check_bool(name, options[name], none_ok)
    clone = options.get("_clone_param_grads_on_return")
    clone = options.get("clone_param_grads_on_return", True) if clone is None else clone
    retain = options.get("retain_graph_in_backward", False)
    reuse = bool(options.get("_reuse_graph_input_output_buffers", False))
    if reuse and not ordered:
        raise ValueError("`_order` must be provided when `_reuse_graph_input_output_buffers` is True.")
    if reuse and not training:
        raise RuntimeError("`_reuse_graph_input_output_buffers` is only available in training mode.")
    chain = options.get("chain_buffers", False)
    if chain and warmup < 1:
        raise ValueError(
            "gograph: chain_buffers needs num_warmup_iters >= 1 (warmup learns the outputs each "
            "layer hands to the next)"
        )
    share = _share_option(options, ordered, reuse, bool(chain), bool(clone))
    mode = options.get("capture_error_mode", "global")
    if mode not in CAPTURE_MODES:
        raise ValueError(f"gograph: capture_error_mode must be one of {sorted(CAPTURE_MODES)} (torch's), got {mode!r}")
    debug = options.get("debug_replay_order")
    lend = options.get("lend_param_grads")
    if lend is not None and not isinstance(lend, bool):
        raise TypeError(
            f"gograph: lend_param_grads must be None (lend once the grads are seen dropped after a step), True "
            f"(lend from the first backward) or False (never lend), got {type(lend).__name__}"
        )
    return {
        "clone_param_grads": bool(clone),
        "lend_param_grads": lend,
        "retain_graph": retain,
        "reuse": reuse,
        "chain": chain,
        "share": share,
        "capture_mode": CAPTURE_MODES[mode],
        "debug_replay_order": None if debug is None else bool(debug),
        "progress": bool(options.get("progress", False)),
    }


def _share_option(options: Mapping[str, Any], ordered: bool, reuse: bool, chain: bool, clone: bool) -> bool:
    """``share_microbatch_graphs``: only with ``_order`` (the schedule says which microbatches are
    in flight together), not with chained buffers (they span passes), and not with torch's
    aliased parameter grads."""
    share = bool(options.get("share_microbatch_graphs", False))
    if share and not ordered:
        raise ValueError(
            "gograph: share_microbatch_graphs needs _order: the pipeline schedule says which microbatches of a "
            "layer are in flight together (without _order every callable is one pass)"
        )
    if share and chain:
        raise ValueError(
            "gograph: share_microbatch_graphs cannot be combined with chain_buffers: a chained buffer spans "
            "two passes, and a shared graph's buffers serve several microbatches; choose one (with "
            "_reuse_graph_input_output_buffers, shared graphs reuse the samples and grad-output buffers)"
        )
    if share and not clone:
        raise ValueError(
            "gograph: share_microbatch_graphs needs clone_param_grads_on_return=True: with torch's aliasing a "
            "microbatch's .grad would be the static buffer the next microbatch's backward overwrites"
        )
    return share


def _pool_or_sample_kwargs(pool: Any, options: Mapping[str, Any]) -> tuple[Any, Mapping[str, Any]]:
    """The 5th positional argument is ``pool`` in torch's ``make_graphed_callables`` and
    ``sample_kwargs`` in TransformerEngine's: a dict, or a sequence of dicts/None, is
    TransformerEngine's ``sample_kwargs``; a pool token or ``MemPool`` is torch's ``pool``
    (returned as its token)."""
    if not _looks_like_sample_kwargs(pool):
        try:
            return _pool.check(pool), options
        except TypeError as e:
            raise TypeError(
                f"{e} (torch's 5th positional argument, pool); TransformerEngine's 5th positional argument, "
                "sample_kwargs, is a dict or a sequence with one dict (or None) per callable"
            ) from None
    if options.get("sample_kwargs") is not None:
        raise TypeError(
            "gograph: sample_kwargs given twice: as the 5th positional argument (TransformerEngine's "
            "sample_kwargs) and as a keyword; pass it once"
        )
    return None, {**options, "sample_kwargs": pool}


def _looks_like_sample_kwargs(value: Any) -> bool:
    if isinstance(value, Mapping):
        return True
    return (
        isinstance(value, (tuple, list)) and len(value) > 0 and all(v is None or isinstance(v, Mapping) for v in value)
    )


def _validate_callables(callables: Any, num_warmup_iters: Any, ordered: bool) -> tuple[ModuleOrCallable, ...]:
    """With ``_order`` a module may appear more than once: its forward is not replaced."""
    if len(callables) == 0:
        raise ValueError(
            "gograph: make_graphed_callables got an empty tuple of callables; pass a module or "
            "function, or a non-empty tuple of them (with one tuple of sample args each)"
        )
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int):
        raise TypeError(f"gograph: num_warmup_iters must be an int >= 0, got {type(num_warmup_iters).__name__}")
    if num_warmup_iters < 0:
        raise ValueError(f"gograph: num_warmup_iters must be >= 0, got {num_warmup_iters}")
    seen: dict[int, int] = {}
    modes: dict[bool, list[int]] = {True: [], False: []}
    for i, c in enumerate(callables):
        _check_callable(i, c)
        if isinstance(c, torch.nn.Module):
            if id(c) in seen and not ordered:
                raise ValueError(
                    f"gograph: callable {i} is the same module as callable {seen[id(c)]} ({label_of(c)}). Each "
                    "module is graphed once (its forward is replaced); to run a layer several times per "
                    "step, graph separate copies of it"
                )
            seen[id(c)] = i
            modes[bool(c.training)].append(i)
    if ordered and modes[True] and modes[False]:  # torch's call shape takes both, per pass
        raise ValueError(
            "gograph: with _order (TransformerEngine's schedule) the modules must be all in training mode or all "
            f"in eval mode (modules {modes[True]} are training, {modes[False]} are in eval); call .train() or "
            ".eval() on all of them, or graph the two groups in separate calls"
        )
    return tuple(callables)


def _check_callable(i: int, c: Any) -> None:
    if isinstance(c, (list, tuple)):
        raise TypeError(
            f"gograph: callable {i} is a {type(c).__name__}; callables must be a module or function, or a "
            "flat tuple of them (convert a list with tuple(...), and pass sample_args as a tuple of tuples)"
        )
    if isinstance(c, GraphedMark):
        raise TypeError(
            f"gograph: callable {i} ({c.label}) is already a graphed callable; pass the original module "
            "or function (a graph cannot be captured inside another graph)"
        )
    if not callable(c):
        raise TypeError(
            f"gograph: callable {i} (of type {type(c).__name__}) is not callable; pass torch.nn.Modules or functions"
        )
    if isinstance(c, torch.nn.Module):
        fwd = c.__dict__.get("forward")
        if isinstance(fwd, GraphedMark) and not fwd.is_reset:
            raise ValueError(
                f"gograph: module {i} ({label_of(c)}) is already graphed (its forward is a live "
                "GraphedCallable). Call its reset() first to release those graphs, then graph it again"
            )
        if c._backward_hooks or c._forward_hooks or c._forward_pre_hooks:
            raise AssertionError(
                "Modules must not have hooks registered at the time they are passed. However, registering hooks "
                + "on modules after passing them through make_graphed_callables is allowed."
            )
        if not all(b.requires_grad is False for b in c.buffers()):
            raise AssertionError(
                "In any :class:`~torch.nn.Module` passed to "
                + ":func:`~make_graphed_callables`, only parameters may be trainable. All buffers must have "
                + "``requires_grad=False``."
            )


# ---------------------------------------------------------------------------------------------
# per-pass specs
# ---------------------------------------------------------------------------------------------
def pass_specs(req: Request, schedule: Schedule) -> tuple[PassSpec, ...]:
    """One spec per forward pass: per callable, or with ``_order`` per forward (TransformerEngine's
    indexing: the schedule's pass -> callable map)."""
    return tuple(
        _pass_spec(req, schedule, i, args, kwargs)
        for i, (args, kwargs) in enumerate(zip(req.sample_args, req.sample_kwargs))
    )


def _pass_spec(req: Request, schedule: Schedule, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PassSpec:
    ci = schedule.callable_of[i]
    c = req.callables[ci]
    pos_leaves, args_spec = pytree.tree_flatten(args)
    keys = tuple(kwargs)
    kw_leaves, kwargs_spec = pytree.tree_flatten([kwargs[k] for k in keys])
    flat = tuple(pos_leaves) + tuple(kw_leaves)
    label = schedule.pass_label(i, label_of(c))
    grad_enabled = schedule_training(req)
    fn, is_method = _forward_of(c)
    return PassSpec(
        index=i,
        callable_index=ci,
        label=label,
        func=c,
        sample_args=args,
        sample_kwargs=kwargs,
        kwargs_keys=keys,
        flat_args=flat,
        n_pos=len(pos_leaves),
        args_spec=args_spec,
        kwargs_spec=kwargs_spec if keys else None,
        params=tuple(c.parameters()) if isinstance(c, torch.nn.Module) else (),
        training=c.training if isinstance(c, torch.nn.Module) else None,
        grad_enabled=grad_enabled,
        forward_fn=fn,
        forward_is_method=is_method,
        te_grads=req.ordered,
    )


def schedule_training(req: Request) -> bool:
    """Whether the build's passes may have a backward. The default schedule follows eager (and
    torch's make_graphed_callables, which graphs eval modules forward and backward): grad mode
    at the call; a pass then has a backward exactly when its outputs require grad, whatever its
    module's train/eval mode (which only changes what its forward computes). With ``_order``,
    TransformerEngine's rule: all modules in training mode with grad mode on, else the order is
    forward-only and nothing is differentiable (a backward through such a pass raises)."""
    return req.training if req.ordered else torch.is_grad_enabled()


def _check_leaves(i: int, c: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], ordered: bool) -> None:
    """Every leaf of entry ``i``'s sample args and kwargs is a tensor (torch's check and message;
    ``c``: the entry's callable, None for a pass of an ``_order``, whose callable the schedule says)."""
    pos = pytree.tree_leaves(args)
    for j, leaf in enumerate(pos + pytree.tree_leaves([kwargs[k] for k in kwargs])):
        if not isinstance(leaf, Tensor):
            what = "sample args" if j < len(pos) else "sample_kwargs"
            whose = f"pass {i}" if ordered else f"callable {i} ({label_of(c)})"
            raise AssertionError(
                "In the beta API, sample_args "
                + "for each callable must contain only Tensors. Other types are not allowed."
                + f" (gograph: leaf {j} of the {what} of {whose} "
                + f"is a {type(leaf).__name__}; pass tensors only, and bind other values into the callable, "
                + "e.g. with functools.partial)"
            )


def _check_engine_name(engine: Any) -> None:
    """``engine=``: None, a name, or an engine (which engine it resolves to is decided once the
    core has planned the passes, :func:`gograph.runtime.engines.resolve_engine`)."""
    if not isinstance(engine, Engine) and engine not in (None, "eager", "cuda"):
        raise ValueError(f"gograph: engine must be None, 'eager', 'cuda' or an Engine instance, not {engine!r}")


def _forward_of(c: Any) -> tuple[Callable[..., Any], bool]:
    """A function itself, or a module's own forward and whether it is a method of the module (then
    unbound, so that what holds it never keeps the module alive): what the graphed callable runs
    in the other train/eval mode or when its pass's ``__call__`` reaches it."""
    if not isinstance(c, torch.nn.Module):
        return c, False
    fwd = c.forward
    if isinstance(fwd, GraphedMark) and fwd.original_forward is not None:
        return fwd.original_forward, fwd.original_forward_is_method  # graphed before and reset since
    is_method = inspect.ismethod(fwd) and fwd.__self__ is c
    return (getattr(fwd, "__func__", fwd) if is_method else fwd), is_method
