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

from helpers import ChainLayer, WithLoss

FEATURES = 8


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


class Failing(Logged):
    """Raises on its ``fail_at``-th forward."""

    def __init__(self, seed: int, log: list[int], fail_at: int) -> None:
        super().__init__(seed, log)
        self.fail_at = fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log.count(self.index) + 1 == self.fail_at:
            raise ValueError("layer fault")
        return super().forward(x)


@pytest.mark.parametrize("fail_at", [1, 2], ids=["in-the-probe", "in-warmup"])
def test_warmup_hooks_frame_the_probe_and_a_failure_leaves_nothing(fail_at: int) -> None:
    """TransformerEngine's hooks: pre_warmup_hook before the probe (it is warmup's first
    forward), post_warmup_hook also when the probe or warmup fails; the build rolls back."""
    calls: list[int] = []
    mods = [Logged(0, calls), Logged(1, calls), WithLoss(Failing(2, calls, fail_at))]
    first = torch.randn(4, FEATURES)
    shared = first.detach().requires_grad_()
    samples = ((first,), (shared,), (shared, torch.randn(4, FEATURES)))
    live = gograph.live_graphs()
    with pytest.raises(ValueError, match=r"callable 2 \(WithLoss\) failed during warmup: layer fault"):
        gograph.make_graphed_callables(
            tuple(mods),
            samples,
            chain_buffers=True,
            pre_warmup_hook=lambda: calls.append(-1),
            post_warmup_hook=lambda: calls.append(-2),
        )
    assert calls[0] == -1 and calls[-1] == -2
    assert calls[1:-1] == ([] if fail_at == 1 else [2, 0, 1])  # the probe, then the step's forwards
    assert gograph.live_graphs() == live
