"""TransformerEngine's extensions to ``make_graphed_callables``, planned by the Go core.

This module holds the Python half of the planning: it encodes ``_order`` /
``_num_layers_per_chunk`` and the buffers of each graphed pass into the compact text the core
takes (``plan_schedule``, ``plan_buffers``, see docs/CORE_API.md), decodes the plans, and
provides the small pieces that run them: capture-time hooks with TransformerEngine's checks
and messages, discovery of submodules with delayed weight gradients, the weight-gradient
capture body, and the non-owning views that hand a dead buffer's memory back to a graph pool.

Go decides (which step runs when, which buffers share a slot, when a buffer dies); Python
executes (runs the callables, holds the tensors).
"""
from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _native

__all__ = [
    "BufferReuse",
    "HOOK_KEYS",
    "ScheduleError",
    "ScheduleTypeError",
    "Schedule",
    "Step",
    "canonicalize_capture_time_hooks",
    "encode_layers",
    "encode_order",
    "plan_schedule",
]

# ---------------------------------------------------------------------------------------------
# _order and the schedule
# ---------------------------------------------------------------------------------------------
FORWARD_STEP, BACKWARD_STEP, WGRAD_STEP = "F", "B", "W"


class ScheduleError(ValueError):
    """A malformed ``_order`` / ``_num_layers_per_chunk`` (or arguments that do not fit them):
    the message names the entry and the rule. A ValueError."""


class ScheduleTypeError(ScheduleError, TypeError):
    """An ``_order`` or ``_num_layers_per_chunk`` entry of the wrong type (a ScheduleError, so a
    ValueError, and a TypeError)."""


def encode_order(order: Any) -> str:
    """``_order`` as the core's text: entries joined by commas. Integers are written as such,
    floats with their decimal (``-1.5``); the core decides what each entry means. Raises
    TypeError for entries that are not real numbers (bools included, as they are not chunk
    ids)."""
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        raise ScheduleTypeError(f"gograph: _order must be a list of chunk ids, got {type(order).__name__}")
    parts = []
    for i, c in enumerate(order):
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            raise ScheduleTypeError(
                f"gograph: _order entry {i} ({c!r}) is a {type(c).__name__}; entries are integers c "
                "(forward of chunk c), -c (backward) or -(c+0.5) (weight gradient)")
        if isinstance(c, numbers.Integral):
            parts.append(str(int(c)))
            continue
        x = float(c)
        if not math.isfinite(x):
            parts.append(repr(x))
            continue
        # Exact decimal: a float such as -1.5 renders as "-1.5"; anything that is not a half
        # stays recognisably fractional ("-1.25"), and integral floats keep their ".0".
        parts.append(repr(x) if "e" not in repr(x) else f"{x:.6f}")
    return ",".join(parts)


def encode_layers(layers: Any) -> str:
    """``_num_layers_per_chunk`` as the core's text: "" (None), "*L" (one int), "L1,L2,..."."""
    if layers is None:
        return ""
    if isinstance(layers, bool):
        raise ScheduleTypeError("gograph: _num_layers_per_chunk must be an int or a list of ints, got a bool")
    if isinstance(layers, numbers.Integral):
        return f"*{int(layers)}"
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise ScheduleTypeError(f"gograph: _num_layers_per_chunk must be an int or a list of ints, got {type(layers).__name__}")
    out = []
    for i, n in enumerate(layers):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise ScheduleTypeError(f"gograph: _num_layers_per_chunk[{i}] ({n!r}) is not an int")
        out.append(str(int(n)))
    if not out:
        raise ScheduleError("gograph: _num_layers_per_chunk is empty; give one layer count per chunk")
    return ",".join(out)


class Step(NamedTuple):
    """One warmup/capture step: kind ("F", "B", "W"), the graphed pass, its callable, the
    ``_order`` entry it expands (-1 without ``_order``), chunk (1-based), layer, microbatch.
    (A named tuple: a schedule decodes one per step, hundreds for a pipeline.)"""

    kind: str
    pass_index: int
    callable_index: int
    entry: int
    chunk: int
    layer: int
    micro: int


@dataclass
class Schedule:
    """A plan from the core's ``plan_schedule``: the steps in the order warmup and capture run
    them, and the pass -> callable mapping (TransformerEngine's indexing)."""

    ordered: bool
    chunks: int
    microbatches: int
    layers: tuple[int, ...]
    num_callables: int
    num_passes: int
    steps: tuple[Step, ...]
    text: str  # the core's encoding, handed back to plan_buffers
    order: tuple[Any, ...] = ()
    callable_of: tuple[int, ...] = field(default=())
    wgrad_step_of: dict[int, int] = field(default_factory=dict)
    backward_step_of: dict[int, int] = field(default_factory=dict)

    def entry_name(self, entry: int) -> str:
        if 0 <= entry < len(self.order):
            return f"_order entry {entry} ({self.order[entry]!r})"
        return "the default schedule"


def _core() -> Any:
    return _native.core


def _invalid(e: RuntimeError) -> ScheduleError | None:
    msg = str(e)
    marker = "invalid schedule: "
    if marker not in msg:
        return None
    return ScheduleError("gograph: " + msg.split(marker, 1)[1])


def plan_schedule(order: Any, layers: Any, num_callables: int, num_samples: int, training: bool,
                  warmup_iters: int) -> Schedule:
    """Validates and expands the schedule in the core. A malformed ``_order`` (or arguments that
    do not fit it) raises ValueError naming the entry and the rule."""
    order_text = "" if order is None else encode_order(order)
    if order is not None and not order_text:
        raise ScheduleError("gograph: _order is empty; it must list each chunk's forward and backward entries")
    try:
        text = str(_core().plan_schedule(order_text, encode_layers(layers), int(num_callables),
                                         int(num_samples), bool(training), int(warmup_iters)))
    except RuntimeError as e:
        invalid = _invalid(e)
        if invalid is not None:
            raise invalid from None
        raise
    return decode_schedule(text, tuple(order) if order is not None else ())


def decode_schedule(text: str, order: tuple[Any, ...] = ()) -> Schedule:
    lines = text.strip().split("\n")
    head = dict(kv.split("=", 1) for kv in lines[0].split()[2:])
    steps = []
    for line in lines[1:]:
        k, p, c, e, ch, la, mi = line.split()
        steps.append(Step(k, int(p), int(c), int(e), int(ch), int(la), int(mi)))
    n = int(head["passes"])
    callable_of = [0] * n
    wgrad: dict[int, int] = {}
    backward: dict[int, int] = {}
    for i, s in enumerate(steps):
        if s.kind == FORWARD_STEP:
            callable_of[s.pass_index] = s.callable_index
        elif s.kind == WGRAD_STEP:
            wgrad[s.pass_index] = i
        else:
            backward[s.pass_index] = i
    return Schedule(
        ordered=head["ordered"] == "1", chunks=int(head["chunks"]), microbatches=int(head["microbatches"]),
        layers=tuple(int(x) for x in head["layers"].split(",") if x), num_callables=int(head["callables"]),
        num_passes=n, steps=tuple(steps), text=text, order=order, callable_of=tuple(callable_of),
        wgrad_step_of=wgrad, backward_step_of=backward)


# ---------------------------------------------------------------------------------------------
# sample_kwargs
# ---------------------------------------------------------------------------------------------
def canonicalize_sample_kwargs(sample_kwargs: Any, num: int, just_one: bool, ordered: bool,
                               num_callables: int) -> tuple[dict[str, Any], ...]:
    """One dict per forward pass (TransformerEngine's checks and messages)."""
    if sample_kwargs is None:
        return tuple({} for _ in range(num))
    if just_one:
        sample_kwargs = (sample_kwargs,)
    if isinstance(sample_kwargs, Mapping) or not isinstance(sample_kwargs, (tuple, list)):
        raise TypeError(
            "gograph: sample_kwargs must be a dict for a single callable, or a tuple/list with one dict "
            f"per {'forward pass' if ordered else 'callable'}; got {type(sample_kwargs).__name__}")
    if len(sample_kwargs) != num:
        if ordered:
            raise ValueError(
                "Pipeline-parallel schedule requires sample_kwargs and sample_args to have "
                f"the same length, but got {len(sample_kwargs)} sample_kwargs for {num} sample_args")
        raise ValueError(
            "Expected sample_kwargs to have the same length as callables, "
            f"but got {len(sample_kwargs)} sample_kwargs for {num_callables} callables")
    out = []
    for i, kw in enumerate(sample_kwargs):
        if kw is None:
            kw = {}
        if not isinstance(kw, Mapping) or not all(isinstance(k, str) for k in kw):
            raise TypeError(f"gograph: sample_kwargs[{i}] must be a dict with str keys, got {type(kw).__name__}")
        out.append(dict(kw))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Capture-time hooks (TransformerEngine's capture_time_hooks)
# ---------------------------------------------------------------------------------------------
HOOK_KEYS = (
    "forward_pre_hooks",
    "forward_pre_hooks_with_kwargs",
    "forward_hooks",
    "forward_hooks_with_kwargs",
    "backward_pre_hooks",
    "backward_hooks",
)


def canonicalize_capture_time_hooks(num_callables: int, hooks: Any) -> list[dict[str, dict[Any, Any]]] | None:
    """TransformerEngine's ``_canonicalize_capture_time_hooks``: one dict per callable with every
    key present. None when no hooks were given."""
    if hooks is None:
        return None
    if isinstance(hooks, Mapping) or not isinstance(hooks, Sequence):
        raise TypeError(f"capture_time_hooks must be a list with one dict (or None) per callable, got {type(hooks).__name__}")
    if len(hooks) != num_callables:
        raise ValueError(f"capture_time_hooks has {len(hooks)} entries but there are {num_callables} callables")
    out = []
    for idx, h in enumerate(hooks):
        if h is None:
            out.append({k: {} for k in HOOK_KEYS})
            continue
        if not isinstance(h, dict):
            raise TypeError(
                "capture_time_hooks entries must be dicts or None, "
                f"but entry {idx} has type {type(h).__name__}")
        unknown = sorted(set(h) - set(HOOK_KEYS))
        if unknown:
            raise ValueError(
                f"Unknown capture_time_hooks keys for callable {idx}: {unknown}. "
                f"Supported keys are {list(HOOK_KEYS)}")
        entry = {}
        for key in HOOK_KEYS:
            value = h.get(key, {})
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise TypeError(f"capture_time_hooks[{idx!r}][{key!r}] must be a dict, but got {type(value).__name__}")
            entry[key] = dict(value)
        out.append(entry)
    return out


def _check_hook_return(value: Any, hook_name: str, detail: str) -> None:
    if value is not None:
        raise RuntimeError(
            f"capture_time_hooks {hook_name} must not return a value ({detail} must not be "
            "modified via hook return)")


class CaptureTimeHooks:
    """Runs one callable's capture-time hooks (outside any capture; never replayed)."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: list[dict[str, dict[Any, Any]]] | None) -> None:
        self.hooks = hooks

    def forward_pre(self, idx: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.hooks is None:
            return
        h = self.hooks[idx]
        with_kwargs = h["forward_pre_hooks_with_kwargs"]
        for hook_id, hook in h["forward_pre_hooks"].items():
            if hook_id in with_kwargs:
                _check_hook_return(hook(func, args, kwargs), "forward_pre_hooks", "args/kwargs")
            else:
                _check_hook_return(hook(func, args), "forward_pre_hooks", "args")

    def forward(self, idx: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any) -> None:
        if self.hooks is None:
            return
        h = self.hooks[idx]
        with_kwargs = h["forward_hooks_with_kwargs"]
        for hook_id, hook in h["forward_hooks"].items():
            if hook_id in with_kwargs:
                _check_hook_return(hook(func, args, kwargs, outputs), "forward_hooks", "output")
            else:
                _check_hook_return(hook(func, args, outputs), "forward_hooks", "output")

    def backward_pre(self, idx: int, func: Any, grad_outputs: tuple[Any, ...]) -> None:
        if self.hooks is None:
            return
        for hook in self.hooks[idx]["backward_pre_hooks"].values():
            _check_hook_return(hook(func, grad_outputs), "backward_pre_hooks", "grad_output")

    def backward(self, idx: int, func: Any, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        if self.hooks is None:
            return
        for hook in self.hooks[idx]["backward_hooks"].values():
            _check_hook_return(hook(func, grad_inputs, grad_outputs), "backward_hooks", "grad_input")


def call_warmup_hook(hook: Any, name: str) -> None:
    if hook is None:
        return
    if not callable(hook):
        raise TypeError(f"gograph: {name} must be callable (called once, without arguments), got {type(hook).__name__}")
    hook()


# ---------------------------------------------------------------------------------------------
# Delayed weight gradients (a generic protocol instead of TransformerEngine's module classes)
# ---------------------------------------------------------------------------------------------
def has_wgrad_protocol(module: Any) -> bool:
    """A submodule takes part when it defines ``need_backward_dw()`` and ``backward_dw()``."""
    if isinstance(module, torch.nn.Module):
        # Instance dict, then class: what getattr finds for methods, without going through
        # nn.Module.__getattr__, whose miss (the common case) builds an AttributeError -- asked
        # for every submodule of every callable graphed.
        inst, cls = module.__dict__, type(module)
        return (callable(inst.get("need_backward_dw", getattr(cls, "need_backward_dw", None)))
                and callable(inst.get("backward_dw", getattr(cls, "backward_dw", None))))
    return callable(getattr(module, "need_backward_dw", None)) and callable(getattr(module, "backward_dw", None))


def wgrad_candidates(func: Any) -> tuple[Any, ...]:
    """The modules :func:`discover_wgrad_modules` watches in ``func``: its submodules that
    implement the delayed weight-gradient protocol, then ``func`` itself when it does (empty
    for a function, or a module where none does)."""
    if not isinstance(func, torch.nn.Module):
        return ()
    subs = tuple(m for m in func.modules() if m is not func and has_wgrad_protocol(m))
    return subs + ((func,) if has_wgrad_protocol(func) else ())


@contextlib.contextmanager
def discover_wgrad_modules(func: Any, found: dict[int, Any],
                           candidates: tuple[Any, ...] | None = None) -> Iterator[None]:
    """While active, every submodule of ``func`` (a module) that runs its forward and implements
    the delayed weight-gradient protocol is added to ``found`` (id -> module, first-seen order).
    The temporary forward hooks are removed even when the forward raises. ``candidates`` is
    :func:`wgrad_candidates` of ``func``, when the caller computed it already."""
    if candidates is None:
        candidates = wgrad_candidates(func)
    if not candidates:
        yield
        return

    def hook(module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if has_wgrad_protocol(module):
            found.setdefault(id(module), module)

    handles = []
    try:
        for m in candidates:
            if m is not func:
                handles.append(m.register_forward_hook(hook))
        yield
        # The graphed module itself runs through its unbound forward (no hooks fire): it ran.
        if candidates[-1] is func:
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
    submodule whose ``need_backward_dw()`` is True. Modules are held weakly, and their
    ``backward_dw`` methods are bound when the body is made (a graphed module's own
    ``backward_dw`` attribute is then replaced by the graphed callable's)."""

    __slots__ = ("_refs", "_calls", "label")

    def __init__(self, modules: Sequence[Any], label: str) -> None:
        self._refs = tuple(weakref.ref(m) for m in modules)
        self._calls = tuple(_weak_callable(m.backward_dw) for m in modules)
        self.label = label

    def modules(self) -> list[Any]:
        out = []
        for r in self._refs:
            m = r()
            if m is None:
                raise RuntimeError(f"gograph: a submodule of {self.label} with a delayed weight gradient no longer exists")
            out.append(m)
        return out

    def __call__(self) -> tuple[()]:
        for m, call in zip(self.modules(), self._calls):
            if m.need_backward_dw():
                fn = call()
                if fn is None:
                    raise RuntimeError(f"gograph: a submodule of {self.label} with a delayed weight gradient no longer exists")
                fn()
        return ()


# ---------------------------------------------------------------------------------------------
# Buffer reuse (_reuse_graph_input_output_buffers)
# ---------------------------------------------------------------------------------------------
def tensor_signature(t: Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def signature_text(sig: tuple[Any, ...]) -> str:
    shape, stride, dtype, device = sig
    return f"{list(shape)} {str(dtype).replace('torch.', '')} {device}" + (
        "" if _contiguous_strides(shape) == tuple(stride) else f" strides {list(stride)}")


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def slot_eligible(t: Tensor) -> bool:
    """A sample tensor can back (or move into) a shared slot: a dense tensor that is its whole
    storage, and a leaf (a view of it would lose a non-leaf's autograd history)."""
    if t.layout != torch.strided or (t.requires_grad and not t.is_leaf) or isinstance(t, torch.nn.Parameter):
        return False
    if t.storage_offset() != 0 or t.numel() == 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return False
    # non-overlapping and dense: the strides, sorted, are the running products of the sizes
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def te_signature(t: Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.layout)


@dataclass
class BufferReuse:
    """How ``_reuse_graph_input_output_buffers`` planned the static buffers of one
    ``make_graphed_callables`` call (attribute ``buffer_reuse`` of every returned callable).

    * ``signatures``: per tensor signature (``"[4096, 1024] bfloat16 cuda:0"``), a dict with
      ``buffers`` (static inputs and grad outputs that would exist without reuse), ``slots``
      (what this plan needs, by liveness over the schedule) and ``te_fifo`` (what
      TransformerEngine's FIFO scheme keeps for the same buffers).
    * ``slots``, ``te_fifo``, ``buffers``: their sums.
    * ``released``: pool buffers (outputs, input grads, cloned parameter grads) whose memory is
      handed back to the graph pool once their last capture-time use is captured (CUDA engine).
    """

    signatures: dict[str, dict[str, int]]
    slots: int
    te_fifo: int
    buffers: int
    released: int = 0
    text: str = ""

    def __repr__(self) -> str:
        return (f"BufferReuse(slots={self.slots}, te_fifo={self.te_fifo}, buffers={self.buffers}, "
                f"signatures={self.signatures})")


def plan_buffers(schedule_text: str, lines: Sequence[str]) -> tuple[list[int], dict[int, tuple[int, int, int]], int]:
    """Calls the core's ``plan_buffers``; returns (value per buffer, {sig: (buffers, slots,
    te_fifo)}, slots)."""
    out = str(_core().plan_buffers(schedule_text, "\n".join(lines)))
    values: list[int] = []
    sigs: dict[int, tuple[int, int, int]] = {}
    slots = 0
    for line in out.strip().split("\n"):
        head, *rest = line.split()
        if head == "assign":
            values = [int(x) for x in rest]
        elif head == "sig":
            s, b, n, te = (int(x) for x in rest)
            sigs[s] = (b, n, te)
        elif head == "slots":
            slots = int(rest[0])
    return values, sigs, slots


def weak_view(t: Tensor) -> Tensor:
    """A tensor over ``t``'s memory that does not own it (a CUDA graph pool block): dropping every
    owning reference hands the block back to its pool for later captures, while graphs keep
    writing the same addresses at replay. Used only on the CUDA engine, for buffers the schedule
    proves dead (TransformerEngine's ``make_weak_ref``)."""
    st = t.untyped_storage()
    ws = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    view = torch.empty((0,), dtype=t.dtype, device=t.device)
    view.set_(ws, t.storage_offset(), t.size(), t.stride())
    return view


def replace_leaves(tree: Any, replacements: Mapping[int, Tensor]) -> Any:
    """``tree`` with leaf i replaced by ``replacements[i]``."""
    leaves, spec = pytree.tree_flatten(tree)
    for i, t in replacements.items():
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


__all__ += ["CaptureTimeHooks", "WgradBody", "call_warmup_hook", "canonicalize_sample_kwargs",
            "discover_wgrad_modules", "has_wgrad_protocol", "wgrad_candidates", "modules_needing_dw", "plan_buffers",
            "replace_leaves", "signature_text", "slot_eligible", "te_signature", "tensor_signature",
            "weak_view"]



# ---------------------------------------------------------------------------------------------
# Running a planned pass
# ---------------------------------------------------------------------------------------------
class CallWithKwargs:
    """A forward body called with the positional sample args followed by the values of the
    captured kwargs (in key order), as engines record bodies with positional args only."""

    __slots__ = ("body", "n_args", "keys")

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

    def __call__(self, *args: Any) -> Any:
        n = self.n_args
        return self.body(*args[:n], **dict(zip(self.keys, args[n:])))


def apply_buffer_reuse(plans: Sequence[Any], schedule: Schedule, clone_param_grads: bool,
                       release_pool_buffers: bool) -> tuple[BufferReuse, dict[int, list[tuple[str, Any, int]]]]:
    """Plans ``_reuse_graph_input_output_buffers`` in the core and rewires the passes.

    Each plan (graphs._Plan) must have run warmup: ``output_meta`` holds (signature,
    requires_grad) per forward output. Afterwards

    * ``plan.flat_args``, ``plan.sample_args`` and ``plan.sample_kwargs`` hold the slot tensors:
      a slot is backed by one of its sample tensors (or, for a slot only grad outputs use, a new
      zeroed tensor); passes sharing it get that tensor, or a view with their requires_grad;
      the other sample tensors are no longer referenced;
    * ``plan.grad_output_slots`` holds, per forward output, the slot tensor its backward capture
      reads incoming grads from (None: allocate one);

    and the returned dict maps a step index to the pool buffers (role "o" output, "d" input
    grad, "p" parameter grad; plan; index) that die once that step is captured.

    Sample leaves that appear more than once (in one pass or across passes), parameters,
    non-leaves that require grad and tensors that are not a whole dense storage keep their own
    buffer (they are not the schedule's to share)."""
    occurrences: dict[int, int] = {}
    params: set[int] = set()
    for plan in plans:
        for t in plan.flat_args:
            occurrences[id(t)] = occurrences.get(id(t), 0) + 1
        params.update(id(p) for p in plan.module_params)
    sig_ids: dict[tuple[Any, ...], int] = {}
    te_in: dict[tuple[Any, ...], int] = {}
    te_grad: dict[tuple[Any, ...], int] = {}

    def sig_id(sig: tuple[Any, ...]) -> int:
        return sig_ids.setdefault(sig, len(sig_ids))

    lines: list[str] = []
    refs: list[tuple[str, Any, int]] = []
    for plan in plans:
        p = plan.index
        for j, t in enumerate(plan.flat_args):
            if occurrences[id(t)] == 1 and id(t) not in params and slot_eligible(t):
                lines.append(f"i {p} {sig_id(tensor_signature(t))}")
                refs.append(("i", plan, j))
        for k, (sig, rg) in enumerate(plan.output_meta):
            if rg and plan.grad_enabled:
                lines.append(f"g {p} {sig_id(sig)}")
                refs.append(("g", plan, k))
        for k, (sig, rg) in enumerate(plan.output_meta):
            lines.append(f"o {p} {sig_id(sig)}")
            refs.append(("o", plan, k))
        for j, t in enumerate(plan.flat_args):
            if t.requires_grad:
                lines.append(f"d {p} {sig_id(tensor_signature(t))}")
                refs.append(("d", plan, j))
        if clone_param_grads:
            n = len(plan.flat_args)
            for k, prm in enumerate(plan.module_params):
                if prm.requires_grad and not getattr(prm, "skip_backward_post_hook", False):
                    lines.append(f"p {p} {sig_id(tensor_signature(prm))}")
                    refs.append(("p", plan, n + k))
        in_key = te_in.setdefault(
            tuple(te_signature(t) for t in plan.flat_pos)
            + tuple((k, *te_signature(v)) for k, v in sorted(plan.sample_kwargs.items()) if isinstance(v, Tensor)),
            len(te_in))
        grad_key = te_grad.setdefault(
            tuple((sig[0], sig[2]) for sig, rg in plan.output_meta if rg), len(te_grad))
        lines.append(f"k {p} {in_key} {grad_key}")

    values, sigs, slots = plan_buffers(schedule.text, lines)
    if len(values) != len(refs):
        raise RuntimeError(f"gograph: plan_buffers returned {len(values)} assignments for {len(refs)} buffers")

    # Slot backing: one sample tensor per slot (else a new zeroed tensor of the signature).
    backing: dict[int, Tensor] = {}
    for (role, plan, idx), slot in zip(refs, values):
        if role == "i" and slot not in backing:
            backing[slot] = plan.flat_args[idx]
    inverse = {v: k for k, v in sig_ids.items()}
    for (role, plan, idx), slot in zip(refs, values):
        if role == "g" and slot not in backing:
            shape, stride, dtype, device = plan.output_meta[idx][0]
            backing[slot] = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()

    new_leaves: dict[int, dict[int, Tensor]] = {}
    grad_slots: dict[int, dict[int, Tensor]] = {}
    releases: dict[int, list[tuple[str, Any, int]]] = {}
    released = 0
    for (role, plan, idx), v in zip(refs, values):
        if role == "i":
            t, b = plan.flat_args[idx], backing[v]
            if b is not t:
                new_leaves.setdefault(plan.index, {})[idx] = (
                    b if b.requires_grad == t.requires_grad else b.detach().requires_grad_(t.requires_grad))
        elif role == "g":
            b = backing[v]
            grad_slots.setdefault(plan.index, {})[idx] = b.detach() if b.requires_grad else b
        elif v >= 0:
            releases.setdefault(v, []).append((role, plan, idx))
            released += 1
    for plan in plans:
        repl = new_leaves.get(plan.index)
        if repl:
            n_pos = len(plan.flat_pos)
            flat = list(plan.flat_args)
            for j, t in repl.items():
                flat[j] = t
            plan.flat_args = tuple(flat)
            plan.flat_pos = plan.flat_args[:n_pos]
            plan.sample_args = replace_leaves(plan.sample_args, {j: t for j, t in repl.items() if j < n_pos})
            kw = {j - n_pos: t for j, t in repl.items() if j >= n_pos}
            if kw:
                keys = plan.kwargs_keys
                values_kw = replace_leaves([plan.sample_kwargs[k] for k in keys], kw)
                plan.sample_kwargs = dict(zip(keys, values_kw))
        gs = grad_slots.get(plan.index, {})
        plan.grad_output_slots = tuple(gs.get(k) for k in range(len(plan.output_meta)))
    del backing

    signatures = {}
    for s, (nb, ns, te) in sorted(sigs.items()):
        signatures[signature_text(inverse[s])] = {"buffers": nb, "slots": ns, "te_fifo": te}
    reuse = BufferReuse(
        signatures=signatures, slots=slots, te_fifo=sum(d["te_fifo"] for d in signatures.values()),
        buffers=sum(d["buffers"] for d in signatures.values()),
        released=released if release_pool_buffers else 0)
    return reuse, (releases if release_pool_buffers else {})


def release_pool_buffer(role: str, plan: Any, idx: int) -> None:
    """Drops gograph's owning reference to a pool buffer the schedule proved dead (keeping a
    non-owning view for the graphs' static tensors)."""
    if role == "o":
        outs = list(plan.static_outputs)
        outs[idx] = weak_view(outs[idx])
        plan.static_outputs = tuple(outs)
    else:
        grads = list(plan.static_grad_inputs)
        if idx < len(grads) and grads[idx] is not None:
            grads[idx] = weak_view(grads[idx])
            plan.static_grad_inputs = tuple(grads)


__all__ += ["CallWithKwargs", "apply_buffer_reuse", "release_pool_buffer"]


def megatron_order(pipeline_size: int, rank: int, chunks: int, microbatches: int,
                   group_size: int | None = None) -> list[int]:
    """Megatron-LM's interleaved 1F1B schedule for one pipeline rank as a TransformerEngine
    ``_order`` (its ``get_schedule_table`` and ``convert_schedule_table_to_order``): microbatches
    in groups of ``group_size`` (default ``pipeline_size``) per virtual chunk, warmup forwards
    ``(pipeline_size - rank - 1) * 2 + (chunks - 1) * group_size``, then one forward / one
    backward, then the remaining backwards (backwards run the chunks in reverse)."""
    group = pipeline_size if group_size is None else group_size
    table: list[int] = []  # chunk id (0-based) of each forward, in schedule order
    for lo in range(0, microbatches, group):
        hi = microbatches if lo + group >= microbatches else lo + group
        for c in range(chunks):
            table.extend([c] * (hi - lo))
    total = microbatches * chunks
    warm = min((pipeline_size - rank - 1) * 2 + (chunks - 1) * group, total)
    fwd = [c + 1 for c in table]
    bwd = [c - chunks for c in table]
    order = fwd[:warm]
    for i in range(warm, total):
        order += [fwd[i], bwd[i - warm]]
    if warm:
        order += bwd[total - warm:]
    return order


__all__ += ["megatron_order"]
