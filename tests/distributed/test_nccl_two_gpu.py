"""The multi-rank suite on two GPUs with NCCL: one rank per GPU, collectives captured in graphs.

On a machine with two or more GPUs (and the cuda flavor of the core):

    PYTHONPATH=python python -m pytest -q tests/distributed/test_nccl_two_gpu.py

(``bash scripts/gpu-run.sh tests`` runs it too, with every cuda-marked test; with fewer than
two GPUs it skips, saying why). NCCL refuses two ranks on one GPU, so this is the only part of
the suite that needs two; the rest runs its ranks on CPU (eager engine) or sharing one GPU.

* DDP over per-layer graphed blocks (the same configs as test_ddp_ranks.py, NCCL all-reducing
  the grads the graphed backwards return): parameters, losses and last grads bitwise equal to
  the one-node-per-layer eager DDP reference on each rank, and equal across ranks.
* Data-parallel averaging inside the layers' backwards (an all-reduce per parameter grad, no
  DDP), captured in the backward graphs: bitwise equal to eager, replicas equal.
* A tensor-parallel column/row-parallel block pair whose NCCL all-reduces (forward in the row-
  parallel linear, backward in the column-parallel one) are captured inside the graphs, with
  dropout from each rank's TP generator registered with the engine: bitwise equal to eager on
  each rank, Python issuing no collective while the graphs train, replicated parameters equal
  across ranks, and ``reset()`` leaving nothing.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import gograph

from ddp_ranks import PLACEMENTS, DDPConfig, in_graph_dp_problems, problems, train_configs, train_in_graph_dp
from rank_world import Layout, RankWorld, WorldCache
from tp_ranks import problems as tp_problems
from tp_ranks import train_tp_on_rank


def _skip_reason() -> str | None:
    if not dist.is_available() or not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend"
    if torch.cuda.device_count() < 2:
        return f"needs two GPUs for NCCL (one rank per GPU); torch sees {torch.cuda.device_count()}"
    if not gograph.cuda_available():
        return f"needs the cuda flavor of the gograph core: {gograph.cuda_unavailable_reason()}"
    return None


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]
TIMEOUT_S = 300.0


@pytest.fixture
def nccl_world(rank_worlds: WorldCache) -> RankWorld:
    return rank_worlds.get(Layout(2, "cuda", "nccl", gpu_per_rank=True))


def test_nccl_ddp_matches_one_node_reference(nccl_world: RankWorld) -> None:
    configs = [
        DDPConfig(p, "one_node", s, b, chain=s == b, accum=2 if p == "wrap_then_graph" else 1)
        for p, (s, b) in itertools.product(PLACEMENTS, itertools.product((True, False), (True, False)))
    ]
    configs.append(DDPConfig("graph_then_wrap", "find_unused", True, False, chain=True, own_stream=True))
    found = problems(configs, nccl_world.run(train_configs, configs, size=2, timeout=TIMEOUT_S), "cuda")
    assert not found, "\n".join(found)


def test_nccl_tp_pair_collectives_captured_in_graphs(nccl_world: RankWorld) -> None:
    rows = nccl_world.run(train_tp_on_rank, 0.25, size=2, timeout=TIMEOUT_S)
    found = [f"rank {r}: {p}" for r, row in enumerate(rows) for p in tp_problems(row, "cuda", 2)]
    calls = [row["calls"] for row in rows]  # Python-level all-reduces while training
    assert all(c["eager"] > 0 and c["graphed"] == 0 for c in calls), calls
    assert len({row["replicated"] for row in rows}) == 1, "replicated parameters differ across ranks"
    assert len({bytes(row["tp_state"].numpy()) for row in rows}) == 2, "both ranks' TP generators ended alike"
    assert not found, "\n".join(found)


def test_nccl_dp_reduction_captured_in_graphs(nccl_world: RankWorld) -> None:
    rows = nccl_world.run(train_in_graph_dp, size=2, timeout=TIMEOUT_S)
    found = in_graph_dp_problems(rows, "cuda")
    assert not found, "\n".join(found)
