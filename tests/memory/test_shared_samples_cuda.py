"""Sample args sharing memory on the CUDA engine (marker ``cuda``): layers graphed with one sample
tensor, or with views of one, train bitwise like eager (dropout, two micro-batches, both
zero_grad modes, with and without chain_buffers); the separated inputs are buffers of their own.
The eager-engine counterparts are in test_shared_samples.py."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import gograph

from helpers import params_equal

pytestmark = pytest.mark.cuda

D, ROWS = 256, 128


class Layer(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(D, D)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.nn.functional.gelu(self.fc(x)))


def _samples(kind: str, n: int, dev: torch.device) -> tuple[tuple[torch.Tensor], ...]:
    x = torch.randn(ROWS, D, device=dev, requires_grad=True)
    if kind == "one tensor":
        return tuple((x,) for _ in range(n))
    return tuple((x.detach().requires_grad_(),) for _ in range(n))


def _train(calls: Sequence[Callable[..., Any]], mods: Sequence[torch.nn.Module], set_to_none: bool) -> None:
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(5)
    dev = next(mods[0].parameters()).device
    torch.manual_seed(9)
    for _ in range(3):
        for _ in range(2):
            x = torch.randn(ROWS, D, generator=gen).to(dev).requires_grad_()
            for c in calls:
                x = c(x)
            x.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    torch.cuda.synchronize()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", ["one tensor", "views"])
@pytest.mark.parametrize("chain", [False, True])
def test_shared_samples_train_bitwise_eager(
    cuda_device: torch.device, kind: str, set_to_none: bool, chain: bool
) -> None:
    mods = [Layer(i).to(cuda_device) for i in range(3)]
    ref = copy.deepcopy(mods)
    graphed = gograph.make_graphed_callables(tuple(mods), _samples(kind, 3, cuda_device), chain_buffers=chain)
    _train(graphed, mods, set_to_none)
    _train(ref, ref, set_to_none)
    assert all(params_equal(a, b) for a, b in zip(mods, ref))
    statics = [g.forward.static_input_surface[0].data_ptr() for g in graphed]
    assert len(set(statics)) == 3  # no buffer read by two graphs
    for g in graphed:
        g.forward.reset()
