"""How a build warms up (eager engine; the CUDA engine makes the same choice and, for a whole
step, allocates warmup's memory in the graph pool: test_whole_step_warmup_cuda.py). With
``chain_buffers`` the last callable's forward runs once first (a probe, its module buffers
restored): when it returns the loss, warmup runs the training step's order, as eager training
does; otherwise torch's per-callable loop. The drop-in call keeps torch's warmup exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gograph

from helpers import ChainLayer

FEATURES = 8


class WithLoss(torch.nn.Module):
    """The last layer and the loss as one callable."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(x), target)


class Logged(ChainLayer):
    """A chain layer that logs its index on every forward (torch's rule: the graphed modules
    themselves take no hooks) and counts its forwards in a buffer, as BatchNorm updates its
    statistics."""

    def __init__(self, seed: int, log: list[int]) -> None:
        super().__init__(seed, FEATURES, 0.0)
        self.index, self.log = seed, log
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.index)
        with torch.no_grad():
            self.calls += 1
        return super().forward(x)


def _build(loss: bool, **kwargs: Any) -> tuple[list[torch.nn.Module], list[int]]:
    """Three layers (the last with the loss when ``loss``), graphed with two warmup iterations;
    returns the modules and the order their forwards ran in while graphing."""
    calls: list[int] = []
    mods: list[torch.nn.Module] = [Logged(0, calls), Logged(1, calls)]
    mods.append(WithLoss(Logged(2, calls)) if loss else Logged(2, calls))
    first = torch.randn(4, FEATURES)
    shared = first.detach().requires_grad_()
    last = (shared, torch.randn(4, FEATURES)) if loss else (shared,)
    gograph.make_graphed_callables(tuple(mods), ((first,), (shared,), last), num_warmup_iters=2, **kwargs)
    return mods, calls


@pytest.mark.parametrize(
    "loss, kwargs, warmup",
    [
        (True, {"chain_buffers": True}, [2, 0, 1, 2, 0, 1, 2]),  # the probe, then the step twice
        (False, {"chain_buffers": True}, [2, 0, 0, 1, 1, 2, 2]),  # the probe, then torch's loop
        (True, {}, [0, 0, 1, 1, 2, 2]),  # the drop-in call: torch's warmup, no probe
        (True, {"chain_buffers": True, "pool": None}, [0, 0, 1, 1, 2, 2]),  # a pool made in the test
    ],
    ids=["whole-step", "loss-outside", "drop-in", "pool-passed-in"],
)
def test_the_warmup_order(loss: bool, kwargs: dict[str, Any], warmup: list[int]) -> None:
    """A pool passed in may hold blocks other graphs write: its builds keep torch's loop, and
    skip the probe, whose answer could not change that."""
    if "pool" in kwargs:
        kwargs = {**kwargs, "pool": gograph.graph_pool_handle()}
    _, calls = _build(loss, **kwargs)
    assert calls[: len(warmup)] == warmup


def test_the_probe_leaves_module_buffers_as_warmup_alone_would() -> None:
    mods, calls = _build(True, chain_buffers=True)
    counted = mods[-1].layer
    assert isinstance(counted, Logged)
    assert calls[0] == 2  # the probe ran first ...
    assert counted.calls.item() == calls.count(2) - 1  # ... and its count was restored
