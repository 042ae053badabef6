"""DistributedDataParallel over gograph's per-layer graphed callables, 2 and 4 ranks, gloo.

Every rank trains on its own data; after the steps the parameters must be bitwise equal on every
rank and bitwise equal to eager DDP on the same ranks with the same data and seeds
(tests/distributed/ddp_ranks.py says which eager reference, and why it must have the graphed
layers' one-node-per-layer shape from 4 ranks on), and so must the losses of every micro-batch
and the grads of the last step, with as many distinct storages behind them (DDP's
``gradient_as_bucket_view`` makes them views of its buckets: a grad gograph lent, moved or copied
would break that). Both placements (graph the layers then wrap the model, wrap then graph
``ddp.module``'s layers), both ``zero_grad`` modes, bucket views on and off, ``chain_buffers``,
accumulation under ``no_sync()``, and DDP constructed under its own stream. After each run the
graphed callables are reset on every rank and must leave no pass, graph or pool reference.

CPU ranks run the eager engine; the ``cuda`` variants run the CUDA engine with all ranks sharing
one GPU (gloo works on CUDA tensors; NCCL needs a GPU per rank: test_nccl_two_gpu.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from ddp_ranks import PLACEMENTS, DDPConfig, in_graph_dp_problems, problems, train_configs, train_in_graph_dp
from rank_world import gloo_skip_reason

pytestmark = pytest.mark.skipif(gloo_skip_reason() is not None, reason=str(gloo_skip_reason()))

ENGINES = ["eager", pytest.param("cuda", marks=pytest.mark.cuda)]
SIZES = [2, 4]
TIMEOUT_S = 120.0
MODES = list(itertools.product((True, False), (True, False)))  # (set_to_none, bucket_view)


def check(configs: list[DDPConfig], per_rank: list[list[dict[str, Any]]], engine: str) -> None:
    """Every config's results against its reference and across ranks; all problems at once."""
    found = problems(configs, per_rank, engine)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("engine", ENGINES)
def test_ddp_matches_one_node_reference(world, engine: str, size: int, placement: str) -> None:
    """DDP's defaults (buckets rebuilt after the first step) against the eager model whose
    layers are each one autograd node: both zero_grad modes, bucket views on and off, each with
    chain_buffers in one placement and without in the other."""
    flip = placement == "wrap_then_graph"
    configs = [DDPConfig(placement, "one_node", s, b, chain=(s == b) != flip) for s, b in MODES]
    check(configs, world(engine).run(train_configs, configs, size=size, timeout=TIMEOUT_S), engine)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("engine", ENGINES)
def test_ddp_matches_plain_ddp_without_bucket_rebuild(world, engine: str, size: int) -> None:
    """Against plain eager DDP (eager Linear layers), both DDPs with find_unused_parameters=True:
    DDP then keeps its first bucket order, the parameters' order, on both sides."""
    configs = [DDPConfig(PLACEMENTS[i % 2], "find_unused", s, b, chain=i < 2) for i, (s, b) in enumerate(MODES)]
    check(configs, world(engine).run(train_configs, configs, size=size, timeout=TIMEOUT_S), engine)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("engine", ENGINES)
def test_ddp_no_sync_accumulation(world, engine: str, size: int) -> None:
    """Three micro-batches per step, the first two under ``ddp.no_sync()``: grads accumulate
    locally in ``.grad`` (a lent grad must become an owned copy before the next replay, or be
    added into a bucket view) and the last micro-batch's backward reduces the sum."""
    configs = [
        DDPConfig(PLACEMENTS[i // 2], "one_node", s, b, chain=i % 2 == 0, accum=3) for i, (s, b) in enumerate(MODES)
    ]
    check(configs, world(engine).run(train_configs, configs, size=size, timeout=TIMEOUT_S), engine)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("engine", ENGINES)
def test_ddp_built_under_its_own_stream(world, engine: str, size: int) -> None:
    """Megatron's setup: DDP constructed under a side stream that the engine captures on
    (``CudaEngine(device, stream=side)``) and training on a non-default current stream; on the
    eager engine the stream contexts are no-ops and the run must match all the same."""
    configs = [
        DDPConfig("graph_then_wrap", "one_node", True, True, chain=True, own_stream=True),
        DDPConfig("wrap_then_graph", "one_node", False, False, chain=False, accum=2, own_stream=True),
    ]
    check(configs, world(engine).run(train_configs, configs, size=size, timeout=TIMEOUT_S), engine)


@pytest.mark.parametrize("size", SIZES)
def test_data_parallel_reduction_inside_the_graphs(world, size: int) -> None:
    """No DDP: each layer averages its parameter grads over the ranks in its own backward (an
    all-reduce per parameter), so the reduction is part of the graphed backward. Gloo cannot run
    inside a CUDA capture: CPU ranks here; NCCL captures it (test_nccl_two_gpu.py)."""
    rows = world("eager").run(train_in_graph_dp, size=size, timeout=TIMEOUT_S)
    found = in_graph_dp_problems(rows, "eager")
    assert not found, "\n".join(found)
