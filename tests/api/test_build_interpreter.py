"""The build as one interpreter of the core's programs: every op kind has a handler and a phase,
hooks see the programs in order, a build run until planned captures nothing, and the core's
lifetime decisions (zero grads, the warmup pool reference, lent grads) are what the executor
carries out. Eager engine: runs everywhere."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

import gograph
from gograph.build import _captures, _warmup
from gograph.build._build import PHASE_OF, Build, prepared
from gograph.build._exec import Executor, Hooks, Phase, ProgramKind
from gograph.core._kinds import CaptureOp, WarmOp
from gograph.core._wire import CaptureProgram, Op, ProtocolError, WarmupProgram
from gograph.request import _args

from helpers import make_mlp


def test_every_op_kind_has_a_handler_and_a_phase() -> None:
    assert set(_warmup.HANDLERS) == set(WarmOp)
    assert set(_captures.HANDLERS) == set(CaptureOp)
    assert set(PHASE_OF) == set(WarmOp) | set(CaptureOp)


class Recorder(Hooks):
    """Records every event a build's hooks see, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.programs: dict[ProgramKind, tuple[Op, ...]] = {}

    @contextlib.contextmanager
    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> Iterator[None]:
        self.programs[kind] = tuple(ops)
        self.events.append(("begin", kind))
        try:
            yield
        finally:
            self.events.append(("end", kind))

    def op(self, i: int) -> None:
        self.events.append(("op", i))

    def forward(self, i: int, st: Any) -> None:
        self.events.append(("forward", i, st.index))

    def backward(self, i: int, st: Any, incoming: Sequence[Any], grads: Sequence[tuple[Any, Any]]) -> None:
        self.events.append(("backward", i, st.index, tuple(id(g) for g in incoming if g is not None)))

    @contextlib.contextmanager
    def capturing_forward(self, st: Any) -> Iterator[None]:
        self.events.append(("capturing", st.index))
        yield

    def planned(self, build: Executor, program: CaptureProgram) -> None:
        self.events.append(("planned", len(program.ops)))

    def finished(self, build: Executor, failed: bool) -> None:
        self.events.append(("finished", failed))


def _request(n: int = 2, warmup: int = 2, **options: Any) -> _args.Request:
    layers = tuple(make_mlp(seed=i, d_in=8, d_out=8) for i in range(n))
    samples = tuple((torch.randn(4, 8, requires_grad=i > 0),) for i in range(n))
    return _args.normalize(layers, samples, warmup, False, None, {"engine": "eager", **options})


def _run(req: _args.Request, until: Phase = Phase.SEALED) -> tuple[Recorder, Build, list[gograph.GraphedCallable]]:
    rec = Recorder()
    with prepared(req) as build:
        build.run(until=until, hooks=[rec])
        graphed = build.graphed() if until is Phase.SEALED else []
        if until is Phase.PLANNED:
            build.rollback()
    return rec, build, graphed


def test_hooks_see_both_programs_op_by_op_then_the_end() -> None:
    rec, _, graphed = _run(_request())
    warm, cap = rec.programs[ProgramKind.WARMUP], rec.programs[ProgramKind.CAPTURE]
    ev = rec.events
    assert ev[0] == ("begin", ProgramKind.WARMUP)
    assert (
        ev.index(("end", ProgramKind.WARMUP))
        < ev.index(("planned", len(cap)))
        < ev.index(("begin", ProgramKind.CAPTURE))
    )
    assert ev[-1] == ("finished", False)
    assert [e[1] for e in ev if e[0] == "op"] == [*range(len(warm) + 1), *range(len(cap) + 1)]
    forwards = [e for e in ev if e[0] == "forward"]
    assert [(i, p) for _, i, p in forwards] == [
        (i, op.pass_index) for i, op in enumerate(warm) if op.kind is WarmOp.FORWARD
    ]
    assert [e[1] for e in ev if e[0] == "capturing"] == [op.pass_index for op in cap if op.kind is CaptureOp.FORWARD]
    assert cap[-1] == Op(CaptureOp.RETURN_WARMUP_POOL, -1)  # the core's last op
    for g in graphed:
        g.reset()


def test_zero_grads_serve_a_pass_while_the_core_keeps_them() -> None:
    """torch's loop runs one pass's iterations back to back: the core keeps its zero grads for
    them (one tensor per pass); capture-time hooks could write them: the core drops them after
    every backward (a new one per iteration)."""
    rec, _, graphed = _run(_request(warmup=3))
    incoming = [e[3] for e in rec.events if e[0] == "backward"]
    assert len(incoming) == 6 and len({ids for ids in incoming[:3]}) == 1 and len(set(incoming[3:])) == 1
    assert [op.kind for op in rec.programs[ProgramKind.WARMUP]].count(WarmOp.DROP_ZERO_GRADS) == 2
    for g in graphed:
        g.reset()
    hooks = [{"forward_hooks": {0: lambda m: None}}] * 2
    rec, _, graphed = _run(_request(warmup=3, capture_time_hooks=hooks))
    assert [op.kind for op in rec.programs[ProgramKind.WARMUP]].count(WarmOp.DROP_ZERO_GRADS) == 6
    for g in graphed:
        g.reset()


def test_a_build_run_until_planned_captures_nothing_and_rolls_back() -> None:
    passes, plans = gograph.live_passes(), gograph.live_plans()
    rec, build, _ = _run(_request(), until=Phase.PLANNED)
    assert ProgramKind.CAPTURE not in rec.programs
    assert rec.events[-1] == ("finished", True)  # rolled back
    assert build.program is not None and build.program.ops[-1].kind is CaptureOp.RETURN_WARMUP_POOL
    assert all(st.seq == [0, 0, 0] for st in build.states)
    assert gograph.live_passes() == passes and gograph.live_plans() == plans
    build.rollback()  # twice is harmless


class Boom(Hooks):
    def __init__(self, at: ProgramKind) -> None:
        self.at = at

    def op(self, i: int) -> None:
        raise RuntimeError("hook failed")

    @contextlib.contextmanager
    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> Iterator[None]:
        self.kind = kind
        yield


@pytest.mark.parametrize("kind", list(ProgramKind))
def test_a_hook_that_raises_rolls_the_build_back(kind: ProgramKind) -> None:
    passes = gograph.live_passes()

    class Once(Boom):
        def op(self, i: int) -> None:
            if self.kind is kind:
                raise RuntimeError(f"hook failed in {kind.value}")

    with prepared(_request()) as build, pytest.raises(RuntimeError, match=f"hook failed in {kind.value}"):
        build.run(hooks=[Once(kind)])
    assert gograph.live_passes() == passes


def test_lent_grads_follow_the_core_s_lines() -> None:
    """Default schedule: every graph may overwrite what the backwards lend from the first lending
    backward at or after it (the core's lent lines, as sequence numbers)."""
    _, build, graphed = _run(_request(n=3))
    program = build.program
    assert program is not None
    for (kind, p), j in program.lent_from.items():
        graph = kind.graph
        assert graph is not None
        want = build.states[program.ops[j].pass_index].seq[1] if j < len(program.ops) else None
        got = build.states[p].lent_from[graph]
        assert got == want if want is not None else got > max(q for st in build.states for q in st.seq)
    b0 = build.states[0].seq[1]  # the last backward captured lends: every graph overwrites from it on, or earlier
    assert all(st.lent_from[0] <= b0 for st in build.states)
    for g in graphed:
        g.reset()


@pytest.mark.parametrize(
    "decode, text",
    [
        (WarmupProgram.decode, "pool 0\nop f 0\n"),  # a core before versioned texts
        (WarmupProgram.decode, "warmup v2 pool=0\n"),
        (CaptureProgram.decode, "op F 0\n"),
        (CaptureProgram.decode, "warmup v1\n"),
    ],
)
def test_a_text_of_another_protocol_or_version_is_refused(decode: Any, text: str) -> None:
    with pytest.raises(ProtocolError, match="built from different sources"):
        decode(text)
