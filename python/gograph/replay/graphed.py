"""The graphed callable: one pass's static buffers and replay, wired into autograd.

A :class:`GraphedCallable` is built from its pass's spec (:class:`gograph.request._args.PassSpec`) and
what the build produced (:class:`PassResult`); the build's shared context (:class:`Shared`) says
which engine and pool replay it. Replays go through one module-level autograd Function; the hot
path is a few attribute reads, the argument checks, the copy-in, and one core call.

Aliasing, as with ``torch.cuda.make_graphed_callables``: outputs and input grads are detached
views of static buffers that later replays overwrite; static inputs are the samples, except where
samples sharing memory were separated at build (:mod:`gograph.replay._regions`: no copy-in writes what
another graph's pending backward reads; inputs that need no grad may stay shared, as in torch).
gograph adds two aliasing contracts of its own (both documented on ``make_graphed_callables``):

* with ``chain_buffers`` a chained input *is* the previous layer's output buffer: the graph reads
  it in place, so the callable must be called with that very tensor (anything else raises); its
  input grad is the previous layer's grad-output buffer;
* a parameter grad may be *lent*: ``.grad`` is the static buffer itself, and before a replay
  that could overwrite it (:class:`LentGrads`) it is copied out if anything still holds it.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..core import _core
from ..core._kinds import GradPolicy, Learned, SlotDeliver
from ..request._marks import GraphedMark
from ..runtime import _grad_slots
from ..runtime._bodies import RUNNING, flat_tuple_spec
from ..runtime.engines import BACKWARD, CAPTURE_STATE, FORWARD, WGRAD, CudaEngine, Engine
from ..support import _torch
from ._grad_pack import owned_copies
from ._handouts import WATCH
from ._shared_inputs import SharedInput
from ._sharers import Sharers

if TYPE_CHECKING:  # pragma: no cover
    from ..request._args import PassSpec
    from ..request._te import WgradBody
    from ..runtime._observe import BuildStats
    from ._buffer_reuse import BufferReuse

__all__ = ["ChainedInputError", "GraphedCallable", "LentGrads", "PassResult", "Shared", "StaticInputMismatchError"]

log = logging.getLogger("gograph")
_ADD, _LEND = SlotDeliver.ADD, SlotDeliver.LEND


class StaticInputMismatchError(ValueError, RuntimeError):
    """A graphed callable was called with a tensor whose shape or device differs from its sample
    arg's. A ValueError (a bad argument) that is also a RuntimeError (what torch raises for the
    same mismatch in eager code)."""


class ChainedInputError(StaticInputMismatchError):
    """A chained input (``chain_buffers``) got another tensor than the previous layer's output,
    which its graph reads in place."""


@dataclass(frozen=True)
class PassResult:
    """What the build produced for one pass (the static buffers its graphs read and write)."""

    static_inputs: tuple[Tensor, ...]
    params: tuple[torch.nn.Parameter, ...]
    static_outputs: tuple[Tensor, ...]
    output_requires_grad: tuple[bool, ...]
    output_spec: pytree.TreeSpec
    static_grad_outputs: tuple[Tensor | None, ...]
    static_grad_inputs: tuple[Tensor | None, ...]
    has_backward: bool
    wgrad: WgradBody | None
    chained_inputs: frozenset[int] = frozenset()
    chained_grad_outputs: frozenset[int] = frozenset()
    separated_inputs: frozenset[int] = frozenset()  # a clone of the sample (it shares memory)
    released_outputs: frozenset[int] = frozenset()  # pool-planned: handed back, not owned
    released_grad_inputs: frozenset[int] = frozenset()
    grad_policy: dict[int, GradPolicy] = field(default_factory=dict)  # surface index -> its policy
    seq: tuple[int, int, int] = (0, 0, 0)  # capture sequence numbers of its forward, backward, weight gradient
    # per graph kind, the capture sequence number from which lending backwards' lent grads are
    # memory its replay may overwrite (the core's rule; 0: any)
    lent_from: tuple[int, int, int] = (0, 0, 0)
    shared_inputs: dict[int, SharedInput] = field(default_factory=dict)  # leaf -> its shared buffer's guard
    shared_grad_outputs: frozenset[int] = frozenset()  # outputs whose grad-output buffer other passes use too
    sharers: Sharers | None = None  # the callables replaying these graphs too (share_microbatch_graphs)
    pool: Hashable | None = None  # the pool its graphs were captured in (None: the build's)


@dataclass(eq=False)
class Shared:
    """What the callables of one build share."""

    engine: Engine
    pool: Hashable
    build_stats: BuildStats | None = None
    check_replay_order: bool = False
    retain_graph_in_backward: bool = False
    buffer_reuse: BufferReuse | None = None
    lent: LentGrads | None = None
    lend_param_grads: bool | None = None  # the option: None learns, True lends at once, False never


# ---------------------------------------------------------------------------------------------
# Lent parameter grads
# ---------------------------------------------------------------------------------------------


class _Lent:
    """One parameter grad a backward (capture sequence ``seq``) handed out, watched until the
    first replay that could overwrite its slot's static buffer. Lent (``lent``): the buffer
    itself, and the tensor object the backward returned (AccumulateGrad makes it ``.grad``,
    ``torch.autograd.grad`` returns it to the caller; either way every holder of it can be
    redirected at copy-out). Otherwise an owned copy, watched only to learn whether the caller
    still holds a ``.grad`` by then."""

    __slots__ = ("handed", "lent", "pass_id", "seq", "slot")

    def __init__(self, seq: int, pass_id: int, slot: _GradSlot, handed: Tensor, lent: bool) -> None:
        self.seq, self.pass_id, self.slot, self.lent = seq, pass_id, slot, lent
        self.handed = weakref.ref(handed)


class _GradSlot:
    """A parameter grad returned as an owned tensor: its surface index, parameter, policy and
    static buffer; for a lendable one, the buffer's storage and address and how many references
    gograph itself holds on it (counted when the build ended: anything beyond is a holder of the
    lent grad), what it has learnt of the caller (``learned``), and what to call it in messages."""

    __slots__ = ("baseline", "data_ptr", "index", "label", "learned", "param", "policy", "static", "storage")

    def __init__(self, index: int, param: torch.nn.Parameter, policy: str, static: Tensor, label: str) -> None:
        self.index, self.param, self.policy, self.static, self.label = index, param, policy, static, label
        self.storage: torch.UntypedStorage | None = static.untyped_storage() if policy is GradPolicy.LEND else None
        self.baseline = _torch.storage_use_count(self.storage) if self.storage is not None else 0
        self.data_ptr = static.data_ptr()
        self.learned = Learned.UNKNOWN


class LentGrads:
    """The parameter grads of one memory pool handed out by lendable backwards, watched.

    A lent buffer lives in pool memory that graphs captured before its backward may overwrite at
    replay (the caching allocator handed them the same blocks at capture time, as eager training
    hands a fresh ``.grad`` memory its activations freed). That is only sound for a ``.grad`` the
    caller drops before such a replay (``zero_grad(set_to_none=True)`` after each step, no
    accumulation): eager keeps a ``.grad`` that lives on (``set_to_none=False``, accumulation) at
    one address for the rest of training, and captured optimizer steps, fused optimizers and
    bucket views hold that address. So a slot lends only once it has learnt that the caller drops
    its grads: its first grad is an owned copy, watched; if no ``.grad`` of its parameter is left
    at the first replay that could have overwritten a lent buffer, the caller drops them (the slot
    lends from its next backward); if one is, or a later backward finds ``.grad`` to accumulate
    into, the caller keeps them (owned copies from then on, which AccumulateGrad keeps in place).

    Which replays may overwrite a lent buffer is the core's rule (``internal/lifetime``'s
    ``lentOverwrites``): a graph captured before the lending backward, or that backward itself,
    may, a graph captured after it cannot; the core gives each graph, as a capture sequence
    number, the first lending backward it may overwrite (``lent_from``). Before such a replay,
    each lent buffer still held by anything but gograph is copied out (a caller that changed its
    pattern): the tensor the backward returned gets an owned copy, seen by every holder of that
    tensor object, and the slot stops lending; a holder gograph cannot redirect (a view of an old
    ``.grad``) raises RuntimeError instead of letting the replay change it. This registry keeps
    only that check: whether anything but gograph still holds the buffer."""

    __slots__ = ("entries", "lock", "newest")

    def __init__(self) -> None:
        self.entries: list[_Lent] = []
        self.newest = 0  # the largest seq among entries: a replay captured after it overwrites none
        self.lock = threading.Lock()  # a reset on one thread may race a replay on another

    def lend(self, seq: int, pass_id: int, lent: Sequence[tuple[_GradSlot, Tensor, bool]]) -> None:
        """Records what one backward (capture ``seq``) handed out: (slot, the tensor it returned,
        whether that is the lent buffer or a watched owned copy)."""
        with self.lock:
            self.entries.extend(_Lent(seq, pass_id, slot, handed, is_lent) for slot, handed, is_lent in lent)
            self.newest = max(self.newest, seq)

    def sweep(self, lent_from: int) -> None:
        """Before replaying a graph whose replay may overwrite the grads lent by backwards captured
        at sequence ``lent_from`` or later (the core's answer): copy out what it could overwrite,
        and learn from the watched copies (the core's grad-slot policy, ``sweep`` rows)."""
        if self.newest < lent_from:
            return  # the core says this graph overwrites none of what is lent now
        rule = _grad_slots.sweep_table()
        with self.lock:
            keep = []
            for e in self.entries:
                if e.seq < lent_from:
                    keep.append(e)  # the core says this graph cannot overwrite it
                    continue
                slot = e.slot
                # a lent buffer: does anything but gograph hold it; a watched copy: is .grad still there
                present = _held(slot) if e.lent else slot.param.grad is not None
                copy_out, slot.learned = rule[(e.lent, present, slot.learned)]
                if copy_out:
                    _copy_out(e)
                    log.info(
                        "the lent gradient buffer %s was still .grad when a replay would overwrite it "
                        "(the caller now keeps its grads): moved to memory of its own, owned from now on",
                        slot.label,
                    )
            self.entries = keep
            self.newest = max((e.seq for e in keep), default=0)

    def drop_pass(self, pass_id: int) -> None:
        """A pass is being reset: its lent buffers are copied out now (if held). A holder that
        cannot be redirected is logged, not raised: a reset must not fail (the holder keeps the
        values of the last backward, which no replay of this pass writes again)."""
        with self.lock:
            mine = [e for e in self.entries if e.pass_id == pass_id]
            self.entries = [e for e in self.entries if e.pass_id != pass_id]
            self.newest = max((e.seq for e in self.entries), default=0)
            for e in mine:
                if e.lent and _held(e.slot):
                    _copy_out(e, at_reset=True)


def _held(slot: _GradSlot) -> bool:
    """Whether anything but gograph holds a lendable slot's static buffer."""
    assert slot.storage is not None  # lent slots have one
    return _torch.storage_use_count(slot.storage) > slot.baseline


def _copy_out(e: _Lent, at_reset: bool = False) -> None:
    """Copies a lent buffer that something holds out of every holder gograph can redirect."""
    slot = e.slot
    storage = slot.storage
    assert storage is not None  # lent slots have one
    for t in (slot.param.grad, e.handed()):
        if t is not None and t.data_ptr() == slot.data_ptr and t.untyped_storage().data_ptr() == storage.data_ptr():
            with torch.no_grad():
                t.data = t.clone()  # every holder of this tensor object sees the owned copy
    if _torch.storage_use_count(storage) > slot.baseline:
        if at_reset:
            log.warning(
                "reset while a tensor sharing the gradient buffer %s is still alive (a view of an "
                "old .grad, or a backward of this callable running on another thread): it keeps the last "
                "backward's values",
                slot.label,
            )
            return
        raise RuntimeError(
            f"gograph: a tensor that shares the gradient buffer {slot.label} lent to .grad by an earlier backward is "
            "still alive (not that .grad itself, which was copied out), and this replay would overwrite it: "
            "graphed backwards of the default schedule lend their static parameter-gradient buffers to .grad. "
            "Clone a gradient you keep past the next forward (g = p.grad.clone()) instead of a view of it"
        )


_LENT: dict[str, LentGrads] = {}


def lent_grads(pool_key: str) -> LentGrads:
    """The lent-grad registry of a pool (shared by every build capturing into it)."""
    return _LENT.setdefault(pool_key, LentGrads())


# ---------------------------------------------------------------------------------------------
# The graphed callable
# ---------------------------------------------------------------------------------------------
class GraphedCallable(GraphedMark):
    """One graphed pass: its static buffers, called like the original callable.

    Calling it copies the user args into the static inputs (skipped when an arg *is* its static
    input), replays the forward graph and returns the outputs in the callable's structure; under
    autograd its backward replays the backward graph.

    * ``static_input_surface``: the flattened sample args, then the parameters. Shapes and devices
      must match ``sample_args`` (StaticInputMismatchError); a dtype that differs is cast by the
      copy-in (as torch's, for autocast); a different pytree structure or count is a TypeError. An
      arg that requires grad where its sample did not runs (outputs require grad where eager's
      would); a backward that asks for its grad, which the graph has not, raises RuntimeError.
    * each forward call can be differentiated once (as with ``retain_graph=False``), unless graphed
      with ``retain_graph_in_backward``.
    * calling it while a graph capture is underway on this thread raises RuntimeError.
    * outputs are detached views of ``static_outputs``, overwritten by the next forward replay;
      input grads views of ``static_grad_inputs``, overwritten by later backward replays; clone
      what must outlive them.
    * parameter grads never become a buffer a later replay overwrites while ``.grad`` holds it
      (``clone_param_grads_on_return``, default), and a ``.grad`` that lives on keeps its address:
      an owned copy when ``.grad`` is None, or on the default schedule, once the caller was seen
      dropping its grads after each step, the lent static buffer (:class:`LentGrads`).

    ``reset()`` releases exactly this callable's graphs and pool references; a second call is
    harmless; calling it afterwards raises RuntimeError saying it was reset. A finalizer that
    never references the callable releases and forgets the pass when it is garbage. The module
    is held through a weakref only.

    TransformerEngine's extensions: captured ``sample_kwargs`` follow the positional args in the
    surface (each must be passed by name; other kwargs are ignored, as TransformerEngine ignores
    them, with a warning once per callable for one that holds a tensor); ``cuda_graph_stream=`` /
    ``cuda_graph_event=`` replay on that stream (CUDA engine); :meth:`backward_dw` replays the
    delayed weight-gradient graph; ``buffer_reuse`` says how the core planned the static buffers.
    """

    def __init__(self, spec: PassSpec, result: PassResult, pass_id: int, shared: Shared) -> None:
        self.index, self.label, self.pass_id = spec.index, spec.label, pass_id
        self.engine, self.shared = shared.engine, shared
        self.pool = result.pool if result.pool is not None else shared.pool
        self.build_stats, self.buffer_reuse = shared.build_stats, shared.buffer_reuse
        self._check_replay_order = shared.check_replay_order
        self._retain_graph_in_backward = shared.retain_graph_in_backward
        self.static_input_surface = result.static_inputs + result.params
        self.module_params = result.params
        self.len_user_args = len(result.static_inputs)
        self.static_outputs = result.static_outputs
        self.output_requires_grad = result.output_requires_grad
        self.static_grad_outputs = result.static_grad_outputs
        self.static_grad_inputs = result.static_grad_inputs
        self.output_spec = result.output_spec
        self.has_backward = result.has_backward
        self.chained_inputs, self.chained_grad_outputs = result.chained_inputs, result.chained_grad_outputs
        self.separated_inputs = result.separated_inputs
        self.released_outputs, self.released_grad_inputs = result.released_outputs, result.released_grad_inputs
        self.shared_grad_outputs = result.shared_grad_outputs
        # Another pass's backward reads the same grad-output buffer: its replay may still be running
        # on another stream, so the stream is ordered after it before the copy-in (engine.order).
        self._order_copy_in = shared.engine.order if result.shared_grad_outputs else None
        self._single_output = result.output_spec.is_leaf()
        # Captured with grad mode on, an output that did not require grad cannot carry one. Captured
        # without (under no_grad, or TransformerEngine's eval-mode _order), nothing is marked: an
        # output requires grad where eager's would, and a backward through it raises.
        self._no_backward = None if result.has_backward else _no_backward_reason(spec)
        self._nondiff_outputs = (
            tuple(i for i, rg in enumerate(result.output_requires_grad) if not (rg and result.has_backward))
            if spec.grad_enabled
            else ()
        )
        self._init_call(spec, result)
        self._init_grads(result, shared)
        self._module_ref = weakref.ref(spec.func) if isinstance(spec.func, torch.nn.Module) else None
        self._training = spec.training
        self.original_forward = spec.forward_fn if spec.module is not None else None
        self.original_forward_is_method = spec.forward_is_method
        self._wgrad = result.wgrad
        # backward_dw()'s check of the slots its graph writes, bound once (the targets are fixed at capture)
        self._wgrad_pending = _grad_slots.pending_check(result.wgrad.targets if result.wgrad is not None else None)
        self._sharers = result.sharers
        self._released = False
        # The finalizer must not reference self: it gets the engine, the pass id, the pool.
        self._finalizer = weakref.finalize(
            self, _finalize, shared.engine, pass_id, self.pool, shared.lent, result.sharers, spec.index
        )
        self._finalizer.atexit = False

    def _init_call(self, spec: PassSpec, result: PassResult) -> None:
        """Replay-time argument checks, precomputed: per user arg (static, shape, dtype, device
        index, chained, the guard of a buffer shared with other passes or None)."""
        guards = result.shared_inputs
        self._input_sig: tuple[tuple[Tensor, torch.Size, torch.dtype, int, bool, SharedInput | None], ...] = tuple(
            (s, s.shape, s.dtype, s.get_device(), j in result.chained_inputs, guards.get(j))
            for j, s in enumerate(result.static_inputs)
        )
        self._shared_guards = tuple({id(g): g for g in guards.values()}.values())
        self.shared_inputs = frozenset(guards)  # leaves whose static buffer other callables read too
        self._args_spec = spec.args_spec
        self._flat_args = spec.args_spec == flat_tuple_spec(spec.args_spec.num_leaves)
        self._nograd_args = (
            tuple(i for i, s in enumerate(result.static_inputs) if not s.requires_grad) if spec.grad_enabled else ()
        )
        self._kwargs_keys = spec.kwargs_keys
        self._kwargs_spec = spec.kwargs_spec
        self._n_pos = spec.n_pos
        self._cast_noted = False
        self._extra_kwargs_noted = False

    def _init_grads(self, result: PassResult, shared: Shared) -> None:
        """Per parameter grad returned as an owned tensor: (surface index, parameter, policy,
        static buffer). Parameters marked ``skip_backward_post_hook`` (TransformerEngine/Megatron:
        grads consumed by a fused wgrad path) are never cloned."""
        n = self.len_user_args
        self._param_grad_slots: tuple[_GradSlot, ...] = tuple(
            _GradSlot(
                n + k,
                p,
                result.grad_policy[n + k],
                self.static_grad_inputs[n + k],  # type: ignore[arg-type]
                f"of graphed callable {self.index} ({self.label}), parameter {k}",
            )
            for k, p in enumerate(result.params)
            if n + k in result.grad_policy and self.static_grad_inputs[n + k] is not None
        )
        start = {None: Learned.UNKNOWN, True: Learned.DROPPED, False: Learned.KEPT}[shared.lend_param_grads]
        for s in self._param_grad_slots:
            s.learned = start
        self.lent_param_grads = sum(1 for s in self._param_grad_slots if s.policy is GradPolicy.LEND)
        self._lent = shared.lent if self.lent_param_grads else None
        self._bwd_seq = result.seq[1]
        self._handout = _grad_slots.backward_table()  # the core's rule, by [lendable][.grad exists][learned]
        self._fwd_lent_from, self._bwd_lent_from, self._wgrad_lent_from = result.lent_from

    # -- introspection ------------------------------------------------------------------------
    @property
    def is_reset(self) -> bool:
        """True once :meth:`reset` released this callable."""
        return self._released

    @property
    def state(self) -> str:
        """The core's lifecycle state of the pass: "building", "ready" or "reset"."""
        return str(_core.pass_state(self.pass_id))

    @property
    def module(self) -> torch.nn.Module | None:
        """The graphed module (None for functions, or when the module no longer exists)."""
        return self._module_ref() if self._module_ref is not None else None

    def __repr__(self) -> str:
        return (
            f"GraphedCallable(index={self.index}, label={self.label!r}, pass_id={self.pass_id}, "
            f"engine={self.engine.name}, {'reset' if self._released else 'ready'})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("gograph: a graphed callable cannot be pickled or copied (it owns device graphs)")

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(
            "gograph: a graphed callable cannot be copied (it owns device graphs); copy the module before graphing it"
        )

    # -- calling ------------------------------------------------------------------------------
    def __call__(self, *user_args: Any, **user_kwargs: Any) -> Any:
        if self._module_ref is not None:
            module = self._module_ref()
            if module is not None and (module.training != self._training or RUNNING.module is module):
                return self._call_original(module, user_args, user_kwargs)  # other mode, or its own body
        if self._released:
            self._raise_reset()
        opts, flat = self._flatten_call(user_args, user_kwargs)
        if CAPTURE_STATE.depth:
            self._raise_nested_capture()
        if self._check_replay_order:  # debug guard: refuse before any static buffer is written
            self._check_chained(flat)  # a chained input not its producer's output: that error first
            _core.check_replay_order(self.pass_id, FORWARD)
        if _torch.functorch_transforms_active():
            out = _GraphedFunction.apply(self, opts, *flat, *self.module_params)
        else:
            out = _apply_graphed_function(self, opts, *flat, *self.module_params)
        if self._check_replay_order and not any(o.requires_grad for o in out):
            _core.discard_replay_order(self.pass_id)  # no backward can follow (no_grad)
        if self._single_output:
            return out[0]
        return pytree.tree_unflatten(out, self.output_spec)

    def _call_original(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's own forward: graphed in the other train/eval mode, or called from the body
        of one of its passes (a build or an eager replay calls the module through ``__call__``,
        which reaches the forward this callable replaced; a graph never calls back into Python)."""
        if module.training == self._training and module.__dict__.get("forward") is not self:
            self._raise_called_back(module)
        fn = self.original_forward
        if fn is None:  # pragma: no cover - set for every module
            raise RuntimeError("gograph: original forward unavailable")
        return fn(module, *args, **kwargs) if self.original_forward_is_method else fn(*args, **kwargs)

    def _flatten_call(self, user_args: tuple[Any, ...], user_kwargs: dict[str, Any]) -> tuple[Any, Sequence[Any]]:
        opts: tuple[Any, Any] | None = None
        kw_leaves: Sequence[Any] = ()
        extra: dict[str, Any] = {}
        if user_kwargs or self._kwargs_keys:
            opts, kw_leaves, extra = self._take_kwargs(user_kwargs)
        if self._flat_args:
            flat: Sequence[Any] = user_args
        else:
            flat, spec = pytree.tree_flatten(user_args)
            if spec != self._args_spec:
                raise TypeError(
                    f"gograph: graphed callable {self.index} ({self.label}) must be called with args in the "
                    f"pytree structure of its sample_args, {_structure(self._args_spec)}; got {_structure(spec)}. "
                    "Pass the same nesting (tuples, lists, dict keys in the same order)"
                )
        if len(flat) != self._n_pos:
            hint = (
                f" (keyword argument(s) {sorted(extra)} are not graphed inputs: pass them positionally)"
                if extra
                else ""
            )
            raise TypeError(
                f"gograph: graphed callable {self.index} ({self.label}) was captured with {self._n_pos} tensor "
                f"argument(s) and called with {len(flat)}; pass args in the structure of its sample_args{hint}"
            )
        if extra and not self._extra_kwargs_noted:
            self._note_extra_kwargs(extra)
        if kw_leaves:
            flat = (*flat, *kw_leaves)
        return opts, flat

    def _raise_ungraphed_grad(self, ctx: Any) -> None:
        """Raises when this backward must produce a gradient its graph cannot give: for an argument
        that requires grad where its sample did not (``ctx.ungraphed``, set by the forward), and
        that autograd will use (an argument it does not ask for, e.g. ``torch.autograd.grad`` of
        the parameters alone, needs none). A forward is never refused for a gradient nobody asks
        for; a gradient is never dropped silently."""
        for i in ctx.ungraphed:
            node = ctx.next_functions[i][0]
            if node is not None and _torch.will_engine_execute_node(node):
                raise RuntimeError(
                    f"gograph: argument leaf {i} of graphed callable {self.index} ({self.label}) requires grad, but "
                    "its sample arg did not, so the backward graph computes no grad for it and the grad would be "
                    "silently dropped. Graph it with a sample arg that has requires_grad=True at this position, "
                    "or pass a detached tensor"
                )

    def _take_kwargs(self, user_kwargs: dict[str, Any]) -> tuple[tuple[Any, Any] | None, Sequence[Any], dict[str, Any]]:
        """Splits call kwargs into the replay options (``cuda_graph_stream``,
        ``cuda_graph_event``), the flat leaves of the captured kwargs, in key order, and the
        rest. The rest is ignored, as TransformerEngine's replay ignores it (Megatron-LM passes
        every layer kwarg, mostly None, and ``is_first_microbatch``); one holding a tensor, which
        cannot reach the graph, is warned about once per callable (by the caller)."""
        kwargs = dict(user_kwargs)
        opts = None
        if "cuda_graph_stream" in kwargs or "cuda_graph_event" in kwargs:
            opts = (kwargs.pop("cuda_graph_stream", None), kwargs.pop("cuda_graph_event", None))
        values = []
        for key in self._kwargs_keys:
            if key not in kwargs:
                raise TypeError(
                    f"gograph: graphed callable {self.index} ({self.label}) was initialized with kwarg {key}, but "
                    f'it was not provided in graph replay (TransformerEngine: "Graphed callable was initialized '
                    f'with kwarg {key} ,but it was not provided in graph replay")'
                )
            values.append(kwargs.pop(key))
        if not self._kwargs_keys:
            return opts, (), kwargs
        leaves, spec = pytree.tree_flatten(values)
        if spec != self._kwargs_spec:
            raise TypeError(
                f"gograph: the keyword arguments {list(self._kwargs_keys)} of graphed callable {self.index} "
                f"({self.label}) must have the pytree structure of its sample_kwargs, "
                f"{_structure(spec if self._kwargs_spec is None else self._kwargs_spec)}; got {_structure(spec)}"
            )
        return opts, leaves, kwargs

    def _note_extra_kwargs(self, extra: dict[str, Any]) -> None:
        tensors = sorted(k for k, v in extra.items() if any(isinstance(x, Tensor) for x in pytree.tree_leaves(v)))
        if not tensors:
            return
        self._extra_kwargs_noted = True
        where = (
            f"were not in its sample_kwargs {list(self._kwargs_keys)}"
            if self._kwargs_keys
            else "it was graphed without sample_kwargs"
        )
        warnings.warn(
            f"gograph: graphed callable {self.index} ({self.label}) ignores keyword argument(s) {tensors}: they "
            f"hold tensors but {where}, so they cannot reach the graph, which replays the inputs it was captured "
            "with (TransformerEngine's replay ignores them too). Graph it with them in sample_kwargs if its "
            "forward needs them (said once per graphed callable)",
            UserWarning,
            stacklevel=4,  # the caller of the graphed callable
        )

    # -- replays ------------------------------------------------------------------------------
    def _launch(self, kind: int, opts: tuple[Any, Any] | None) -> None:
        """Replays graph ``kind``; with ``cuda_graph_stream``/``cuda_graph_event`` on the CUDA
        engine, on that stream (TransformerEngine's replay on a side stream)."""
        stream = None if opts is None else opts[0]
        if stream is None or not isinstance(self.engine, CudaEngine):
            self.engine.replay(self.pass_id, kind)
            return
        current = torch.cuda.current_stream(self.engine.device)
        if stream == current:
            self.engine.replay(self.pass_id, kind)
            return
        event = opts[1]  # type: ignore[index]
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self.engine.replay(self.pass_id, kind)
        if event is not None:
            current.wait_event(event)
        else:
            current.wait_stream(stream)

    def _replay_forward(self, inputs: tuple[Tensor, ...], opts: tuple[Any, Any] | None = None) -> tuple[Tensor, ...]:
        # Snapshot the buffers before checking the lifecycle: a reset on another thread clears them
        # after marking the callable released, so either the check sees the reset or the snapshot
        # holds buffers that are still alive (and the core then refuses the replay).
        sig, outputs, lent = self._input_sig, self.static_outputs, self.shared.lent
        if self._released:
            self._raise_reset()
        if lent is not None and lent.entries:
            lent.sweep(self._fwd_lent_from)
        for i, (static, shape, dtype, device, chained, guard) in enumerate(sig):
            new = inputs[i]
            if new is not static:
                try:
                    ok = new.shape == shape and new.dtype is dtype and new.get_device() == device
                except AttributeError:  # not a tensor
                    ok = False
                if not ok:
                    self._check_arg(i, new, chained)
                if static.data_ptr() != new.data_ptr():
                    if chained:
                        self._raise_unchained(i, new)
                    if guard is None:
                        static.copy_(new)
                    else:  # another pass reads this buffer too (_shared_inputs)
                        guard.copy_in(self.index, i, static, new)
                elif chained and new.stride() != static.stride():
                    self._raise_unchained(i, new)
        if opts is None:
            self.engine.replay(self.pass_id, FORWARD)
        else:
            self._launch(FORWARD, opts)
        out = tuple([o.detach() for o in outputs])
        if self._check_replay_order and WATCH.watches(self.pass_id, FORWARD):
            handed = list(out)
            WATCH.after_replay(self.pass_id, FORWARD, handed)  # debug: pool-planned hand-outs
            return tuple(handed)
        return out

    def _replay_backward(
        self, grads: tuple[Tensor | None, ...], opts: tuple[Any, Any] | None = None, lend: bool = True
    ) -> tuple[Tensor | None, ...]:
        static_grad_outputs, static_grad_inputs, lent = (
            self.static_grad_outputs,
            self.static_grad_inputs,
            self.shared.lent,
        )
        if self._released:
            self._raise_reset(BACKWARD)
        if len(grads) != len(static_grad_outputs):
            raise AssertionError(f"len(grads)={len(grads)} != len(static_grad_outputs)={len(static_grad_outputs)}")
        if lent is not None and lent.entries:
            lent.sweep(self._bwd_lent_from)
        if self._order_copy_in is not None:
            self._order_copy_in(self.pass_id, BACKWARD)
        for static, grad in zip(static_grad_outputs, grads):
            # don't copy if the incoming grad is already in the right place (a chained grad output)
            if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        if opts is None:
            self.engine.replay(self.pass_id, BACKWARD)
        else:
            self._launch(BACKWARD, opts)
        out = [None if b is None else b.detach() for b in static_grad_inputs]
        if self._check_replay_order and WATCH.watches(self.pass_id, BACKWARD):
            WATCH.after_replay(self.pass_id, BACKWARD, out)  # debug: pool-planned hand-outs
        if self._param_grad_slots:
            self._own_param_grads(out, lend)
        if self._sharers is not None:
            self._sharers.backward_ran(self.index, self._wgrad is not None)
        return tuple(out)

    def _own_param_grads(self, out: list[Tensor | None], lend: bool) -> None:
        """A parameter grad must not silently *become* a static buffer (pytorch#181723): when
        ``.grad`` is None, AccumulateGrad steals the incoming tensor as ``.grad``. It gets an
        owned copy (laid out for the caching allocator: :mod:`gograph.replay._grad_pack`), or
        (policy lend, once the slot learnt that the caller drops its grads, unless ``lend`` is
        False: a create_graph backward, whose once-differentiable wrapper keeps aliases of it
        that nobody can redirect) the buffer itself; the lent-grad registry watches both until
        the next replay that could overwrite the buffer. When ``.grad`` exists AccumulateGrad
        only adds into it in place, so nothing is cloned (and the slot learns the caller keeps
        its grads). Which of these each slot gets is the core's grad-slot policy (``handout``
        rows of the backward sources, read by index: :func:`gograph.runtime._grad_slots.backward_table`)."""
        handed: list[tuple[_GradSlot, Tensor, bool]] = []
        copied: list[int] = []
        watched: list[_GradSlot] = []
        can_lend = lend and self._lent is not None and not self._released
        handout = self._handout
        for slot in self._param_grad_slots:
            i = slot.index
            g = out[i]
            if g is None:
                continue
            lendable = can_lend and slot.policy is GradPolicy.LEND
            d = handout[lendable][slot.param.grad is not None][slot.learned]
            slot.learned = d.learned
            if d.deliver is _ADD:  # .grad exists: AccumulateGrad adds the buffer into it
                continue
            if d.deliver is _LEND:
                handed.append((slot, g, True))
                continue
            copied.append(i)
            if d.watch:
                watched.append(slot)
        if copied:  # laid out for the default pool (_grad_pack): natural sizes where the slots lend
            natural = self._lent is not None
            for i, c in zip(copied, owned_copies([out[i] for i in copied], natural)):  # type: ignore[misc]
                out[i] = c
            handed += [(slot, out[slot.index], False) for slot in watched]  # type: ignore[misc]
        if handed:
            self._lent.lend(self._bwd_seq, self.pass_id, handed)  # type: ignore[union-attr]

    def backward_dw(self) -> None:
        """Replays this pass's delayed weight-gradient graph (TransformerEngine's ``backward_dw``):
        the ``backward_dw()`` work of the submodules that ran in its forward and reported
        ``need_backward_dw()``. Call it after the backward of the same forward, before that pass's
        next backward. A no-op when no submodule needed one. Each ``.grad`` / ``.main_grad`` the
        work writes ends as eager's ``backward_dw()`` leaves it, whatever it holds now (the core's
        grad-slot policy, :mod:`gograph.runtime._grad_slots`): the tensor the graph adds into costs the
        replay alone; None gets the gradient in a tensor the caller owns; another tensor gets it
        added in (or, where the module assigned a new tensor at capture, is replaced by a copy).
        A slot the gradient cannot be added into (another shape or device) raises RuntimeError
        before anything runs. Then, as TransformerEngine does, each such submodule's
        ``_trigger_wgrad_accumulation_and_reduce_hooks()`` runs if it has one. After
        :meth:`reset` it raises RuntimeError; it never launches a destroyed graph."""
        wgrad = self._wgrad
        if self._released:
            self._raise_reset(WGRAD, "; backward_dw() has no weight-gradient graph to replay")
        if wgrad is None:
            return
        pending = self._wgrad_pending
        todo = pending() if pending is not None else None  # a .grad / .main_grad dropped or replaced since
        if todo is not None:
            self._replay_wgrad_serving(todo, wgrad.label)
        else:  # every slot holds the tensor the graph adds into: the replay is all
            if self._check_replay_order:  # debug guard: refuse before anything is launched
                _core.check_replay_order(self.pass_id, WGRAD)
            lent = self.shared.lent
            if lent is not None and lent.entries:  # the graph may overwrite a .grad lent by a backward
                lent.sweep(self._wgrad_lent_from)
            self.engine.replay(self.pass_id, WGRAD)
        if self._sharers is not None:
            self._sharers.wgrad_ran(self.index)
        if self._check_replay_order and WATCH.watches(self.pass_id, WGRAD):
            WATCH.after_replay(self.pass_id, WGRAD, [])
        for m in wgrad.modules():
            trigger = getattr(m, "_trigger_wgrad_accumulation_and_reduce_hooks", None)
            if trigger is not None and m.need_backward_dw():
                trigger()

    def _replay_wgrad_serving(self, todo: list[_grad_slots.WgradTarget], label: str) -> None:
        """The weight-gradient replay when slots it writes were dropped or replaced since the
        capture: the policy decides for each first (a refusal raises with nothing launched), the
        graph's memory is prepared after the previous replay (which may be on another stream),
        and each slot gets its gradient once the graph ran."""
        steps = _grad_slots.plan(todo, label)
        if self._check_replay_order:
            _core.check_replay_order(self.pass_id, WGRAD)
        lent = self.shared.lent
        if lent is not None and lent.entries:
            lent.sweep(self._wgrad_lent_from)
        self.engine.order(self.pass_id, WGRAD)
        _grad_slots.execute(steps, lambda: self.engine.replay(self.pass_id, WGRAD))

    # -- errors -------------------------------------------------------------------------------
    def _raise_nested_capture(self) -> None:
        raise RuntimeError(
            f"gograph: graphed callable {self.index} ({self.label}) was called while a graph capture is "
            "underway on this thread (inside another make_graphed_callables capture): a graph cannot be "
            "replayed inside a second capture. Graph the callables together in one "
            "make_graphed_callables call (a tuple, in the order they run), or call the original "
            "(ungraphed) module inside the outer callable"
        )

    def _check_arg(self, i: int, new: Any, chained: bool) -> None:
        """The slow path of the argument check: raises for what a graph cannot replay; a dtype
        the copy-in casts (torch's autocast pattern) is accepted (noted once per callable)."""
        static, shape, dtype, device, _, _ = self._input_sig[i]
        where = f"argument leaf {i} of graphed callable {self.index} ({self.label})"
        if not isinstance(new, Tensor):
            raise TypeError(
                f"gograph: {where} is of type {type(new).__name__}, not a Tensor; graphed "
                "callables take tensors in the structure of their sample_args"
            )
        captured = f"shape {tuple(shape)}, dtype {dtype}, device {static.device}"
        got = f"shape {tuple(new.shape)}, dtype {new.dtype}, device {new.device}"
        if new.shape != shape or new.get_device() != device or chained:
            raise StaticInputMismatchError(
                f"gograph: {where} has {got}, but the graph was captured with {captured}. A graph replays "
                "fixed shapes and devices (it would not broadcast or move): pass a matching tensor "
                "(e.g. .to(...)), or graph a separate callable for this shape"
            )
        if not self._cast_noted:
            self._cast_noted = True
            log.debug(
                "%s has dtype %s; the copy into its %s static input casts it (as torch's "
                "graphed callables do, e.g. under autocast)",
                where,
                new.dtype,
                dtype,
            )

    def _check_chained(self, flat: Sequence[Any]) -> None:
        """Raises for a chained leaf not called with its producer's output (the replay-order guard
        would otherwise name the producer's missing replay instead of the caller's argument)."""
        for i, (static, _, _, _, chained, _) in enumerate(self._input_sig):
            new = flat[i] if i < len(flat) else None
            if chained and isinstance(new, Tensor) and new is not static and static.data_ptr() != new.data_ptr():
                self._raise_unchained(i, new)

    def _raise_unchained(self, i: int, new: Tensor) -> None:
        raise ChainedInputError(
            f"gograph: argument leaf {i} of graphed callable {self.index} ({self.label}) is chained "
            "(chain_buffers=True): its graph reads the previous graphed callable's output buffer in place, so it "
            "must be called with that output itself (the tensor the previous callable returned), not another "
            "tensor: copying into the buffer would change the previous callable's output, which you hold and its "
            "backward may read. Call the layers in the order they were graphed, each on the previous one's "
            "output, or graph without chain_buffers"
        )

    def _raise_called_back(self, module: torch.nn.Module) -> None:
        raise RuntimeError(
            f"gograph: graphed callable {self.index} ({self.label}) was called from inside its own module's "
            f"__call__, while gograph ran {type(module).__name__} for a build or an eager replay: the class's "
            "__call__ routes to the graphed callables it was given (as Megatron-Core's layers do once "
            "`cuda_graphs` is set), so the call it was graphed through cannot run again. The eager engine "
            "re-runs a module's __call__ at each replay, in the state it was captured in (autocast, and what "
            "integrations record); for Megatron-Core call gograph.integrations.megatron.use_gograph(), which "
            "records Megatron's capture state"
        )

    def _raise_reset(self, kind: int = FORWARD, more: str = "") -> None:
        if self._sharers is None:  # (a shared pass's graphs may still serve its other callables)
            self.engine.replay(self.pass_id, kind)  # the core's message: "... was reset ..."
        raise RuntimeError(f"gograph: graphed callable {self.index} ({self.label}) was reset{more}")

    # -- lifecycle ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Releases this callable's graphs and pool references and drops its static buffers.

        Waits for the device first (a replay may still be running). Harmless when called again.
        Afterwards, calling the callable raises RuntimeError saying it was reset (a module whose
        train/eval mode differs from the captured one still runs its original forward). With
        ``share_microbatch_graphs``, callables that replay one set of graphs release it when the
        last of them is reset (or collected); until then a reset only takes this one out."""
        if self._released:
            return
        if self._sharers is not None and not self._sharers.leave(self.index):
            self._forget_buffers()  # other callables still replay these graphs: they stay
            log.debug("reset graphed callable %d (%s); its graphs serve others", self.index, self.label)
            return
        try:
            if self.shared.lent is not None:
                self.shared.lent.drop_pass(self.pass_id)
            WATCH.forget(self.pass_id)
            self.engine.synchronize()
            self.engine.release(self.pass_id, self.pool)
        finally:
            self._forget_buffers()
        log.debug("reset pass %d (%s)", self.pass_id, self.label)

    def _forget_buffers(self) -> None:
        """Marks this callable reset and drops its references to the static buffers."""
        for guard in self._shared_guards:  # its backward can no longer run: it waits for nothing
            guard.waiting.pop(self.index, None)
        self._released = True
        self.static_input_surface = self.static_outputs = self.module_params = ()
        self.static_grad_outputs = self.static_grad_inputs = ()
        self._param_grad_slots, self._input_sig, self._wgrad, self._shared_guards = (), (), None, ()
        self._wgrad_pending = None  # the targets it held go with the graph


def _no_backward_reason(spec: PassSpec) -> str:
    """Why a pass has no backward graph, and what to do, for a backward that reaches it."""
    where = f"gograph: graphed callable {spec.index} ({spec.label}) has no backward graph"
    if spec.grad_enabled:
        return (
            f"{where}: none of its outputs required grad at capture (its sample args and parameters needed none). "
            "Graph it with sample args that require grad where gradients should flow"
        )
    if spec.te_grads and spec.training is False:  # _order: TransformerEngine's inference rule
        return (
            f"{where}: with _order, modules in eval mode are graphed forward-only (TransformerEngine's inference "
            "rule), so no gradient flows through it. Graph the modules in train() mode to train through them, or "
            "call it under torch.no_grad()"
        )
    return (
        f"{where}: it was graphed under torch.no_grad(), so no gradient flows through it. Graph it with grad "
        "mode on (outside torch.no_grad()) to train through it, or call it under torch.no_grad()"
    )


def _finalize(
    engine: Engine, pass_id: int, pool: Hashable, lent: LentGrads | None, sharers: Sharers | None, member: int
) -> None:
    if sharers is not None:
        sharers.leave(member)
        if not sharers.collect(member):
            return  # others still replay these graphs, or hold the record that says they were reset
    try:
        WATCH.forget(pass_id)
    except Exception as e:  # a finalizer must not raise
        log.warning("forgetting the hand-outs of pass %d: %s", pass_id, str(e))
    if lent is not None:
        try:
            lent.drop_pass(pass_id)
        except Exception as e:  # a finalizer must not raise
            log.warning("copying out the lent gradients of pass %d: %s", pass_id, str(e))
    engine.finalize_pass(pass_id, pool)


class _Leaf:
    __slots__ = ()

    def __repr__(self) -> str:
        return "T"


def _structure(spec: pytree.TreeSpec) -> str:
    """A one-line picture of an args structure, leaves drawn as T: ``({'a': T, 'b': T},)``."""
    try:
        return repr(pytree.tree_unflatten([_Leaf()] * spec.num_leaves, spec))
    except Exception:  # pragma: no cover - exotic node types
        return str(spec).replace("\n", "")


# ---------------------------------------------------------------------------------------------
# The autograd node
# ---------------------------------------------------------------------------------------------
class _GraphedFunction(torch.autograd.Function):
    """The autograd node of a graphed call (torch's ``Graphed``, with the per-callable state
    passed in as the first, non-tensor, argument)."""

    @staticmethod
    def forward(
        ctx: Any,
        graphed: GraphedCallable,
        opts: tuple[Any, Any] | None,
        *inputs: Tensor,
    ) -> tuple[Tensor, ...]:
        ctx.graphed = graphed
        ctx.opts = opts  # cuda_graph_stream / cuda_graph_event, also used by the backward
        if graphed._sharers is not None:  # another member's backward may still read the buffers
            graphed._sharers.before_forward(graphed.index)
        outputs = graphed._replay_forward(inputs, opts)
        for guard in graphed._shared_guards:  # its backward, until it runs, reads those buffers
            guard.forward_ran(graphed.index, ctx)
        if graphed._sharers is not None and graphed.has_backward:  # another member must wait for its backward
            graphed._sharers.forward_ran(graphed.index, ctx)
        # An argument that requires grad where its sample did not: its graph has no gradient for it,
        # but outputs require grad where eager's would; the backward raises if it is asked for one.
        nograd = graphed._nograd_args
        ctx.ungraphed = tuple(i for i in nograd if inputs[i].requires_grad) if nograd else ()
        if graphed._nondiff_outputs and not ctx.ungraphed:
            ctx.mark_non_differentiable(*(outputs[i] for i in graphed._nondiff_outputs))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            # backward(create_graph=True): the graph's backward is not differentiable; without
            # create_graph autograd runs this with grad mode off, and once_differentiable's
            # no_grad context and input scan would only cost time on every replay.
            ctx.gograph_create_graph = True
            return _graphed_backward_once_differentiable(ctx, *grads)
        return _graphed_backward(ctx, *grads)


def _graphed_backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
    graphed: GraphedCallable = ctx.graphed
    if ctx.ungraphed:
        graphed._raise_ungraphed_grad(ctx)
    if graphed._no_backward is not None:
        raise RuntimeError(graphed._no_backward)
    if getattr(ctx, "gograph_backward_done", False) and not graphed._retain_graph_in_backward:
        # The backward graph consumes its forward's activations (their pool memory is reused
        # inside the backward graph), so a second run would compute from overwritten memory.
        raise RuntimeError(
            f"gograph: trying to backward through graphed callable {graphed.index} ({graphed.label}) a second "
            "time for the same forward call. A graphed backward can run once per forward (retain_graph=True "
            "cannot keep graph activations unless the callable was graphed with retain_graph_in_backward=True): "
            "call the graphed callable again and backward through its new outputs"
        )
    if graphed._check_replay_order:  # debug guard: refuse before the grad buffers are written
        _core.check_replay_order(graphed.pass_id, BACKWARD)
    ctx.gograph_backward_done = True
    lend = not getattr(ctx, "gograph_create_graph", False)
    return (None, None, *graphed._replay_backward(grads, ctx.opts, lend))


_graphed_backward_once_differentiable = once_differentiable(_graphed_backward)
_apply_graphed_function: Callable[..., Any] = _torch.cpp_function_apply(_GraphedFunction)
