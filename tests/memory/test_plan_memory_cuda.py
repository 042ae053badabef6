"""gograph.plan_memory on the H200: predictions against what the real build then holds
(bench/plan_accuracy.py has the full-size workloads and the table)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gograph

pytestmark = pytest.mark.cuda

MiB = 2**20
WIDTH, ROWS = 1024, 4096


class MLP(torch.nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, WIDTH)
        self.drop = torch.nn.Dropout(dropout)
        self.fc2 = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


def _chain(n: int, dropout: float = 0.0) -> tuple[tuple[torch.nn.Module, ...], tuple[tuple[torch.Tensor], ...]]:
    torch.manual_seed(0)
    layers = tuple(MLP(dropout).cuda().bfloat16() for _ in range(n))
    samples = tuple(
        (torch.randn(ROWS, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=i > 0),) for i in range(n)
    )
    return layers, samples


@pytest.mark.parametrize("kwargs", [{}, {"chain_buffers": True}], ids=["default", "chain"])
def test_predictions_are_within_5_percent(kwargs: dict[str, Any]) -> None:
    layers, samples = _chain(6)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    plan = gograph.plan_memory(layers, samples, **kwargs)
    torch.cuda.synchronize()
    # What the plan kept (the cuBLAS workspaces of gograph's stream, when a graph that an earlier
    # test left alive might use them) the build finds made: its peak is that much lower.
    kept = torch.cuda.memory_allocated() - allocated
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    graphed = gograph.make_graphed_callables(layers, samples, **kwargs)
    torch.cuda.synchronize()
    build_peak = torch.cuda.max_memory_reserved() - base
    report = gograph.memory_report(graphed)
    t, rt = plan.totals, report.totals
    # Per pass and what the build owns are exact; across passes, pool-planned buffers count once
    # per place the allocator re-carves them at, which the model predicts from its address order
    # (docs/BENCHMARKS.md).
    assert t.static_bytes - t.pool_planned_bytes == rt.static_bytes - rt.pool_planned_bytes
    assert [(p.static_bytes, p.pool_planned_bytes) for p in plan.passes] == [
        (p.static_bytes, p.pool_planned_bytes) for p in report.passes
    ]
    assert t.pool_reserved_bytes is not None and rt.pool_reserved_bytes is not None
    assert abs(t.pool_reserved_bytes / rt.pool_reserved_bytes - 1) <= 0.05, (t, rt)
    assert t.build_peak_bytes is not None
    assert abs((t.build_peak_bytes - kept) / build_peak - 1) <= 0.05, (t, kept, build_peak)
    for g in graphed:
        g.reset()


def test_leaves_no_trace_on_the_device() -> None:
    layers, samples = _chain(3, dropout=0.1)
    torch.cuda.synchronize()
    allocated, rng = torch.cuda.memory_allocated(), torch.cuda.get_rng_state()
    passes, graphs, plans = gograph.live_passes(), gograph.live_graphs(), gograph.live_plans()
    plan = gograph.plan_memory(layers, samples, chain_buffers=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert (gograph.live_passes(), gograph.live_graphs(), gograph.live_plans()) == (passes, graphs, plans)
    assert all(p.grad is None for m in layers for p in m.parameters())
    assert plan.totals.pool_reserved_bytes and plan.totals.pool_reserved_bytes > 0
    assert "graph pool:" in str(plan)


def test_a_plan_keeps_the_cublas_workspace_a_live_graph_uses() -> None:
    """A plan on a stream new to cuBLAS makes workspaces there. torch frees every stream's
    workspaces at once, and a captured GEMM keeps its workspace's address: with a torch graph
    alive, the plan must keep them all (before, it freed the graph's too)."""
    lin = torch.nn.Linear(WIDTH, WIDTH, device="cuda")
    x = torch.randn(ROWS, WIDTH, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lin(x)  # the capture stream's workspace, made before capture as torch's warmup makes it
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        y = lin(x)
    graph.replay()
    expected = y.clone()
    layers, samples = _chain(2)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    gograph.plan_memory(layers, samples, engine=gograph.CudaEngine())  # a stream of its own
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() >= allocated, "a workspace a live graph uses was freed"
    filler = torch.full((8, ROWS, WIDTH), 7.0, device="cuda")  # takes what a freed block would give
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expected)
    assert bool((filler == 7.0).all())
    del graph


def test_caller_recording_history_gets_no_pool_prediction() -> None:
    layers, samples = _chain(2)
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        plan = gograph.plan_memory(layers, samples)
        assert torch._C._cuda_isHistoryEnabled(), "the caller's recording must stay on"
    finally:
        torch.cuda.memory._record_memory_history(None)
    assert plan.totals.pool_reserved_bytes is None and plan.totals.static_bytes > 0
