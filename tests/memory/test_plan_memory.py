"""gograph.plan_memory on the eager engine: its static bytes are what memory_report shows after
the real call (default, chain_buffers, an _order pipeline with reuse), it leaves no trace, it
refuses what make_graphed_callables refuses, and the trace it would send on CUDA is replayed by
the core as the allocator would (a synthetic allocator history). CUDA accuracy is in
test_plan_memory_cuda.py and bench/plan_accuracy.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import gograph
from gograph.core import _core, _plan
from gograph.core._kinds import WarmOp
from gograph.core._wire import Facts, Op, Prediction, Trace
from gograph.probes._probe import trace_text

FEATURES = 8
MiB = 2**20


class Layer(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(FEATURES, 2 * FEATURES)
        self.norm = torch.nn.BatchNorm1d(2 * FEATURES)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(2 * FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


def _samples(n: int, first_requires_grad: bool = False) -> tuple[tuple[torch.Tensor], ...]:
    return tuple((torch.randn(4, FEATURES, requires_grad=i > 0 or first_requires_grad),) for i in range(n))


PIPELINE = {"_order": [1, 2, -2, -1], "_num_layers_per_chunk": 2, "_reuse_graph_input_output_buffers": True}

CASES = {
    "default": (3, {}, False),
    "chain": (3, {"chain_buffers": True}, False),
    "pipeline": (4, {**PIPELINE, "chain_buffers": True}, True),
}


def _fields(p: Any) -> tuple[Any, ...]:
    return (p.index, p.static_input_bytes, p.output_bytes, p.grad_output_bytes, p.grad_input_bytes,
            p.param_grad_bytes, p.pool_planned_bytes, sorted(p.chained_slots), p.lent_param_grads)  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_bytes_are_what_memory_report_shows(case: str) -> None:
    n, kwargs, ordered = CASES[case]
    layers = [Layer(i) for i in range(n)]
    samples = _samples(n, first_requires_grad=ordered)
    plan = gograph.plan_memory(tuple(layers), samples, **kwargs)
    graphed = gograph.make_graphed_callables(tuple(layers), samples, **kwargs)
    report = gograph.memory_report(graphed)
    assert [_fields(p) for p in plan.passes] == [_fields(p) for p in report.passes]
    assert plan.totals.static_bytes == report.totals.static_bytes
    assert plan.totals.pool_planned_bytes == report.totals.pool_planned_bytes
    if case != "default":
        assert any(p.chained_slots for p in plan.passes)
    for g in graphed:
        g.reset()


def test_leaves_no_trace() -> None:
    layers = [Layer(i) for i in range(3)]
    samples = _samples(3)
    before_buffers = [[b.clone() for b in m.buffers()] for m in layers]
    rng = torch.get_rng_state()
    passes, plans = gograph.live_passes(), gograph.live_plans()
    plan = gograph.plan_memory(tuple(layers), samples, chain_buffers=True)
    assert torch.equal(rng, torch.get_rng_state()), "dropout's warmup draws must not move the generator"
    assert all(torch.equal(a, b) for m, bs in zip(layers, before_buffers) for a, b in zip(m.buffers(), bs))
    assert all(p.grad is None for m in layers for p in m.parameters())
    assert (gograph.live_passes(), gograph.live_plans()) == (passes, plans)
    assert all(m.forward.__func__ is Layer.forward for m in layers)  # type: ignore[attr-defined]
    assert plan.totals.pool_reserved_bytes is None and plan.engine == "eager"


def test_table_and_serialization() -> None:
    plan = gograph.plan_memory(tuple(Layer(i) for i in range(2)), _samples(2), chain_buffers=True)
    text = str(plan)
    assert text.startswith("gograph memory plan: 2 pass(es), engine eager (nothing captured)")
    assert "input[0]" in text and "pool: not predicted (eager engine: no device pool)" in text
    d = json.loads(plan.to_json())
    assert d["totals"]["static_bytes"] == plan.totals.static_bytes
    assert d["passes"][1]["static_bytes"] == plan.passes[1].static_bytes


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((Layer(0),), {}, TypeError, "sample_args"),
        ((Layer(0), (torch.randn(4, FEATURES),)), {"chain_bufers": True}, TypeError, "unexpected keyword argument"),
        ((Layer(0), (torch.randn(4, FEATURES),)), {"fp8_enabled": True}, NotImplementedError, "fp8_enabled"),
        (((Layer(0), Layer(1)), ((torch.randn(4, FEATURES),),)), {}, ValueError, "one tuple of args per callable"),
    ],
)
def test_refuses_what_make_graphed_callables_refuses(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        gograph.make_graphed_callables(*args, **kwargs)
    passes = gograph.live_passes()
    with pytest.raises(error, match=match):
        gograph.plan_memory(*args, **kwargs)
    assert gograph.live_passes() == passes


def test_a_failing_warmup_leaves_nothing() -> None:
    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("boom")

    layers, samples = (Layer(0), Boom()), _samples(2)
    passes, plans, rng = gograph.live_passes(), gograph.live_plans(), torch.get_rng_state()
    with pytest.raises(KeyError, match="boom"):
        gograph.plan_memory(layers, samples)
    assert (gograph.live_passes(), gograph.live_plans()) == (passes, plans)
    assert torch.equal(rng, torch.get_rng_state())


# --------------------------------------------------------------------------------------------
# The CUDA path without a GPU: an allocator history, as torch.cuda.memory records it, written
# as the core's trace and replayed in the capture program's order.
# --------------------------------------------------------------------------------------------
def _history(events: Sequence[tuple[str, int, int]]) -> list[dict[str, Any]]:
    return [{"action": a, "addr": addr, "size": size} for a, addr, size in events]


def test_trace_text_tags_ops_and_names_blocks() -> None:
    ops = (Op(WarmOp.FORWARD, 0), Op(WarmOp.BACKWARD, 0), Op(WarmOp.DROP_OUTPUTS, 0))
    entries = _history([
        ("alloc", 0x1000, 64 * MiB),  # before the first op: not the pass's
        ("alloc", 0x2000, 64 * MiB), ("alloc", 0x3000, 64 * MiB),  # forward: saved, output
        ("alloc", 0x7000, 32 * MiB),  # forward: a cache made on first use, never freed
        ("alloc", 0x9000, 64 * MiB),  # backward: the incoming grad warmup made (between ops)
        ("free_completed", 0x2000, 64 * MiB), ("alloc", 0x2000, 64 * MiB),  # saved dies, grad reuses it
        ("free_completed", 0x3000, 64 * MiB), ("free_completed", 0x2000, 64 * MiB),  # x: outputs, grads die
    ])  # fmt: skip
    marks = [1, 4, 7, 9]
    trace = trace_text(ops, entries, marks, {1: {0x9000}}, [(0, 0, 0, 0x3000)], [(1, 0, 0, 0x2000)])
    assert trace.text().splitlines()[0] == "trace v1"
    assert list(trace.lines) == [
        "step 0 f 0", "step 1 b 0", "step 2 x 0",
        "a 1 67108864 -1", "a 2 67108864 0", "a 3 67108864 0", "a 4 33554432 -1", "out 0 0 3",
        "a 5 67108864 -1", "r 2 1", "a 6 67108864 1", "grad 0 0 6",
        "r 3 2", "r 6 2",
    ]  # fmt: skip


def test_core_replays_the_trace_in_capture_order() -> None:
    """Two layers warmed up per callable (f0 b0 x0 f1 b1 x1), captured F0 F1 B1 B0: the pool
    holds both forwards' saved tensors and outputs at once, which warmup never did."""
    sched = _plan.plan_schedule(None, None, 2, 2, True, 1)
    try:
        facts = Facts(
            ("pass 0 1 0 1 -1 -1", "in 0 0 0 1 1", "out 0 0 1", "pass 1 1 0 1 -1 -1", "in 1 0 1 1 1", "out 1 0 1")
        )
        trace = Trace((
            "step 0 f 0", "step 1 b 0", "step 2 x 0", "step 3 f 1", "step 4 b 1", "step 5 x 1",
            "a 1 67108864 0", "a 2 67108864 0", "r 1 1", "r 2 -1",
            "a 3 67108864 3", "a 4 67108864 3", "r 3 4", "a 5 67108864 4", "r 4 -1", "r 5 -1",
            "out 0 0 2", "out 1 0 4", "grad 1 0 5",
        ))  # fmt: skip
        _plan.capture_program(sched, facts, False, True, True)  # kept with the plan, where the prediction reads it
        got = str(_core.plan_memory(sched.handle, trace.text()))
        pred = Prediction.decode(got)
    finally:
        sched.free()
    lines = got.splitlines()[1:]
    assert lines[0] == "seed 0"  # every block is 64 MiB: the captures' segments are what they hold
    assert pred.seed == 0
    assert lines[1] == f"pool {4 * 64 * MiB} {4 * 64 * MiB} {2 * 64 * MiB} 4"  # two outputs stay
    assert lines[2] == f"warmup {2 * 64 * MiB} {2 * 64 * MiB} 0"  # every block freed: nothing kept
    assert lines[-1] == f"segments {' '.join([str(64 * MiB)] * 4)}"
    assert [ln for ln in lines if ln.startswith("op ")] == [
        f"op F 0 {128 * MiB} {128 * MiB}", f"op F 1 {256 * MiB} {256 * MiB}",
        f"op B 1 {256 * MiB} {256 * MiB}", f"op X 1 {256 * MiB} {256 * MiB}",
        f"op B 0 {256 * MiB} {192 * MiB}", f"op X 0 {256 * MiB} {192 * MiB}",
        f"op R d 1 0 {256 * MiB} {128 * MiB}", f"op H -1 {256 * MiB} {128 * MiB}",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "live_graphs, pools, safe",
    [
        (0, [], True),  # nothing allocated
        (0, [(0, 0), (0, 0)], True),  # the default pool only
        (1, [(0, 0)], False),  # a gograph graph is live
        (0, [(0, 0), (1, 0)], False),  # a private pool has a segment: torch's graph, a MemPool
        (2, [(3, 7)], False),
    ],
)
def test_a_plan_frees_cublas_workspaces_only_where_no_graph_can_use_one(
    live_graphs: int, pools: list[tuple[int, int]], safe: bool
) -> None:
    from gograph.planning import _workspaces_unused_by_graphs

    segments = [{"segment_pool_id": pool, "total_size": 2 * MiB} for pool in pools]
    assert _workspaces_unused_by_graphs(live_graphs, segments) is safe
    assert _workspaces_unused_by_graphs(live_graphs, [{"total_size": 1}]) is (live_graphs == 0)  # older snapshots


def test_core_seeds_a_pool_whose_freed_blocks_could_not_merge() -> None:
    """One pass: its forward saves two 30 MiB blocks and returns 12 MiB; its backward frees the
    saved blocks and makes a 50 MiB transient and a 12 MiB grad. Captured a segment at a time
    the two freed blocks cannot merge for the transient (122 MiB for 74 held at once); a seed
    segment carved first holds them side by side, so they do."""
    sched = _plan.plan_schedule(None, None, 1, 1, True, 1)
    try:
        facts = Facts(("pass 0 1 0 1 -1 -1", "in 0 0 0 1 1", "out 0 0 1"))
        trace = Trace((
            "step 0 f 0", "step 1 b 0", "step 2 x 0",
            f"a 1 {30 * MiB} 0", f"a 2 {30 * MiB} 0", f"a 3 {12 * MiB} 0",
            "r 1 1", "r 2 1", f"a 4 {50 * MiB} 1", f"a 5 {12 * MiB} 1", "r 4 1",
            "out 0 0 3", "grad 0 0 5",
        ))  # fmt: skip
        _plan.capture_program(sched, facts, False, False, False)
        pred = _plan.predict(sched, trace)
    finally:
        sched.free()
    seed, (reserved, peak) = pred.seed, pred.pool[:2]
    got = pred
    assert 0 < seed <= 74 * MiB
    assert peak == 74 * MiB and reserved < 122 * MiB and reserved <= peak + 2 * MiB, got


@pytest.mark.parametrize(
    "warmup, expected",
    [
        ((300 * MiB, 280 * MiB, 20 * MiB), 300 * MiB),  # warmup's high-water is the build's peak
        ((150 * MiB, 140 * MiB, 20 * MiB), 210 * MiB),  # the pool + an 8 MiB buffer's 20 MiB segment
        ((150 * MiB, 140 * MiB, 86 * MiB), 276 * MiB),  # + two 32 MiB workspaces and cuBLASLt's
    ],
)
def test_the_build_peak_counts_the_segments_beside_the_pool(warmup: tuple[int, int, int], expected: int) -> None:
    from gograph.planning import build_peak

    pool, warm = f"pool {190 * MiB} {186 * MiB} {48 * MiB} 3", f"warmup {' '.join(map(str, warmup))}"
    text = f"prediction v1\nseed 0\n{pool}\n{warm}\nsegments 1\n"
    assert build_peak(Prediction.decode(text)) == expected


@pytest.mark.parametrize(
    "program, exact, until",
    [
        ("", set(), 0),
        ("f0 b0", {0, 1, 2}, 2),
        # torch's per-callable loop, 2 iterations: each callable's second round repeats its first
        ("f0 b0 f0 b0 f1 b1 f1 b1", {0, 1, 2, 4, 5, 6}, 6),
        # schedule order, 2 iterations: the second iteration is all repeats
        ("f0 f1 b1 b0 f0 f1 b1 b0", {0, 1, 2, 3, 4}, 4),
    ],
)
def test_a_warmup_trace_marks_each_first_op_and_stops_after_the_last(program: str, exact: set[int], until: int) -> None:
    from gograph.probes._probe import first_ops

    ops = [Op(WarmOp(op[0]), int(op[1:])) for op in program.split()]
    assert first_ops(ops) == (exact, until)


@pytest.mark.parametrize(
    ("shapes", "may"),
    [
        ([[(64, 256)], [(256, 256)]], False),  # a small launch-bound layer: all in the small pool
        ([[(256, 1024)], [(16, 16)]], False),  # exactly 1 MiB is still a small request
        ([[(257, 1024)], []], True),  # an input just over it
        ([[(8, 8)], [(1024, 1024)]], True),  # a 4 MiB weight
        ([[], []], False),
    ],
)
def test_only_a_large_request_makes_the_warmup_worth_recording(shapes: list[list[tuple[int, int]]], may: bool) -> None:
    from types import SimpleNamespace

    from gograph.probes import _probe

    args, params = ([torch.empty(s) for s in group] for group in shapes)
    small = SimpleNamespace(flat_args=(torch.empty(4),), params=())
    states = [small, SimpleNamespace(flat_args=tuple(args), params=tuple(params))]
    assert _probe.seed_may_matter(states) is may  # type: ignore[arg-type]
