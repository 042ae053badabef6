"""bench/workloads.py's inputs received at their forward (the footprint bench's ``recv`` /
``recv_into_static`` options), on the eager engine: receiving straight into the graphs' static
inputs (Megatron-LM's receive into the graph's buffer, a data loader's copy into it, so a
replay's copy-in is skipped) trains bitwise like eager receiving into fresh tensors -- the
pipeline with and without TransformerEngine's slot reuse, the chain with ``chain_buffers``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gograph

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
workloads: Any = pytest.importorskip("workloads")

CPU = torch.device("cpu")


def _train(arm: str, name: str = "pipeline", share: bool | str = False) -> str:
    """Two SGD steps of the small workload ``name``; ``arm``: eager, graphed, graphed+reuse
    (inputs received into the static inputs); ``share``: the samples' ``share_chained``."""
    wl = workloads.workload(name, small=True)
    wl.dtype = torch.float32
    layers = wl.build(CPU)
    into: dict[int, torch.Tensor] = {}
    calls: list[Any] = wl.eager_calls(layers)
    if arm != "eager":
        calls = list(
            gograph.make_graphed_callables(
                tuple(layers), wl.sample_args(CPU, share_chained=share), engine="eager", num_warmup_iters=1,
                _reuse_graph_input_output_buffers=arm.endswith("reuse"), chain_buffers=name == "chain",
                **wl.graph_kwargs(),
            )
        )  # fmt: skip
        into = wl.static_inputs(calls)
        if arm.endswith("reuse"):  # microbatches not in flight together share an input slot
            assert len({id(t) for t in into.values()}) < len(into)
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch = wl.batch(gen, CPU, recv=True)
        batch.into = into
        wl.step(calls, batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for c in calls:
        if isinstance(c, gograph.GraphedCallable):
            c.reset()
    return str(workloads.param_digest(layers))


def test_receiving_into_static_inputs_trains_like_eager() -> None:
    eager = _train("eager")
    assert _train("graphed") == eager
    assert _train("graphed+reuse") == eager


def test_chain_receiving_into_its_static_input_trains_like_eager() -> None:
    eager = _train("eager", "chain")
    assert _train("eager", "chain") == eager  # the digest is deterministic here
    assert _train("graphed", "chain") == eager


def test_chain_samples_as_views_of_the_first_train_like_eager() -> None:
    """``shared_samples=all``: the chained layers' one sample is a view of layer 0's (its static
    input), so the samples cost one tensor; they are read only by warmup."""
    wl = workloads.workload("chain", small=True)
    samples = wl.sample_args(CPU, share_chained="all")
    first, rest = samples[0][0], {s[0] for s in samples[1:]}
    assert len(rest) == 1 and not first.requires_grad
    (shared,) = rest
    assert shared.requires_grad and shared.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    eager = _train("eager", "chain")
    assert _train("graphed", "chain", share="all") == eager
