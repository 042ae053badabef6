"""The graph pool's seed segment on the H200: what the CUDA engine carves before a build's first
capture is one free segment of the pool, and it goes back with the pool (the core's choice of
its size is tested on the CPU: internal/memplan, tests/memory/test_plan_memory.py)."""

from __future__ import annotations

import pytest
import torch

import gograph

pytestmark = pytest.mark.cuda

MiB = 2**20


def _settled(device: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)


def test_a_seed_is_one_free_segment_of_the_pool_and_goes_back_with_it(cuda_device: torch.device) -> None:
    engine = gograph.CudaEngine(cuda_device)
    pool = engine.new_pool()
    reserved, allocated = _settled(cuda_device)
    assert engine.carve_seed(pool, 64 * MiB)  # one pool reference taken
    assert torch.cuda.memory_reserved(cuda_device) - reserved == 64 * MiB
    assert torch.cuda.memory_allocated(cuda_device) == allocated  # carved and freed
    torch.cuda.empty_cache()  # a referenced pool keeps its free segment
    assert torch.cuda.memory_reserved(cuda_device) - reserved == 64 * MiB
    engine.end_warmup_in_pool(pool)  # the last reference: the segment goes at the next empty_cache
    assert _settled(cuda_device) == (reserved, allocated)


def test_a_seed_the_device_cannot_hold_is_skipped(cuda_device: torch.device) -> None:
    engine = gograph.CudaEngine(cuda_device)
    pool = engine.new_pool()
    reserved, allocated = _settled(cuda_device)
    total = torch.cuda.get_device_properties(cuda_device).total_memory
    assert engine.carve_seed(pool, 2 * total)  # out of memory: skipped, the reference still taken
    engine.end_warmup_in_pool(pool)
    assert _settled(cuda_device) == (reserved, allocated)


@pytest.mark.parametrize("until", [None, 2])
def test_counted_marks_cut_the_history_where_a_snapshot_would(cuda_device: torch.device, until: int | None) -> None:
    from gograph.core._kinds import WarmOp
    from gograph.core._wire import Op
    from gograph.probes._probe import CountedTrace

    # With a program, ops 2 and 3 repeat op 0: the history stops at op 2.
    ops = None if until is None else [Op(WarmOp.FORWARD, p) for p in (0, 1, 0, 0)]
    expected: list[int] = []
    with CountedTrace(cuda_device, ops) as rec:
        base = len(rec._device_entries())
        for i in range(5):
            if until is None or i <= until:  # read before the mark: recording stops at op ``until``
                expected.append(len(rec._device_entries()) - base)
            rec.op(i)
            if i == 4:
                break
            x = torch.randn(256 * (i + 1), 1024, device=cuda_device)
            y = (x @ x.T).relu()
            del x
            keep = y.sum()
            del y
        if until is not None:  # recording stopped at op ``until``: the history is the ops before
            assert not torch._C._cuda_isHistoryEnabled()
    assert keep.item() > 0
    assert rec.marks == expected
    assert rec.complete
    assert len(rec.entries) == expected[-1]
    assert sum(e["action"] == "alloc" for e in rec.entries) >= 4 * (until or 4)  # randn, matmul, relu, sum


@pytest.mark.parametrize(("width", "recorded"), [(256, 0), (1024, 1)])
def test_only_builds_with_a_large_request_record_their_warmup(
    cuda_device: torch.device, monkeypatch: pytest.MonkeyPatch, width: int, recorded: int
) -> None:
    from gograph.probes import _probe

    entered: list[object] = []
    enter = _probe.CountedTrace.__enter__

    def counted(self: _probe.CountedTrace) -> _probe.CountedTrace:
        entered.append(self)
        return enter(self)

    monkeypatch.setattr(_probe.CountedTrace, "__enter__", counted)
    # 256: every weight (256 KiB) and input (64 KiB) in the small pool; 1024: 4 MiB weights.
    layers = [torch.nn.Linear(width, width, device=cuda_device) for _ in range(4)]
    samples = tuple((torch.randn(64, width, device=cuda_device, requires_grad=True),) for _ in layers)
    graphed = gograph.make_graphed_callables(tuple(layers), samples)
    assert len(entered) == recorded
    x = torch.randn(64, width, device=cuda_device, requires_grad=True)
    out = x
    for g in graphed:
        out = g(out)
    out.sum().backward()  # the build without a trace trains all the same
    assert x.grad is not None and torch.isfinite(x.grad).all()
