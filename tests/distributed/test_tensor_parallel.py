"""Tensor-parallel layers whose collectives sit inside the graphed callable (tp_ranks.py).

Under the fake process group (``backend="fake"``, ``FakeStore``, world size 4: collectives do
nothing, each rank's wiring runs alone), this process plays every rank in turn: its shards, its
own tensor-parallel RNG (``CudaEngine(generators=[...])`` on CUDA, nothing to register on the
eager engine, whose replays re-run the callable), graph-safe dropout, ``_order`` with several
virtual chunks, and ``reset()``. Each rank's graphed training must equal its eager training bit
for bit, generators included, and leave nothing behind. With a real gloo group (spawned CPU
ranks) the same blocks all-reduce for real; the two-GPU NCCL suite runs them with NCCL
(test_nccl_two_gpu.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from rank_world import gloo_skip_reason
from tp_ranks import BLOCKS, STEPS, problems, reset_problems, train_tp, train_tp_on_rank, train_tp_order

ENGINES = ["eager", pytest.param("cuda", marks=pytest.mark.cuda)]
FAKE_WORLD = 4


def _device(engine: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if engine == "cuda" else torch.device("cpu")


def fake_ranks(size: int = FAKE_WORLD) -> Iterator[int]:
    """Each rank of a fake world of ``size`` in turn, its group initialized while it runs."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the fake backend

    for rank in range(size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
        try:
            yield rank
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("engine", ENGINES)
def test_tp_blocks_train_like_eager_on_every_rank(engine: str, no_process_group: None) -> None:
    """Column- then row-parallel blocks with dropout from the rank's TP generator and from the
    default one: 3 steps graphed equal 3 steps eager on each rank (losses, parameters, both
    generators' end states); each rank's TP generator ends elsewhere; the collectives are inside
    the graphed callable (the eager engine's replays call them as eager code does, a CUDA
    replay runs the captured ones: Python calls none)."""
    rows, found = [], []
    for rank in fake_ranks():
        rows.append(train_tp(_device(engine), rank))
        found += [f"rank {rank}: {p}" for p in problems(rows[-1], engine, FAKE_WORLD)]
    calls = [row["calls"] for row in rows]
    assert all(c["eager"] == STEPS * (2 * BLOCKS - 1) for c in calls), calls  # no grad into block 0's input
    expected = [c["eager"] if engine == "eager" else 0 for c in calls]
    assert [c["graphed"] for c in calls] == expected, f"all-reduce calls from Python while training graphed: {calls}"
    states = {bytes(row["tp_state"].numpy()) for row in rows}
    assert len(states) == FAKE_WORLD, "two ranks' TP generators ended in the same state"
    if engine == "cuda":  # a registered generator is restored after graphing, as the default one is
        # (the eager engine takes no generators: its warmup draws from the TP generator unrestored)
        assert all(row["graphing_kept_tp_state"] for row in rows)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("engine", ENGINES)
def test_tp_order_with_virtual_chunks(engine: str, no_process_group: None) -> None:
    """TP blocks as the three virtual chunks of an interleaved pipeline rank (Megatron's 1F1B
    ``_order``, 4 microbatches: 12 forward passes): 2 iterations through the schedule graphed
    equal eager on each rank (every chunk output and input grad, the parameters, the TP
    generator), and ``reset()`` of the 12 callables leaves nothing."""
    found = []
    states = set()
    for rank in fake_ranks():
        row = train_tp_order(_device(engine), rank)
        states.add(bytes(row["tp_state"].numpy()))
        bad = [k for k in ("outputs_equal", "grads_equal", "params_equal", "tp_state_equal") if not row[k]]
        found += [f"rank {rank}: {k} is False" for k in bad]
        found += [f"rank {rank}: {p}" for p in reset_problems(row)]
        if row["passes"] != 12 or len(row["order"]) != 24:
            found.append(f"rank {rank}: {row['passes']} passes for the order {row['order']}")
    assert len(states) == FAKE_WORLD, "two ranks' TP generators ended in the same state"
    assert not found, "\n".join(found)


@pytest.mark.skipif(gloo_skip_reason() is not None, reason=str(gloo_skip_reason()))
@pytest.mark.parametrize("size", [2, 4])
def test_tp_blocks_with_gloo_collectives(world, size: int) -> None:
    """The same blocks on spawned CPU ranks whose all-reduces go through gloo, inside the eager
    engine's graphed callables: bitwise equal to eager on every rank, and the replicated
    parameters (the row-parallel biases) equal on every rank."""
    rows = world("eager").run(train_tp_on_rank, 0.25, size=size, timeout=60.0)
    found = [f"rank {r}: {p}" for r, row in enumerate(rows) for p in problems(row, "eager", size)]
    assert len({row["replicated"] for row in rows}) == 1, "replicated parameters differ across ranks"
    assert len({row["params"] for row in rows}) == size, "two ranks hold the same shards"
    assert not found, "\n".join(found)
