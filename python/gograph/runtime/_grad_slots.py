"""The grad-slot policy (the core's ``internal/gradslot``), read once, and its execution for the
slots a weight-gradient graph writes.

A *slot* is where a parameter's gradient lives for the caller: ``.grad``, or an accumulation
buffer such as Megatron-LM's ``.main_grad``. The core decides, in one table, what a slot gets
when a graph hands it a gradient: the parameter grads a backward graph returns (lent, owned,
learnt from how the caller drops or keeps them: :func:`backward_table`, :func:`sweep_table`,
executed by :mod:`gograph.replay.graphed`), and the slots of a delayed weight-gradient graph
(TransformerEngine's ``backward_dw()``), executed here:

* at capture, :func:`snapshot` and :func:`capture_targets` read what the module's work did to each
  slot of its parameters (without warmup, an empty ``.grad`` is shown a zero tensor, so that the
  capture sees what the work does to an existing one: :func:`fillers`): a tensor added into in
  place is the graph's *target* (gograph keeps a reference to that memory for the graph's
  lifetime: the graph adds into that address at every replay); a tensor the module assigned is
  the graph's *own buffer* (held likewise; nobody else ever sees it, as other graphs of the pool
  may write it); every slot then gets back what the caller had in it;
* at replay, the check :func:`pending_check` binds once per graph finds the slots not in the
  captured state (None, another tensor: the caller dropped, replaced or pre-initialised them
  since), cheaply enough for every call; :func:`plan` asks the policy about each (refusing before
  anything runs where eager could not add the gradient either); :func:`execute` prepares the
  graph's memory, replays, and delivers what eager's ``backward_dw()`` would have left: the
  target lent back, a copy, or the gradient added into the slot's tensor;
* :func:`as_captured` lets the eager engine's replay (which re-runs the module's Python) write
  what the CUDA graph writes: the target, or the graph's own buffer, whatever the slot holds.

Aliasing: a slot lent the target holds a fresh alias of gograph's reference (never gograph's
own tensor object), so a holder of a dropped ``.grad`` shows up in the storage's use count and
is never overwritten: its memory is saved and restored around the replay instead.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..core import _core
from ..core._kinds import GradSource, Learned, SlotAfter, SlotBefore, SlotDeliver, SlotPrepare, SlotState
from ..core._wire import Decision, GradSlotPolicy
from ..support import _torch

__all__ = [
    "ABSENT",
    "ATTRS",
    "Snapshot",
    "WgradTarget",
    "as_captured",
    "backward_table",
    "capture_targets",
    "execute",
    "fillers",
    "pending_check",
    "plan",
    "policy",
    "read_slot",
    "show",
    "snapshot",
    "sweep_table",
    "write_slot",
]

#: The slots a delayed weight gradient may write: ``.grad`` and Megatron-LM's ``.main_grad``.
ATTRS = ("grad", "main_grad")


class _Absent:
    """A ``.main_grad`` that was never set (restored by deleting the attribute)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()


@functools.cache
def policy() -> GradSlotPolicy:
    """The core's grad-slot policy (one core call per process)."""
    return GradSlotPolicy.decode(_core.grad_slot_policy())


@functools.cache
def backward_table() -> tuple[tuple[tuple[Decision, ...], ...], ...]:
    """The backward hand-out, indexed ``[lendable][grad exists][learned]`` (the replay hot path
    reads it by index)."""
    handout = policy().handout
    return tuple(
        tuple(
            tuple(handout[(src, SlotState.OTHER if exists else SlotState.EMPTY, False, learned)] for learned in Learned)
            for exists in (False, True)
        )
        for src in (GradSource.OWNED, GradSource.LENDABLE)
    )


@functools.cache
def sweep_table() -> dict[tuple[bool, bool, Learned], tuple[bool, Learned]]:
    """The sweep rule by (lent, present, learned): (copy out, what the slot learns)."""
    return policy().sweep


def read_slot(p: torch.nn.Parameter, attr: str) -> Any:
    """A slot's value: a tensor, None, or :data:`ABSENT` (a ``.main_grad`` never set)."""
    return getattr(p, attr, ABSENT) if attr != "grad" else p.grad


def write_slot(p: torch.nn.Parameter, attr: str, value: Any) -> None:
    """Puts ``value`` (a tensor, None or :data:`ABSENT`) in a slot."""
    if value is ABSENT:
        if hasattr(p, attr):
            delattr(p, attr)
    elif attr == "grad":
        p.grad = value
    else:
        setattr(p, attr, value)


class WgradTarget:
    """One slot a weight-gradient graph writes: its parameter (weakly), attribute and name, the
    policy's source for it (:class:`GradSource`: the graph adds into ``buffer``, or writes its
    own ``buffer``), and ``buffer``, the memory the graph writes (gograph's reference, held for
    the graph's lifetime), at ``ptr``. ``present`` is what the slot held at capture, as the eager
    engine's replay shows it to the module: ``buffer`` where it held a tensor, else None or
    :data:`ABSENT`."""

    __slots__ = ("attr", "buffer", "name", "param", "present", "ptr", "source")

    def __init__(self, param: torch.nn.Parameter, attr: str, name: str, source: GradSource, buffer: Tensor) -> None:
        self.param = weakref.ref(param)
        self.attr, self.name, self.source, self.buffer = attr, name, source, buffer
        self.ptr = buffer.data_ptr()
        self.present: Any = buffer

    def __repr__(self) -> str:
        return f"WgradTarget({self.name}.{self.attr}, {self.source.name})"


# ---------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------
#: One slot before the capture: (parameter, attribute, name, value, its version or -1).
Snapshot = list[tuple[torch.nn.Parameter, str, str, Any, int]]


def snapshot(mods: Sequence[Any]) -> Snapshot:
    """Every slot of the modules' parameters, each parameter once."""
    out: Snapshot = []
    seen: set[int] = set()
    for m in mods:
        for name, p in m.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            for attr in ATTRS:
                v = read_slot(p, attr)
                out.append((p, attr, name, v, v._version if isinstance(v, Tensor) else -1))
    return out


def _same_memory(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _after(before: Any, version: int, now: Any) -> SlotAfter:
    if not isinstance(before, Tensor):
        return SlotAfter.REPLACED if isinstance(now, Tensor) else SlotAfter.UNTOUCHED
    if not isinstance(now, Tensor):
        return SlotAfter.EMPTIED
    if now is before or _same_memory(now, before):
        return SlotAfter.WRITTEN if now._version != version else SlotAfter.UNTOUCHED
    return SlotAfter.REPLACED


#: gograph's reference to each target, one per memory region (shared by the graphs that add into
#: it, e.g. one layer's microbatch passes), so that the storage's use count tells a holder apart.
_TARGETS: weakref.WeakValueDictionary[tuple[Any, ...], Tensor] = weakref.WeakValueDictionary()


def _target_reference(t: Tensor) -> Tensor:
    key = (t.device, t.untyped_storage().data_ptr(), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
    ref = _TARGETS.get(key)
    if ref is None:
        ref = _TARGETS[key] = t.detach()
    return ref


def fillers(mods: Sequence[Any]) -> list[tuple[torch.nn.Parameter, Tensor]]:
    """A zero tensor for each empty ``.grad`` of the modules' parameters, made before a capture
    that no warmup preceded: shown to the capture instead of None, it tells what the module does
    to an existing ``.grad`` (add into it, replace it), which then decides both states (None:
    assign, the only thing eager does there). Frozen parameters too: a ``backward_dw()`` may write
    their ``.grad`` (autograd does not, and the caller's optimizer may never zero it), and a
    module that replaces it must not be taken for one that adds into it. Made outside the
    capture, so that no graph replays its zeroing."""
    return [
        (p, torch.zeros_like(p, memory_format=torch.preserve_format))
        for m in mods
        for p in m.parameters()
        if p.grad is None
    ]


def show(filled: Sequence[tuple[torch.nn.Parameter, Tensor]]) -> None:
    """Puts the :func:`fillers` in their slots (for the capture only)."""
    for p, z in filled:
        if p.grad is None:
            p.grad = z


def capture_targets(shown: Snapshot, original: Snapshot) -> tuple[WgradTarget, ...]:
    """The slots the capture's work wrote, as the policy reads them (``shown``: the slots as the
    work found them, just before it ran). Every slot then gets back what the caller had in it
    (``original``): a tensor the module added into stays, a tensor it assigned is the graph's own
    buffer from now on, a filler shown to it is the graph's target."""
    capture = policy().capture
    targets = []
    for p, attr, name, was, version in shown:
        now = read_slot(p, attr)
        kind = SlotBefore.TENSOR if isinstance(was, Tensor) else SlotBefore.EMPTY
        source = capture[(kind, _after(was, version, now))]
        if source is GradSource.WGRAD_ADD:
            targets.append(WgradTarget(p, attr, name, source, _target_reference(was)))
        elif source is not None:
            t = WgradTarget(p, attr, name, source, now.detach())
            if source is GradSource.WGRAD_ASSIGN_EMPTY:
                t.present = was
            targets.append(t)
    for p, attr, _, value, _ in original:
        write_slot(p, attr, value)
    return tuple(targets)


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------
def pending_check(targets: Sequence[WgradTarget] | None) -> Callable[[], list[WgradTarget] | None] | None:
    """The check ``backward_dw()`` runs on every call, bound to a graph's targets (fixed at
    capture; None when it has none). It returns the targets a replay alone does not serve, or
    None: those the graph adds into whose slot holds another tensor or None now, and those whose
    graph writes its own buffer, always. A few reads per target, from plain tuples."""
    if not targets:
        return None
    adds = tuple((t.param, t.attr, t.ptr, t) for t in targets if t.source is GradSource.WGRAD_ADD)
    others = [t for t in targets if t.source is not GradSource.WGRAD_ADD]

    def pending() -> list[WgradTarget] | None:
        todo = list(others) if others else None
        for ref, attr, ptr, t in adds:
            p = ref()
            if p is None:
                continue
            now = getattr(p, attr, None)
            if isinstance(now, Tensor) and now.data_ptr() == ptr:
                continue
            if todo is None:
                todo = []
            todo.append(t)
        return todo

    return pending


def _state(t: WgradTarget, now: Any) -> SlotState:
    if not isinstance(now, Tensor):
        return SlotState.EMPTY
    if now.data_ptr() == t.ptr:
        return SlotState.CAPTURED
    if now.shape != t.buffer.shape or now.device != t.buffer.device:
        return SlotState.MISMATCH
    return SlotState.OTHER


def _held(buffer: Tensor) -> bool:
    """Whether anything but gograph's one reference holds the memory (a view of it, the tensor
    object a slot had: each is one more use of the storage; the temporary storage object is
    the other)."""
    return _torch.storage_use_count(buffer.untyped_storage()) > 2


#: A target's decision, with its parameter and the slot's value when it was made.
Step = tuple[WgradTarget, torch.nn.Parameter, Any, Decision]


def plan(targets: Sequence[WgradTarget], label: str) -> list[Step]:
    """The policy's decision for each target, all made before anything runs: a refused slot
    raises RuntimeError (saying why) with nothing prepared or replayed."""
    handout = policy().handout
    steps = []
    for t in targets:
        p = t.param()
        if p is None:
            continue
        now = read_slot(p, t.attr)
        state = _state(t, now)
        held = t.source is GradSource.WGRAD_ADD and state is not SlotState.CAPTURED and _held(t.buffer)
        d = handout[(t.source, state, held, Learned.UNKNOWN)]
        if d.deliver is SlotDeliver.REFUSE:
            raise RuntimeError(_refusal(t, state, now, label))
        steps.append((t, p, now, d))
    return steps


def execute(steps: Sequence[Step], replay: Callable[[], None]) -> None:
    """Prepares each target, replays, delivers each slot's gradient (the memory saved for
    others restored before any slot is written)."""
    with torch.no_grad():
        saved = [(t.buffer, t.buffer.clone()) for t, _, _, d in steps if d.prepare is SlotPrepare.SAVE_ZERO]
        for t, _, _, d in steps:
            if d.prepare is not SlotPrepare.KEEP:
                t.buffer.zero_()
        replay()
        results = [_result(t.buffer, d) for t, _, _, d in steps]
        for buffer, values in saved:
            buffer.copy_(values)
        for (t, p, now, d), r in zip(steps, results):
            if d.deliver is SlotDeliver.ADD:
                now.add_(r)
            elif d.deliver is not SlotDeliver.IN_PLACE:
                write_slot(p, t.attr, r)


def _result(buffer: Tensor, d: Decision) -> Tensor | None:
    """What a slot receives: a fresh alias of the target (lent), a copy, or the gradient to add
    (a copy where the memory is restored before it is added)."""
    if d.deliver is SlotDeliver.LEND:
        return buffer.detach()
    if d.deliver is SlotDeliver.COPY or (d.deliver is SlotDeliver.ADD and d.prepare is SlotPrepare.SAVE_ZERO):
        return buffer.clone()
    return buffer if d.deliver is SlotDeliver.ADD else None


def _refusal(t: WgradTarget, state: SlotState, now: Any, label: str) -> str:
    where = f"gograph: backward_dw() of {label}: {t.name}.{t.attr}"
    if state is SlotState.MISMATCH:
        return (
            f"{where} is a tensor of shape {tuple(now.shape)} on {now.device}, but its weight-gradient graph "
            f"computes a gradient of shape {tuple(t.buffer.shape)} on {t.buffer.device}: it cannot be added into "
            f"it (eager's backward_dw() would fail alike). Set {t.name}.{t.attr} to None (it then gets the "
            "gradient) or to a tensor of that shape and device"
        )
    return (
        f"{where} is the weight-gradient graph's own output buffer, which the replay overwrites, so the "
        f"gradient cannot be added into it. Give {t.name}.{t.attr} a tensor of its own "
        f"({t.attr} = {t.attr}.clone()) or None"
    )


# ---------------------------------------------------------------------------------------------
# The eager engine's replay
# ---------------------------------------------------------------------------------------------
def as_captured(targets: Sequence[WgradTarget], run: Callable[[], None], label: str) -> None:
    """Runs the module's weight-gradient work (``run``) as the CUDA graph replays it, whatever
    the slots hold now: each slot shows what it held at capture (the target, the graph's own
    buffer, None), an assigned tensor is copied into the graph's buffer, and the slots get back
    what they held. A module that now does something else than at capture raises, as a graph
    would silently keep doing what it captured."""
    live = [(t, p, read_slot(p, t.attr)) for t in targets if (p := t.param()) is not None]
    try:
        for t, p, _ in live:
            write_slot(p, t.attr, t.present)
        run()
        with torch.no_grad():
            for t, p, _ in live:
                _take_write(t, read_slot(p, t.attr), label)
    finally:
        for t, p, value in live:
            write_slot(p, t.attr, value)


def _take_write(t: WgradTarget, now: Any, label: str) -> None:
    if t.source is GradSource.WGRAD_ADD:
        ok = now is t.buffer
    else:
        ok = isinstance(now, Tensor) and now is not t.buffer and now.shape == t.buffer.shape
        if ok:
            t.buffer.copy_(now)
    if not ok:
        raise RuntimeError(
            f"gograph eager engine: backward_dw() of {label}: the weight-gradient work did not "
            f"{'add into' if t.source is GradSource.WGRAD_ADD else 'assign a new tensor to'} {t.name}.{t.attr} as "
            "it did at capture; a CUDA graph replays what it captured. Keep the module's weight-gradient work "
            "the same from step to step"
        )
