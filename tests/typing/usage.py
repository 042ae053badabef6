"""Typed user code following the README and docs/API.md: `mypy --strict` must accept it (make
lint runs it). Not collected by pytest (no test_ prefix); nothing here runs."""

from __future__ import annotations

import torch

import gograph


def graph_a_module() -> float:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
    x = torch.randn(32, 64, requires_grad=True)
    graphed = gograph.make_graphed_callables(model, (x,), num_warmup_iters=3, chain_buffers=False)
    y: torch.Tensor = graphed(x)
    y.sum().backward()
    report: gograph.MemoryReport = gograph.memory_report(graphed)
    static: int = report.totals.static_bytes
    graphed.reset()
    return float(static)


def graph_a_function() -> None:
    def f(a: torch.Tensor) -> torch.Tensor:
        return a * 2

    g = gograph.make_graphed_callables(f, (torch.randn(4),))
    out = g(torch.randn(4))
    assert isinstance(out, torch.Tensor)
    g.reset()


def graph_layers() -> None:
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    samples = tuple((torch.randn(4, 8, requires_grad=i > 0),) for i in range(3))
    graphed = gograph.make_graphed_callables(tuple(layers), samples, chain_buffers=True)
    x = torch.randn(4, 8)
    for layer in graphed:
        x = layer(x)
    x.sum().backward()
    for layer in graphed:
        layer.reset()
    pool = gograph.graph_pool_handle()
    del pool
    n: int = gograph.live_passes()
    assert n >= 0


def plan_before_graphing() -> int | None:
    layers = tuple(torch.nn.Linear(8, 8) for _ in range(3))
    samples = tuple((torch.randn(4, 8, requires_grad=i > 0),) for i in range(3))
    plan: gograph.MemoryPlan = gograph.plan_memory(layers, samples, chain_buffers=True)
    print(plan)
    static: int = plan.totals.static_bytes
    assert static > 0 and plan.to_json()
    return plan.totals.pool_reserved_bytes
