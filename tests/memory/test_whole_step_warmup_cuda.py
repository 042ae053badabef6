"""The whole-step warmup on the CUDA engine (marker ``cuda``): a ``chain_buffers`` build whose
last callable returns the loss warms up in its graph pool, in the step's order, and gives the
pool reference warmup took back, whether the build succeeds or fails; training stays bitwise
eager. The choice itself is tested on the eager engine (test_whole_step_warmup.py)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import gograph

from helpers import ChainLayer, WithLoss, params_equal

pytestmark = pytest.mark.cuda

D, ROWS = 256, 128


class FailingLoss(WithLoss):
    """Raises on its ``fail_at``-th call (0: never)."""

    def __init__(self, layer: torch.nn.Module, fail_at: int = 0) -> None:
        super().__init__(layer)
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("loss fault")
        return super().forward(x, target)


def _mods(device: torch.device, fail_at: int = 0) -> list[torch.nn.Module]:
    layers = [ChainLayer(i, D, 0.1, torch.nn.functional.gelu).to(device) for i in range(3)]
    return [*layers[:2], FailingLoss(layers[2], fail_at)]


def _samples(device: torch.device) -> tuple[tuple[torch.Tensor, ...], ...]:
    first = torch.randn(ROWS, D, device=device)
    shared = first.detach().requires_grad_()
    return ((first,), (shared,), (shared, torch.randn(ROWS, D, device=device)))


def _reserved_after_cleanup(device: torch.device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def _train(calls: list, mods: list[torch.nn.Module], device: torch.device) -> None:
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, target = torch.randn(ROWS, D, generator=gen).to(device), torch.randn(ROWS, D, generator=gen).to(device)
        for c in calls[:-1]:
            x = c(x)
        calls[-1](x, target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_a_whole_step_build_trains_bitwise_and_gives_its_pool_back(cuda_device: torch.device) -> None:
    gograph.make_graphed_callables(tuple(_mods(cuda_device)), _samples(cuda_device), chain_buffers=True)
    base = _reserved_after_cleanup(cuda_device)  # the engine stream's cuBLAS workspaces exist now
    mods = _mods(cuda_device)
    ref = copy.deepcopy(mods)
    graphed = list(gograph.make_graphed_callables(tuple(mods), _samples(cuda_device), chain_buffers=True))
    torch.manual_seed(5)
    _train(graphed, mods, cuda_device)
    torch.manual_seed(5)
    _train(ref, ref, cuda_device)
    assert all(params_equal(a, b) for a, b in zip(mods, ref))
    for g in graphed:
        g.reset()
    del graphed, mods, ref
    assert _reserved_after_cleanup(cuda_device) == base  # no pool reference left behind


@pytest.mark.parametrize("fail_at", [2, 4], ids=["first-warmup-forward", "last-warmup-forward"])
def test_a_whole_step_build_that_fails_in_warmup_leaves_no_pool(cuda_device: torch.device, fail_at: int) -> None:
    """Call 1 of the loss callable is the probe; the failure comes inside the pool's warmup."""
    gograph.make_graphed_callables(tuple(_mods(cuda_device)), _samples(cuda_device), chain_buffers=True)
    base = _reserved_after_cleanup(cuda_device)
    live = gograph.live_graphs()
    with pytest.raises(ValueError, match=r"callable 2 \(FailingLoss\) failed during warmup: loss fault"):
        gograph.make_graphed_callables(tuple(_mods(cuda_device, fail_at)), _samples(cuda_device), chain_buffers=True)
    assert gograph.live_graphs() == live
    assert _reserved_after_cleanup(cuda_device) == base
