"""The capture executor: runs the core's capture program (:func:`gograph._plan.capture_program`).

Every op is the core's decision: capture a pass's forward, backward or weight gradient (in the
order they will replay, so the pool's memory is reused at replay exactly as at capture), drop a
forward's capture-time outputs once its backward is captured, hand a dead pool buffer back to the
pool. Static buffers come from where the program says: the pass's own, a clone of its sample (a
sample sharing memory), a shared slot, or the chained neighbour's buffer (resolved here, when it
exists).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import _plan, _reuse, _te
from ._bodies import BackwardBody
from ._shared_inputs import version_of
from ._state import PassState
from ._warmup import check_outputs
from .engines import BACKWARD, FORWARD, WGRAD

__all__ = ["apply_separated", "apply_slots", "run_captures"]

log = logging.getLogger("gograph")


def apply_separated(states: Sequence[PassState], program: _plan.CaptureProgram) -> None:
    """Input leaves the core separated (their sample shares memory with another input leaf or a
    parameter, :mod:`gograph._regions`) get a clone of their own, with the sample's requires_grad,
    as their static input: a copy-in for one graph then never changes what another reads, nor
    the parameter."""
    per_pass: dict[int, dict[int, Tensor]] = {}
    nbytes = 0
    for (p, j), src in program.inputs.items():
        if src.kind == _plan.FRESH:
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


def apply_slots(states: Sequence[PassState], program: _plan.CaptureProgram) -> dict[int, Tensor]:
    """Gives every pass its slot tensors (``_reuse_graph_input_output_buffers``) for inputs now;
    returns the slots (grad-output slots are taken when the backward is captured). A pass sharing
    a slot gets the slot's tensor, or a view with its own requires_grad."""
    backing = _reuse.slot_tensors(states, program)
    per_pass: dict[int, dict[int, Tensor]] = {}
    for (p, j), src in program.inputs.items():
        if src.kind != _plan.SLOT:
            continue
        t, b = states[p].flat_args[j], backing[src.slot]
        if b is not t:
            per_pass.setdefault(p, {})[j] = (
                b if b.requires_grad == t.requires_grad else b.detach().requires_grad_(t.requires_grad)
            )
    for p, repl in per_pass.items():
        states[p].replace_args(repl)
    return backing


def run_captures(build: Any, program: _plan.CaptureProgram, slots: dict[int, Tensor], recorder: Any = None) -> None:
    """Runs the program's ops (``build`` is the :class:`gograph._build.Build`). ``recorder``
    (debug mode, :class:`gograph._recarve.CaptureRecorder`) sees every op begin, and the end."""
    states = build.states
    for i, op in enumerate(program.ops):
        st: PassState = states[op.pass_index]
        build.current = st
        kind = op.kind
        if recorder is not None:
            recorder.op(i)
        if kind == _plan.CAPTURE_FORWARD:
            build.phase = "forward capture"
            with recorder.saving(st) if recorder is not None else contextlib.nullcontext():
                capture_forward(build, st, program)
        elif kind == _plan.CAPTURE_BACKWARD:
            build.phase = "backward capture"
            capture_backward(build, st, program, slots)
        elif kind == _plan.CAPTURE_WGRAD:
            build.phase = "weight-gradient capture"
            capture_wgrad(build, st)
        elif kind == _plan.DROP_CAPTURE:
            st.capture_outputs = None
        else:
            _reuse.release(op, states)
    if recorder is not None:
        recorder.op(len(program.ops))


def _chained_inputs(build: Any, st: PassState, program: _plan.CaptureProgram) -> None:
    """Chained input leaves become the producer's static output (read in place by the graph)."""
    repl = {}
    for j in range(len(st.flat_args)):
        src = program.inputs.get((st.index, j))
        if src is not None and src.kind == _plan.CHAINED:
            out = build.states[src.pass_index].static_outputs[src.index]
            repl[j] = out.detach().requires_grad_(st.flat_args[j].requires_grad)
            st.chained_inputs.add(j)
    st.replace_args(repl)


def capture_forward(build: Any, st: PassState, program: _plan.CaptureProgram) -> None:
    _chained_inputs(build, st, program)
    spec, func = st.spec, build.req.callables[st.spec.callable_index]
    build.req.hooks.run("forward_pre_hooks", spec.callable_index, func)
    discover = build.req.num_warmup_iters == 0 and not build.req.ordered  # no warmup found the wgrad modules
    before = None if st.warmed else [version_of(t) for t in st.flat_args]  # what no warmup told
    with (
        torch.set_grad_enabled(spec.grad_enabled),
        _te.discover_wgrad_modules(func, st.wgrad_modules) if discover else contextlib.nullcontext(),
    ):
        outputs, st.seq[0] = build.engine.capture(
            st.pass_id,
            FORWARD,
            st.capture_body,
            *st.body_args,
            pool=build.pool,
            uses_rng=st.rng[0],
            mode=build.req.capture_mode,
        )
    check_outputs(st, outputs, build.device)
    if before is not None:  # which leaves its forward writes in place (version counters move in a capture too)
        st.mutated_inputs = frozenset(j for j, (t, v) in enumerate(zip(st.flat_args, before)) if version_of(t) != v)
        st.inputs_seen = True
    st.output_spec = st.body.out_spec
    build.req.hooks.run("forward_hooks", spec.callable_index, func)
    # Keep detached aliases: the static storage, without the capture's autograd graph.
    st.output_requires_grad = tuple(bool(o.requires_grad) for o in outputs)
    st.static_outputs = tuple(o.detach() for o in outputs)
    st.capture_outputs = tuple(outputs) if any(st.output_requires_grad) else None


def _grad_output_buffer(
    build: Any, st: PassState, k: int, o: Tensor, program: _plan.CaptureProgram, slots: dict[int, Tensor]
) -> Tensor:
    """Where output ``k``'s incoming grad is copied before a backward replay: the consumer's input
    grad (chained), a shared slot, or a new buffer -- uninitialised on the CUDA engine, as in torch
    and TransformerEngine (every replay copies the incoming grad in first, and a capture computes
    no values), zeros on the eager engine, whose capture does run the backward."""
    src = program.grad_outputs.get((st.index, k))
    if src is not None and src.kind == _plan.CHAINED:
        buf = build.states[src.pass_index].static_grad_inputs[src.index]
        if isinstance(buf, torch.Tensor) and _reuse.tensor_signature(buf) == _reuse.tensor_signature(o):
            st.chained_grad_outputs.add(k)
            return buf
    if src is not None and src.kind == _plan.SLOT:
        slot = _reuse.grad_output_slot(slots, src.slot, st, k)
        if _reuse.tensor_signature(slot) == _reuse.tensor_signature(o):
            return slot.detach() if slot.requires_grad else slot
    return torch.empty_like(o) if build.device is not None else torch.zeros_like(o)


def capture_backward(build: Any, st: PassState, program: _plan.CaptureProgram, slots: dict[int, Tensor]) -> None:
    outputs = st.capture_outputs if st.capture_outputs is not None else st.static_outputs
    mask = tuple(bool(o.requires_grad) for o in outputs)
    st.static_grad_outputs = tuple(
        _grad_output_buffer(build, st, k, o, program, slots) if rg else None
        for k, (o, rg) in enumerate(zip(outputs, mask))
    )
    grad_inputs: tuple[Tensor | None, ...] | None = None
    func = build.req.callables[st.spec.callable_index]
    if any(mask):
        build.req.hooks.run("backward_pre_hooks", st.spec.callable_index, func)
        body = BackwardBody(
            st.grad_surface,
            tuple(g for g in st.static_grad_outputs if g is not None),
            mask,
            build.req.allow_unused_input or st.te_grads,
            build.req.retain_graph,
            st.anchors,
        )
        with torch.set_grad_enabled(st.spec.grad_enabled):
            grad_inputs, st.seq[1] = build.engine.capture(
                st.pass_id, BACKWARD, body, outputs, pool=build.pool, uses_rng=st.rng[1], mode=build.req.capture_mode
            )
        st.has_backward = True
        build.req.hooks.run("backward_hooks", st.spec.callable_index, func)
    # The grads of the inputs that require grad, padded with None for the others (the layout
    # autograd.Function.backward returns).
    it = iter(grad_inputs or ())
    st.static_grad_inputs = tuple(next(it) if t.requires_grad and grad_inputs is not None else None for t in st.surface)


def capture_wgrad(build: Any, st: PassState) -> None:
    """The delayed weight-gradient graph (kind 2): what ``backward_dw()`` of the pass's discovered
    submodules does. Nothing is captured when none needs one (unknown before capture without
    warmup)."""
    mods = list(st.wgrad_modules.values())
    if not st.has_backward or not (st.need_dw or _te.modules_needing_dw(mods)):
        return  # no backward ran (its outputs need no grad, known at capture without warmup): nothing to do
    body = _te.WgradBody(mods, st.spec.label)
    _, st.seq[2] = build.engine.capture(
        st.pass_id, WGRAD, body, pool=build.pool, uses_rng=st.rng[2], mode=build.req.capture_mode
    )
    st.wgrad_body = body
