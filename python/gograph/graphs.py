"""``make_graphed_callables``: torch's API, TransformerEngine's extensions, the Go core's plans.

The call is a straight line: normalise the arguments (:mod:`gograph.request._args`), let the core plan
the schedule (:mod:`gograph.core._plan`), build -- warmup, captures and every release point are the
core's program, executed by :class:`gograph.build._build.Build` -- and return the graphed callables in
the structure of ``callables``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import torch

from .build._build import prepared
from .core import _core, _native
from .probes._probe import SeedTrace
from .probes._recarve import DebugRecorder
from .replay.graphed import GraphedCallable
from .request import _args, _te
from .runtime._pool import EagerPool
from .runtime.engines import capturing_on_this_thread

if sys.version_info >= (3, 11):  # pragma: no cover - version dependent
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

if TYPE_CHECKING:  # pragma: no cover
    from .request._args import GraphOptions

__all__ = ["GraphedModule", "graph_pool_handle", "live_graphs", "live_passes", "live_plans", "make_graphed_callables"]

_F = TypeVar("_F", bound=Callable[..., Any])


class GraphedModule(Protocol):
    """A module graphed by :func:`make_graphed_callables` (the module itself, its ``forward``
    replaced by its :class:`GraphedCallable`): typed users see ``reset`` and ``backward_dw``
    besides everything the module has."""

    forward: GraphedCallable

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def reset(self) -> None: ...
    def backward_dw(self) -> None: ...
    def __getattr__(self, name: str) -> Any: ...


@overload
def make_graphed_callables(  # type: ignore[overload-overlap]
    callables: torch.nn.Module,
    sample_args: tuple[Any, ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Hashable | None = None,
    **options: Unpack[GraphOptions],
) -> GraphedModule: ...


@overload
def make_graphed_callables(
    callables: tuple[Any, ...],
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Hashable | None = None,
    **options: Unpack[GraphOptions],
) -> tuple[Any, ...]: ...


@overload
def make_graphed_callables(
    callables: Callable[..., Any],
    sample_args: tuple[Any, ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Hashable | None = None,
    **options: Unpack[GraphOptions],
) -> GraphedCallable: ...


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Hashable | None = None,
    **options: Unpack[GraphOptions],
) -> Any:
    r"""Accepts callables (functions or :class:`torch.nn.Module`\ s) and returns graphed versions.

    A drop-in for :func:`torch.cuda.make_graphed_callables` (torch 2.9-2.11, and the
    ``capture_error_mode`` / ``torch.cuda.MemPool`` arguments of later torch) and for
    TransformerEngine's ``make_graphed_callables`` (all but quantization): each graphed
    callable's forward runs its source callable's forward work as one graph replay inside a
    single autograd node, whose backward runs the callable's backward work as one graph replay.
    The graphs are captured and launched by gograph's Go core, which also plans every buffer's
    lifetime. Warmup and capture call a module as torch and TransformerEngine do, through its
    class's ``__call__`` (without hooks: torch's rule), and a function itself.

    Arguments:
        callables: a module or function, or a tuple of them. With a tuple, all captures share one
            memory pool, and the order must be the order in which they run in the workload.
        sample_args: a tuple of args for the single callable, or a tuple of such tuples. Args may
            be any pytree (tuples, lists, dicts) whose leaves are all Tensors; a call must pass args
            of the same structure, shapes and devices (a dtype the copy-in casts is accepted). The
            ``requires_grad`` state of each leaf must match the real inputs'. Each sample is its
            graph's static input, as in torch, except where samples share memory (one tensor for
            several callables or twice in one, overlapping views, a parameter): a leaf that
            requires grad and whose memory another live pass reads (by the schedule), a second
            leaf of one callable, and a parameter get a clone, so no copy-in changes what another
            graph's pending backward reads (torch's graphs would share one buffer, silently
            wrong), nor the weights. Shared leaves that need no grad (masks, rotary embeddings)
            stay one buffer, as in torch: pass every layer of a step the same contents (the same
            tensor is copied once); other contents while a sharer's backward is still to run
            raise ``SharedInputError`` instead of changing what that backward reads.
        num_warmup_iters: forward+backward warmup iterations before capture (default 3). With 0,
            generator use is unknown and CUDA captures always carry RNG state.
        allow_unused_input: if False, a sample arg (or parameter) that requires grad but is not
            used to compute the outputs is an error.
        pool: memory-pool token shared with other captures (``gograph.graph_pool_handle()``,
            ``torch.cuda.graph_pool_handle()``, or a ``torch.cuda.MemPool``); a new pool when None.

    Keyword options (all optional):
        engine: None picks :class:`~gograph.engines.CudaEngine` for CUDA sample tensors and the
            eager reference engine for CPU tensors; ``"cuda"``, ``"eager"`` or an Engine force one.
        chain_buffers: plan the buffers of a chain of layers (callable i+1, or the next layer of a
            chunk with ``_order``, is called with callable i's output, as in ``nn.Sequential`` or a
            transformer's layer loop): the next layer's graph reads that output in place (no static
            input copy; it must then be called with that output itself, or ChainedInputError), its
            input grad is the previous layer's grad-output buffer, grads that the next backward
            consumed go back to the pool, and parameter grads are lent to ``.grad`` (the static
            buffer itself, copied out only when ``.grad`` still holds it at a replay that could
            overwrite it). What eager training's memory costs, without its copies. Needs
            ``num_warmup_iters >= 1``.
        clone_param_grads_on_return: never let a static grad buffer become a parameter's ``.grad``
            that a later replay overwrites (default): when ``.grad`` is None, on the default
            schedule the buffer is lent (``.grad`` is the buffer, copied out before a replay would
            overwrite it while anything holds it; a kept view raises), else an owned copy (one
            backward's copies share one allocation, freed with the last of them); an
            in-place add when ``.grad`` exists. Parameters with ``skip_backward_post_hook=True`` are
            never cloned. False: torch's aliasing (pytorch#181723).
        lend_param_grads: where parameter grads may be lent (the default schedule), when: None
            (default) once the callable has seen the caller drop its grads after a step (a
            parameter's first grad is an owned copy, so a ``.grad`` that lives on --
            ``zero_grad(set_to_none=False)``, accumulation -- keeps its address, as eagerly);
            True from the first backward, for loops that set the grads to None before the next
            forward (the first step then costs no owned copies; a ``.grad`` kept past the next
            replay is copied out once, so its address moves once, and the callable stops
            lending); False never (owned copies).
        capture_error_mode: ``"global"`` (default), ``"thread_local"`` or ``"relaxed"``, as for
            ``torch.cuda.graph``.
        debug_replay_order: check every replay against the capture order of the graphs sharing its
            pool and raise, naming both callables, at the first replay that could overwrite memory
            another callable still needs. None reads ``GOGRAPH_DEBUG``. Off, one bool check.
        progress: a progress bar over the captures (tqdm); each capture is also logged at INFO.

    TransformerEngine's options, with its semantics and indexing, planned by the Go core:
        sample_kwargs: keyword args of each forward pass (a dict, or one dict or None per pass);
            their tensor leaves follow the positional leaves in the static input surface; each
            call must pass every captured kwarg by name.
        _order, _num_layers_per_chunk: the interleaved pipeline schedule (Megatron-LM): 1-based
            chunk ids, ``c`` a forward, ``-c`` a backward, ``-(c+0.5)`` a delayed weight-gradient
            pass. ``sample_args`` then hold one entry per forward pass, pass
            ``prefix[c]*microbatches + m*layers[c] + l``; the result is a tuple of one
            GraphedCallable per pass (modules keep their forward). A malformed order raises
            ValueError naming the entry and the rule.
        retain_graph_in_backward: capture the backward with ``retain_graph=True``.
        _reuse_graph_input_output_buffers: share static inputs and grad outputs between passes
            whose lifetimes over the schedule do not overlap, and hand outputs, input grads and
            cloned parameter grads back to the pool once the schedule is past their last use; the
            plan is every callable's ``buffer_reuse``. Needs ``_order`` and training. A
            ``sample_args`` (``sample_kwargs``) *list* is reorganised in place as
            TransformerEngine does: an entry an earlier, finished microbatch can serve becomes that
            entry (``sample_args[i] = sample_args[j]``), so the samples no graph reads are freed
            before warmup (a tuple keeps them alive until the call returns).
        share_microbatch_graphs: with ``_order``, the passes of one layer that the schedule never
            has in flight together (from a microbatch's forward to its backward, or its
            weight-gradient entry) replay one set of graphs and static buffers: captures per layer
            become its in-flight depth instead of its microbatch count. Each pass is still a
            GraphedCallable of its own; a shared set of graphs is captured in a pool of its own and
            released when the last callable replaying it is reset. Outputs and input grads alias
            static buffers that the next forward (backward) of *any* callable sharing the graphs
            overwrites, and calling one while another's backward (or ``backward_dw()``) is pending
            raises RuntimeError. With ``_reuse_graph_input_output_buffers`` a ``sample_args`` list
            keeps one sample per set of graphs. Not with ``chain_buffers`` or
            ``clone_param_grads_on_return=False``.
        pre_warmup_hook, post_warmup_hook: called once before and after all warmup iterations
            (``post_warmup_hook`` also when warmup fails).
        capture_time_hooks: one dict (or None) per callable with any of ``forward_pre_hooks``,
            ``forward_hooks``, ``backward_pre_hooks``, ``backward_hooks``, each ``{id: hook}``;
            every hook is called ``hook(module)`` around each warmup and capture step, outside the
            capture (never replayed), and must return None.
        _clone_param_grads_on_return: TransformerEngine's name of ``clone_param_grads_on_return``.
        fp8_enabled, fp8_calibrating, fp8_recipe, fp8_group, fp8_weight_caching, enabled,
        calibrating, recipe, amax_reduction_group, cache_quantized_params: accepted when they ask
            for no quantization (False / None / a tuple of False); NotImplementedError otherwise.

    Delayed weight gradients: a submodule that runs in a callable's forward and defines
    ``need_backward_dw()`` and ``backward_dw()`` (TransformerEngine's protocol) gets that work
    captured into a separate graph, replayed by :meth:`GraphedCallable.backward_dw`.

    Returns:
        The graphed callable(s), in the structure of ``callables``: a module is returned itself
        with ``forward`` replaced by its :class:`GraphedCallable` (which runs the original forward
        when ``module.training`` differs from its value at capture), and ``reset`` and
        ``backward_dw`` set; a function as its GraphedCallable. A callable gets a backward graph when
        grad mode is on and its outputs require grad, in train or eval mode (eager's rule); under
        ``torch.no_grad()``, or with ``_order`` and modules in eval mode (TransformerEngine's
        rule), it is forward-only and a backward through it raises. The generator state is
        restored after the call.

    Raises:
        RuntimeError: autocast with caching; CUDA tensors without the CUDA core; called during a
            capture. AssertionError: module hooks, buffers requiring grad, non-Tensor sample leaves
            (torch's messages). ValueError: empty callables, sample_args not one tuple per callable,
            mixed train/eval modules with ``_order``, a module twice or already graphed, tensors off the engine's
            device, a malformed ``_order``. TypeError: a list of callables, a non-callable, a
            GraphedCallable, bad option types, an unknown keyword. NotImplementedError: FP8.
        Exception: an exception raised by a callable during warmup or capture is raised again (same
            type, chained) naming the callable index and the phase; every pass created so far is
            released and the generator state restored.

    Example:
        A module graphed whole and trained as it would be eagerly (CUDA tensors capture CUDA
        graphs; CPU tensors run the eager reference engine, with the same API)::

            >>> import torch, gograph
            >>> device = "cuda" if gograph.cuda_available() else "cpu"
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).to(device)
            >>> sample = torch.randn(4, 8, device=device)
            >>> model = gograph.make_graphed_callables(model, (sample,), engine=None if device == "cuda" else "eager")
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> for _ in range(3):
            ...     loss = model(torch.randn(4, 8, device=device)).square().mean()  # one forward replay
            ...     loss.backward()  # one backward replay
            ...     opt.step()
            ...     opt.zero_grad()
            >>> model.reset()  # releases its graphs and its share of the pool
    """
    _refuse_nested_build()
    with _te.graph_capturing():
        # normalise, plan, build (the request itself is not kept here: a buffer-reuse build's
        # planned request replaces it, and the samples only the first one listed are freed then)
        with prepared(
            _args.normalize(callables, sample_args, num_warmup_iters, allow_unused_input, pool, options)
        ) as build:
            build.run(hooks=(SeedTrace(), DebugRecorder()))
            graphed = build.graphed()
    ret = [_attach(g, spec, build.req.ordered) for g, spec in zip(graphed, build.specs)]
    return ret[0] if build.req.just_one else tuple(ret)


def _attach(graphed: GraphedCallable, spec: _args.PassSpec, ordered: bool) -> Any:
    """A module gets its graphed forward, ``reset`` and ``backward_dw`` (with ``_order`` a module
    runs in several passes: each pass is its own callable and the module keeps its forward)."""
    module = spec.module
    if module is None or ordered:
        return graphed
    stale = module.__dict__.get("backward_dw")
    if isinstance(getattr(stale, "__self__", None), GraphedCallable):
        del module.__dict__["backward_dw"]  # from an earlier (reset) graphing
    # Plain attributes (not parameters, buffers or submodules): nn.Module.__setattr__ would put
    # them in the instance dict too.
    module.__dict__.update(forward=graphed, reset=graphed.reset, backward_dw=graphed.backward_dw)
    return module


def _refuse_nested_build() -> None:
    """make_graphed_callables cannot run inside a capture: its warmup synchronizes and its own
    captures cannot nest in another."""
    capturing = capturing_on_this_thread()
    if not capturing and torch.cuda.is_initialized():
        try:
            capturing = bool(torch.cuda.is_current_stream_capturing())
        except Exception:  # no usable CUDA: nothing can be capturing
            capturing = False
    if capturing:
        raise RuntimeError(
            "gograph: make_graphed_callables was called while a CUDA graph capture is underway on the "
            "current stream (inside torch.cuda.graph, or inside a callable being captured by another "
            "make_graphed_callables). Graphs cannot be built inside a capture: call "
            "make_graphed_callables before (outside) the capture, or graph all callables in one call"
        )


def graph_pool_handle() -> Hashable:
    """An opaque memory-pool token to share between ``make_graphed_callables`` calls: with the
    CUDA core and a CUDA device ``torch.cuda.graph_pool_handle()``, otherwise an
    :class:`~gograph.engines.EagerPool` for the eager engine."""
    if _native.cuda_available() and torch.cuda.is_available():
        return torch.cuda.graph_pool_handle()
    return EagerPool()


def live_graphs() -> int:
    """Graphs registered in the core now (captured and not yet destroyed): a leak check."""
    return int(_core.live_graphs())


def live_passes() -> int:
    """Pass records the core holds now (graphed callables not yet garbage-collected)."""
    return int(_core.live_passes())


def live_plans() -> int:
    """Build plans the core holds now (0 between builds): a leak check."""
    return int(_core.live_plans())
