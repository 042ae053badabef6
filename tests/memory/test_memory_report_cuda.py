"""memory_report, build observation and the replay-order guard on the CUDA engine (marker ``cuda``).

The report's numbers must agree with the caching allocator: ``torch.cuda.memory_allocated()``
deltas across ``make_graphed_callables`` and ``reset``, and the pool's segments in
``torch.cuda.memory_snapshot()``. Tensors are MiB-sized so that the allocator's 512-byte rounding
stays far below the tolerances.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import gograph
from gograph.core import _native

pytestmark = pytest.mark.cuda

MiB = 1024 * 1024
D, BATCH, LAYERS = 1024, 512, 3


def _layers(device: torch.device, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.GELU()).to(device) for _ in range(LAYERS)]


def _args(device: torch.device, n: int = LAYERS) -> tuple[tuple[torch.Tensor], ...]:
    return tuple((torch.randn(BATCH, D, device=device, requires_grad=True),) for _ in range(n))


def _settle(device: torch.device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


@pytest.fixture
def warm_engine(cuda_device):
    """The first matmuls on the engine's side stream allocate cuBLAS workspaces there, which torch
    keeps for the process: a throwaway build keeps them out of the measured deltas."""
    m = torch.nn.Linear(D, D).to(cuda_device)
    gograph.make_graphed_callables(m, (torch.randn(BATCH, D, device=cuda_device, requires_grad=True),))
    m(torch.randn(BATCH, D, device=cuda_device)).sum().backward()
    m.reset()
    del m
    _settle(cuda_device)
    return cuda_device


def test_report_agrees_with_memory_allocated_deltas(warm_engine):
    dev = warm_engine
    mods = _layers(dev)
    args = _args(dev)
    before = _settle(dev)
    torch.cuda.reset_peak_memory_stats(dev)  # so that the warmup peak is exact
    graphed = gograph.make_graphed_callables(tuple(mods), args)
    after = _settle(dev)
    r = gograph.memory_report(graphed)
    t = r.totals
    (pool,) = r.pools
    print(r)

    # Everything the build left allocated is its new static buffers: outputs and grad inputs
    # (in the graphs' pool) and the grad-output buffers (static inputs and parameters existed).
    new_static = t.output_bytes + t.grad_input_bytes + t.grad_output_bytes
    assert after - before == pytest.approx(new_static, rel=0.03), str(r)
    # The pool's live blocks are the outputs and grad inputs (grad-output buffers are allocated
    # outside the capture); its segments hold at least that.
    assert pool.active_bytes == pytest.approx(t.output_bytes + t.grad_input_bytes, rel=0.03), str(r)
    assert pool.reserved_bytes >= pool.active_bytes and pool.segments >= 1
    assert t.pool_active_bytes == pool.active_bytes
    # Each capture step's delta counts from the previous capture's end, so the deltas add up to
    # all the build left allocated: the pool's live memory (forward captures keep activations
    # that the backward captures free) plus the grad-output buffers allocated for the backwards.
    deltas = [c.memory_delta_bytes for p in r.passes for c in p.captures]
    assert len(deltas) == 2 * LAYERS and all(d is not None for d in deltas)
    assert sum(deltas) == pytest.approx(after - before, rel=0.01), deltas
    assert sum(deltas) == pytest.approx(pool.active_bytes + t.grad_output_bytes, rel=0.05), deltas
    assert all(c.memory_delta_bytes > 0 for p in r.passes for c in p.captures if c.kind == "forward")

    # Per pass: exact tensor sizes.
    out_bytes = BATCH * D * 4
    w_bytes = (D * D + D) * 4
    for p in r.passes:
        assert (p.static_input_bytes, p.output_bytes, p.grad_output_bytes) == (out_bytes, out_bytes, out_bytes)
        assert p.param_bytes == w_bytes and p.param_grad_bytes == w_bytes
        assert p.grad_input_bytes == out_bytes + w_bytes
        assert p.pool == pool.pool and p.engine == "cuda"

    # Warmup peak: at least one layer's forward activations and its grads above the baseline.
    (b,) = r.builds
    assert b.warmup is not None and b.warmup.exact
    assert b.warmup.baseline_bytes == pytest.approx(before, rel=0.01)
    assert 2 * out_bytes <= b.warmup.delta_bytes <= 64 * out_bytes

    # Releasing gives it all back.
    for m in graphed:
        m.reset()
    released = _settle(dev)
    assert released - before == pytest.approx(0, abs=0.02 * new_static + MiB)
    assert all(p.state == "reset" and p.static_bytes == 0 for p in gograph.memory_report(graphed).passes)


def test_graph_node_counts(warm_engine):
    dev = warm_engine
    mods = _layers(dev)
    graphed = gograph.make_graphed_callables(tuple(mods), _args(dev))
    r = gograph.memory_report(graphed)
    core = _native.core
    total = 0
    for p in r.passes:
        assert set(p.graph_nodes) == {"forward", "backward"}
        for kind, kname in ((0, "forward"), (1, "backward")):
            n = p.graph_nodes[kname]
            assert n is not None and n > 0
            assert n == core.graph_node_count(core.pass_graph(p.pass_id, kind))
            total += n
    assert r.totals.graph_nodes == total
    assert "nodes f/b/w" in str(r)
    for m in graphed:
        m.reset()
    assert all(n is None for p in gograph.memory_report(graphed).passes for n in p.graph_nodes.values())


def test_separate_pools_and_shared_pool(warm_engine):
    dev = warm_engine
    a, b, c = _layers(dev)
    x = _args(dev, 3)
    gograph.make_graphed_callables(a, x[0])
    shared = gograph.graph_pool_handle()
    gograph.make_graphed_callables(b, x[1], pool=shared)
    gograph.make_graphed_callables(c, x[2], pool=shared)
    r = gograph.memory_report((a, b, c))
    assert len(r.pools) == 2
    solo, both = r.pools
    assert solo.pass_ids == [a.forward.pass_id]
    assert both.pass_ids == [b.forward.pass_id, c.forward.pass_id]
    assert all(p.reserved_bytes > 0 and p.active_bytes > 0 for p in r.pools)
    assert both.active_bytes == pytest.approx(solo.active_bytes * 2, rel=0.03)
    assert r.passes[2].capture_seq == {"forward": 3, "backward": 4}  # after b's two captures
    assert len(r.builds) == 3
    for m in (a, b, c):
        m.reset()


def test_capture_logging_reports_memory(warm_engine, caplog):
    dev = warm_engine
    mods = _layers(dev)
    with caplog.at_level(logging.INFO, logger="gograph"):
        graphed = gograph.make_graphed_callables(tuple(mods), _args(dev))
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("captured ")]
    assert len(msgs) == 2 * LAYERS
    assert all(" MiB (capture #" in m or " KiB (capture #" in m for m in msgs), msgs
    assert any("warmup peak" in r.getMessage() for r in caplog.records)
    for m in graphed:
        m.reset()


def test_replay_order_guard_on_cuda(warm_engine):
    dev = warm_engine
    mods = _layers(dev)
    graphed = gograph.make_graphed_callables(tuple(mods), _args(dev), debug_replay_order=True)
    x = torch.randn(BATCH, D, device=dev, requires_grad=True)
    for _ in range(3):
        h = x
        for m in mods:
            h = m(h)
        h.square().mean().backward()
    with torch.no_grad():
        h = x
        for m in mods:
            h = m(h)
    launches_before = [m.forward.pass_id for m in mods]
    h = mods[1](mods[0](x))
    out_before = mods[0].forward.static_outputs[0].clone()
    # On CUDA the guard knows what each graph writes and reads (tests/guard/test_recarve_cuda.py
    # has deterministic conflicts): layer 0's forward again, while layer 1's backward is pending,
    # runs when its memory is disjoint from what layer 1's backward reads, and is refused --
    # before anything launches -- when it is not.
    try:
        mods[0](x + 1)
    except RuntimeError as e:
        assert "is about to overwrite pool bytes" in str(e) and "pytorch#166975" in str(e), e
        torch.cuda.synchronize(dev)
        assert torch.equal(mods[0].forward.static_outputs[0], out_before), "a refused replay launched"
    h.sum().backward()
    assert launches_before == [m.forward.pass_id for m in mods]
    for m in graphed:
        m.reset()
