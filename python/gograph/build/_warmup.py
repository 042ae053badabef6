"""The warmup program's ops (:func:`gograph.core._plan.warmup_program`): one handler per op kind.

:class:`gograph.build._build.Build` runs the program and calls ``HANDLERS[op.kind](build, i, op)``.
Warmup keeps lazy initialisation (cuBLAS handles, cudnn benchmarking, ...) out of the captures
and learns what the captures need: which passes consume generator state, their outputs'
signatures, which submodules have delayed weight gradients, and (TransformerEngine's rules) which
parameters get grads. The handlers are kept tight (for small layers their Python is a visible
part of graphing time): generator offsets are read once between ops, output checks run on each
pass's first forward, and a pass's zero incoming grads serve its next backward until the core's
program says they die.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..core import _plan
from ..core._kinds import StepKind, WarmOp
from ..core._wire import Op
from ..replay._shared_inputs import version_of
from ..request import _te
from ..runtime import _grad_slots
from ..runtime._bodies import autograd_grad
from ._exec import Executor, Hooks, ProgramKind
from ._reuse import tensor_signature
from ._state import PassState

__all__ = [
    "HANDLERS",
    "DelayedGradsRestored",
    "check_outputs",
    "decide_wgrad_without_warmup",
    "module_buffers_restored",
    "warm_forward",
]


def check_outputs(st: PassState, outputs: Sequence[Tensor], device: torch.device | None) -> None:
    """On the CUDA engine (``device`` given), refuses forward outputs off its device: a graph
    cannot produce them. Outputs that alias inputs are allowed, as in torch."""
    if device is None:
        return
    for k, o in enumerate(outputs):
        if o.device != device:
            raise ValueError(
                f"gograph: output leaf {k} of callable {st.index} ({st.spec.label}) is on {o.device}, but graphs "
                f"are captured on {device}: a CUDA graph can only produce tensors on its device. Keep outputs on "
                "the device and move them after the call"
            )


def _forward(x: Executor, i: int, op: Op) -> None:
    st = x.states[op.pass_index]
    warm_forward(st, x.req.callables[st.spec.callable_index], x.req.hooks, x.device)
    if x.hooks.per_forward:
        x.hooks.forward(i, st)
    x.rng_at = _flag(st, 0, x.rng_at, x.engine.rng_marker())


def _backward(x: Executor, i: int, op: Op) -> None:
    st, req = x.states[op.pass_index], x.req
    st.warm_backwards += 1
    done = warm_backward(
        st, req.callables[st.spec.callable_index], req.hooks, req.allow_unused_input, st.warm_backwards - 1
    )
    st.warm_backward_ran = done is not None
    if done is not None and x.hooks.per_backward:
        x.hooks.backward(i, st, *done)
    done = None  # the grads die here
    x.rng_at = _flag(st, 1, x.rng_at, x.engine.rng_marker())
    if st.warm_backward_ran and st.wgrad_modules and st.index not in x.schedule.wgrad_passes:
        warm_dw(st, x, StepKind.BACKWARD, x.schedule.step_entry(st.index, StepKind.BACKWARD))
        x.rng_at = x.engine.rng_marker()  # TransformerEngine runs it right after the backward


def _wgrad(x: Executor, i: int, op: Op) -> None:
    st = x.states[op.pass_index]
    if st.warm_backward_ran:  # an inference pass has no weight gradient (TransformerEngine's rule)
        warm_dw(st, x, StepKind.WGRAD, x.schedule.step_entry(st.index, StepKind.WGRAD))
    x.rng_at = x.engine.rng_marker()  # warm_dw accounts for its own generator use


def _drop_outputs(x: Executor, i: int, op: Op) -> None:
    x.states[op.pass_index].warm_outputs = None


def _drop_inference(x: Executor, i: int, op: Op) -> None:
    st = x.states[op.pass_index]
    if st.warm_outputs is not None and not any(o.requires_grad for o in st.warm_outputs):
        st.warm_outputs = None  # no backward will consume them


def _drop_zero_grads(x: Executor, i: int, op: Op) -> None:
    x.states[op.pass_index].warm_grads = None


#: The handler of each warmup op.
HANDLERS: dict[WarmOp, Callable[[Executor, int, Op], None]] = {
    WarmOp.FORWARD: _forward,
    WarmOp.BACKWARD: _backward,
    WarmOp.WGRAD: _wgrad,
    WarmOp.DROP_OUTPUTS: _drop_outputs,
    WarmOp.DROP_INFERENCE: _drop_inference,
    WarmOp.DROP_ZERO_GRADS: _drop_zero_grads,
}


def _flag(st: PassState, slot: int, before: Hashable, after: Hashable) -> Hashable:
    if after != before:
        st.rng[slot] = True
    elif st.rng[slot] is None:
        st.rng[slot] = False
    return after


def warm_forward(st: PassState, func: Any, hooks: _te.CaptureTimeHooks, device: torch.device | None) -> None:
    """One warmup forward (capture-time hooks around it), discovering the submodules with
    delayed weight gradients that run in it."""
    spec = st.spec
    hooks.run("forward_pre_hooks", spec.callable_index, func)
    if st.wgrad_candidates is None:  # the module tree is fixed while graphing: look once
        st.wgrad_candidates = _te.wgrad_candidates(func)
    grad_mode = (
        contextlib.nullcontext()
        if torch.is_grad_enabled() == spec.grad_enabled
        else torch.set_grad_enabled(spec.grad_enabled)
    )
    with (
        grad_mode,
        (
            _te.discover_wgrad_modules(func, st.wgrad_modules, st.wgrad_candidates)
            if st.wgrad_candidates
            else contextlib.nullcontext()
        ),
    ):
        before = None if st.warmed else [version_of(t) for t in st.flat_args]
        outputs = st.body(*st.sample_args, **st.sample_kwargs)
    if before is not None:
        st.mutated_inputs = frozenset(
            j for j, (v, w) in enumerate(zip(before, [version_of(t) for t in st.flat_args])) if v != w
        )
        check_outputs(st, outputs, device)
        st.output_meta = tuple((tensor_signature(o), bool(o.requires_grad)) for o in outputs)
        st.warmed = True
    if st.wgrad_modules:
        st.te_grads = True  # its weights get their grads from backward_dw, not the backward
    hooks.run("forward_hooks", spec.callable_index, func)
    st.warm_outputs = outputs


def warm_backward(
    st: PassState, func: Any, hooks: _te.CaptureTimeHooks, allow_unused_input: bool, it: int
) -> tuple[tuple[Tensor | None, ...], tuple[tuple[Tensor, Tensor | None], ...]] | None:
    """One warmup backward of the latest warmup forward, with TransformerEngine's grad rules when
    ``st.te_grads``; returns the incoming grads it made and (tensor, its grad) for each tensor
    differentiated (None when nothing ran)."""
    outputs = st.warm_outputs
    if outputs is None:
        return None
    mask = tuple(o.requires_grad for o in outputs)
    if not any(mask):
        return None
    grads = _zero_grads(st, outputs, mask)
    hooks.run("backward_pre_hooks", st.spec.callable_index, func)
    surface = st.grad_surface
    result = autograd_grad(
        tuple(o for o, m in zip(outputs, mask) if m),
        surface + st.anchors,
        tuple(g for g in grads if g is not None),
        True if st.te_grads else allow_unused_input,
    )[: len(surface)]
    hooks.run("backward_hooks", st.spec.callable_index, func)
    if st.te_grads:
        n_user = sum(1 for t in st.flat_args if t.requires_grad)
        st.params = _te.kept_params(n_user, surface, result, st.params, allow_unused_input, it)
    return grads, tuple(zip(surface, result))


def _zero_grads(st: PassState, outputs: tuple[Tensor, ...], mask: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """Zero incoming grads (zeros, not torch's empty_like: uninitialised memory can hold NaNs a
    hook or anomaly detection would trip on). Those of the pass's previous backward serve again
    while the core's program keeps them (autograd only reads them) and they fit."""
    prev = st.warm_grads
    if (
        prev is not None
        and len(prev) == len(outputs)
        and all(
            (p is None) == (not m) and (p is None or tensor_signature(p) == tensor_signature(o))
            for p, o, m in zip(prev, outputs, mask)
        )
    ):
        return prev
    grads = tuple(torch.zeros_like(o) if m else None for o, m in zip(outputs, mask))
    st.warm_grads = grads
    return grads


def warm_dw(st: PassState, x: Executor, kind: StepKind, entry: str | None) -> None:
    """Runs the pass's delayed weight-gradient work and checks it against the schedule: ``kind``
    is the step (a backward without a paired ``-(c+0.5)`` entry, or such an entry), ``entry``
    names it (None without ``_order``)."""
    mods = list(st.wgrad_modules.values())
    need = any(m.need_backward_dw() for m in mods)
    if entry is not None and kind is StepKind.WGRAD and not need:
        raise _plan.ScheduleError(
            f"gograph: {entry}: a weight-gradient entry for pass {st.index} ({st.spec.label}), but no submodule "
            "that ran in its forward needs a delayed weight gradient (none defines need_backward_dw() and "
            'backward_dw() with need_backward_dw() True). TransformerEngine: "No module needs wgrad computation '
            'but get float in order"'
        )
    if entry is not None and kind is StepKind.BACKWARD and need:
        names = sorted({type(m).__name__ for m in mods if m.need_backward_dw()})
        raise _plan.ScheduleError(
            f"gograph: {entry}: pass {st.index} ({st.spec.label}) needs a delayed weight gradient "
            f"(need_backward_dw() of {', '.join(names)} is True), but no -(c+0.5) entry of its chunk pairs with "
            "this backward; every backward of a chunk that delays its weight gradient needs one "
            '(TransformerEngine: "Number of wgrad graph doesn\'t match number of dgrad graphs")'
        )
    st.need_dw = need
    if not need:
        return
    before = x.engine.rng_marker()
    for m in mods:
        if m.need_backward_dw():
            m.backward_dw()
    if x.engine.rng_marker() != before:
        st.rng[2] = True
    elif st.rng[2] is None:
        st.rng[2] = False


def decide_wgrad_without_warmup(states: Sequence[PassState], callables: Sequence[Any]) -> None:
    """Without warmup nothing ran to discover the delayed weight-gradient submodules: a pass whose
    callable has any that reports ``need_backward_dw()`` gets a weight-gradient graph (its capture
    discovers which ran) and TransformerEngine's grad rules (its weights get their grads from
    ``backward_dw``, not the backward)."""
    for st in states:
        if st.warmed or not st.spec.grad_enabled:
            continue
        if st.wgrad_candidates is None:
            st.wgrad_candidates = _te.wgrad_candidates(callables[st.spec.callable_index])
        if any(m.need_backward_dw() for m in st.wgrad_candidates):
            st.need_dw = st.te_grads = True


@contextlib.contextmanager
def module_buffers_restored(callables: Sequence[Any]) -> Iterator[None]:
    """Module buffers (BatchNorm's running statistics, ...) as they were before the block: for
    forwards that are not part of torch's warmup (the whole-step probe, ``plan_memory``)."""
    saved = [(b, b.detach().clone()) for c in callables if isinstance(c, torch.nn.Module) for b in c.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


class DelayedGradsRestored(Hooks):
    """Build hooks that leave ``.grad`` and ``.main_grad`` of the delayed weight-gradient modules'
    parameters as the build found them. Warmup runs their ``backward_dw()`` (on zero incoming
    grads), which may create a ``.grad`` where there was none or replace it, and a capture may
    too; eagerly nothing ran yet. Each slot is read when the warmup program starts and gets its
    tensor (or None) back when the build ends, failed or not: the graphs keep what they captured
    (:mod:`gograph.runtime._grad_slots`), and the first ``backward_dw()`` finds the caller's state."""

    def __init__(self) -> None:
        self.saved: _grad_slots.Snapshot = []

    @contextlib.contextmanager
    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> Iterator[None]:
        if kind is ProgramKind.WARMUP and not self.saved:
            mods = [m for c in build.req.callables for m in _te.wgrad_candidates(c)]
            self.saved = _grad_slots.snapshot(mods)
        yield

    def finished(self, build: Executor, failed: bool) -> None:
        for p, attr, _, value, _ in self.saved:
            _grad_slots.write_slot(p, attr, value)
        self.saved = []
