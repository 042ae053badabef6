"""The capture program's ops (:func:`gograph.core._plan.capture_program`): one handler per op kind.

:class:`gograph.build._build.Build` runs the program and calls ``HANDLERS[op.kind](build, i, op)``.
Every op is the core's decision: capture a pass's forward, backward or weight gradient (in the
order they will replay, so the pool's memory is reused at replay exactly as at capture), drop a
forward's capture-time outputs once its backward is captured, hand a dead pool buffer back to the
pool, return the pool reference warmup took. Static buffers come from where the program says: the
pass's own, a clone of its sample (a sample sharing memory), a shared slot, or the chained
neighbour's buffer (resolved here, when it exists).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import cast

import torch
from torch import Tensor

from ..core._kinds import BufferSource, CaptureOp, GraphKind, ReleaseRole
from ..core._wire import CaptureProgram, Op
from ..replay._shared_inputs import version_of
from ..request import _te
from ..runtime._bodies import BackwardBody
from ..runtime._isolation import IsolatingBody
from . import _reuse
from ._exec import Executor
from ._state import PassState
from ._warmup import check_outputs

__all__ = ["HANDLERS", "apply_separated", "apply_slots", "lent_thresholds"]

log = logging.getLogger("gograph")


def apply_separated(states: Sequence[PassState], program: CaptureProgram) -> None:
    """Input leaves the core separated (their sample shares memory with another input leaf or a
    parameter, :mod:`gograph.replay._regions`) get a clone of their own, with the sample's requires_grad,
    as their static input: a copy-in for one graph then never changes what another reads, nor
    the parameter."""
    per_pass: dict[int, dict[int, Tensor]] = {}
    nbytes = 0
    for (p, j), src in program.inputs.items():
        if src.kind is BufferSource.FRESH:
            t = states[p].flat_args[j]
            per_pass.setdefault(p, {})[j] = t.detach().clone().requires_grad_(t.requires_grad)
            nbytes += t.numel() * t.element_size()
    for p, repl in per_pass.items():
        states[p].replace_args(repl)
        states[p].separated_inputs.update(repl)
    if per_pass:
        log.info(
            "%d sample arg(s) of %d pass(es) share memory with another pass's that is still live "
            "(or with a parameter): each got a clone of its own (%.1f MiB), so no copy-in changes what another "
            "graph reads; memory_report lists them as separated_inputs",
            sum(len(r) for r in per_pass.values()),
            len(per_pass),
            nbytes / 2**20,
        )


def apply_slots(states: Sequence[PassState], program: CaptureProgram) -> dict[int, Tensor]:
    """Gives every pass its slot tensors (``_reuse_graph_input_output_buffers``) for inputs now;
    returns the slots (grad-output slots are taken when the backward is captured). A pass sharing
    a slot gets the slot's tensor, or a view with its own requires_grad."""
    backing = _reuse.slot_tensors(states, program)
    per_pass: dict[int, dict[int, Tensor]] = {}
    for (p, j), src in program.inputs.items():
        if src.kind is not BufferSource.SLOT:
            continue
        t, b = states[p].flat_args[j], backing[src.slot]
        if b is not t:
            per_pass.setdefault(p, {})[j] = (
                b if b.requires_grad == t.requires_grad else b.detach().requires_grad_(t.requires_grad)
            )
    for p, repl in per_pass.items():
        states[p].replace_args(repl)
    return backing


def _forward(x: Executor, i: int, op: Op) -> None:
    st = x.states[op.pass_index]
    with x.hooks.capturing_forward(st) if x.hooks.per_capture else contextlib.nullcontext():
        capture_forward(x, st)


def _backward(x: Executor, i: int, op: Op) -> None:
    capture_backward(x, x.states[op.pass_index])


def _wgrad(x: Executor, i: int, op: Op) -> None:
    capture_wgrad(x, x.states[op.pass_index])


def _drop(x: Executor, i: int, op: Op) -> None:
    x.states[op.pass_index].capture_outputs = None


def _release(x: Executor, i: int, op: Op) -> None:
    engine = x.engine
    for t in _reuse.release(op, x.states, keep_owners=not engine.pool_keeps_released_memory):
        engine.buffer_released(t)


def _return_warm_pool(x: Executor, i: int, op: Op) -> None:
    x.return_warm_pool()


#: The handler of each capture op.
HANDLERS: dict[CaptureOp, Callable[[Executor, int, Op], None]] = {
    CaptureOp.FORWARD: _forward,
    CaptureOp.BACKWARD: _backward,
    CaptureOp.WGRAD: _wgrad,
    CaptureOp.DROP: _drop,
    CaptureOp.RELEASE: _release,
    CaptureOp.RETURN_WARMUP_POOL: _return_warm_pool,
}


def lent_thresholds(states: Sequence[PassState], program: CaptureProgram) -> None:
    """Every pass's graphs learn, as capture sequence numbers, from which lending backward on
    their replays may overwrite lent parameter grads (the core's ``lent`` lines name the op; a
    later build's backwards are captured after every sequence number of this one)."""
    after = max((q for st in states for q in st.seq), default=0) + 1
    for (kind, p), j in program.lent_from.items():
        graph = kind.graph
        if graph is None:
            continue
        if j < len(program.ops):
            states[p].lent_from[graph] = states[program.ops[j].pass_index].seq[GraphKind.BACKWARD]
        else:
            states[p].lent_from[graph] = after


def _chained_inputs(x: Executor, st: PassState, program: CaptureProgram) -> None:
    """Chained input leaves become the producer's static output (read in place by the graph)."""
    repl = {}
    for j in range(len(st.flat_args)):
        src = program.inputs.get((st.index, j))
        if src is not None and src.kind is BufferSource.CHAINED:
            out = x.states[src.pass_index].static_outputs[src.index]
            repl[j] = out.detach().requires_grad_(st.flat_args[j].requires_grad)
            st.chained_inputs.add(j)
    st.replace_args(repl)


def capture_forward(x: Executor, st: PassState) -> None:
    program, req = x.program, x.req
    assert program is not None  # the captures run once it is planned
    _chained_inputs(x, st, program)
    spec, func = st.spec, req.callables[st.spec.callable_index]
    req.hooks.run("forward_pre_hooks", spec.callable_index, func)
    discover = req.num_warmup_iters == 0 and not req.ordered  # no warmup found the wgrad modules
    before = None if st.warmed else [version_of(t) for t in st.flat_args]  # what no warmup told
    pool = x.pool_of(st)
    body = st.capture_body
    released = _released_outputs(program, st.index)
    every_output_released = st.warmed and len(st.output_meta) <= len(released)
    if x.engine.isolates_outputs and not every_output_released:  # outputs out of memory others write
        body = IsolatingBody(body, x.engine, pool, released)
    with (
        torch.set_grad_enabled(spec.grad_enabled),
        _te.discover_wgrad_modules(func, st.wgrad_modules) if discover else contextlib.nullcontext(),
    ):
        results, st.seq[0] = x.engine.capture(
            st.pass_id,
            int(GraphKind.FORWARD),
            body,
            *st.body_args,
            pool=pool,
            uses_rng=st.rng[0],
            mode=req.capture_mode,
        )
    own = body.isolated if isinstance(body, IsolatingBody) else ()
    n = len(results) - len(own or ())
    outputs = cast("tuple[Tensor, ...]", results[:n])  # a forward body returns tensors only (ForwardBody)
    static = dict(zip(own or (), cast("tuple[Tensor, ...]", results[n:])))
    check_outputs(st, outputs, x.device)
    if before is not None:  # which leaves its forward writes in place (version counters move in a capture too)
        st.mutated_inputs = frozenset(j for j, (t, v) in enumerate(zip(st.flat_args, before)) if version_of(t) != v)
        st.inputs_seen = True
    st.output_spec = st.body.out_spec
    req.hooks.run("forward_hooks", spec.callable_index, func)
    # Keep detached aliases: the static storage, without the capture's autograd graph.
    st.output_requires_grad = tuple(bool(o.requires_grad) for o in outputs)
    st.static_outputs = tuple(static.get(k, o).detach() for k, o in enumerate(outputs))
    st.capture_outputs = tuple(outputs) if any(st.output_requires_grad) else None


def _released_outputs(program: CaptureProgram, index: int) -> frozenset[int]:
    """The outputs of pass ``index`` the program hands back to the pool (valid until the schedule
    reuses them): no buffer of their own."""
    return frozenset(
        op.buffer
        for op in program.ops
        if op.kind is CaptureOp.RELEASE and op.pass_index == index and op.role is ReleaseRole.OUTPUT
    )


def _grad_output_buffer(x: Executor, st: PassState, k: int, o: Tensor, program: CaptureProgram) -> Tensor:
    """Where output ``k``'s incoming grad is copied before a backward replay: the consumer's input
    grad (chained), a shared slot, or a new buffer -- uninitialised on the CUDA engine, as in torch
    and TransformerEngine (every replay copies the incoming grad in first, and a capture computes
    no values), zeros on the eager engine, whose capture does run the backward: a chained buffer or
    a slot holds what its earlier holder's capture left (another pass's input, say), which a
    delayed weight gradient captured next would add into ``main_grad`` where a CUDA capture adds
    nothing. Zero incoming grads add zero, as warmup's do."""
    src = program.grad_outputs.get((st.index, k))
    buf: Tensor | None = None
    if src is not None and src.kind is BufferSource.CHAINED:
        chained = x.states[src.pass_index].static_grad_inputs[src.index]
        if isinstance(chained, torch.Tensor) and _reuse.tensor_signature(chained) == _reuse.tensor_signature(o):
            st.chained_grad_outputs.add(k)
            buf = chained
    if buf is None and src is not None and src.kind is BufferSource.SLOT:
        slot = _reuse.grad_output_slot(x.slots, src.slot, st, k)
        if _reuse.tensor_signature(slot) == _reuse.tensor_signature(o):
            buf = slot.detach() if slot.requires_grad else slot
    if buf is None:
        return torch.empty_like(o) if x.device is not None else torch.zeros_like(o)
    if x.device is None:  # the eager engine: its earlier holder is dead (the core's plan)
        buf.data.zero_()  # .data: no version bump, as a graph's kernel writes
    return buf


def capture_backward(x: Executor, st: PassState) -> None:
    program, req = x.program, x.req
    assert program is not None  # the captures run once it is planned
    outputs = st.capture_outputs if st.capture_outputs is not None else st.static_outputs
    mask = tuple(bool(o.requires_grad) for o in outputs)
    st.static_grad_outputs = tuple(
        _grad_output_buffer(x, st, k, o, program) if rg else None for k, (o, rg) in enumerate(zip(outputs, mask))
    )
    grad_inputs: tuple[Tensor | None, ...] | None = None
    func = req.callables[st.spec.callable_index]
    if any(mask):
        req.hooks.run("backward_pre_hooks", st.spec.callable_index, func)
        body = BackwardBody(
            st.grad_surface,
            tuple(g for g in st.static_grad_outputs if g is not None),
            mask,
            req.allow_unused_input or st.te_grads,
            req.retain_graph,
            st.anchors,
        )
        with torch.set_grad_enabled(st.spec.grad_enabled):
            grad_inputs, st.seq[1] = x.engine.capture(
                st.pass_id,
                int(GraphKind.BACKWARD),
                body,
                outputs,
                pool=x.pool_of(st),
                uses_rng=st.rng[1],
                mode=req.capture_mode,
            )
        st.has_backward = True
        req.hooks.run("backward_hooks", st.spec.callable_index, func)
    # The grads of the inputs that require grad, padded with None for the others (the layout
    # autograd.Function.backward returns).
    it = iter(grad_inputs or ())
    st.static_grad_inputs = tuple(next(it) if t.requires_grad and grad_inputs is not None else None for t in st.surface)


def capture_wgrad(x: Executor, st: PassState) -> None:
    """The delayed weight-gradient graph (kind 2): what ``backward_dw()`` of the pass's discovered
    submodules does. Nothing is captured when none needs one (unknown before capture without
    warmup)."""
    mods = list(st.wgrad_modules.values())
    if not st.has_backward or not (st.need_dw or _te.modules_needing_dw(mods)):
        return  # no backward ran (its outputs need no grad, known at capture without warmup): nothing to do
    body = _te.WgradBody(mods, st.spec.label, fill_empty=st.warm_backwards == 0)  # no warmup ran it
    pool = x.pool_of(st)
    with _wgrad_memory(x, pool):
        _, st.seq[2] = x.engine.capture(
            st.pass_id, int(GraphKind.WGRAD), body, pool=pool, uses_rng=st.rng[2], mode=x.req.capture_mode
        )
    st.wgrad_body = body


@contextlib.contextmanager
def _wgrad_memory(x: Executor, pool: Hashable) -> Iterator[None]:
    """The default schedule's weight-gradient graph replays whenever the caller runs
    ``backward_dw()`` -- right after its backward, or after every backward of the step -- so it
    must write no block another graph's data lives in, and nothing captured after it may carve a
    block it writes or reads (what its backward stashed, freed as it consumes it). While it is
    captured, every free block of the pool but the weight-gradient graphs' own is held; after it,
    what is free then (its temporaries, what it consumed) is held from the later captures until
    the captures end. An ``_order`` places its weight gradients in the schedule: nothing to do."""
    engine = x.engine
    if x.schedule.ordered or not engine.isolates_outputs:
        yield
        return
    others = engine.hold_free_blocks(pool, capturing=False)
    reserve, x.wgrad_reserve = x.wgrad_reserve, None
    engine.release_hold(reserve)  # the earlier weight-gradient graphs' memory, for this one
    try:
        yield
    finally:
        x.wgrad_reserve = engine.hold_free_blocks(pool, capturing=False)
        engine.release_hold(others)
