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
from torch.nn.attention import SDPBackend, sdpa_kernel

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


class MaskedAttention(torch.nn.Module):
    """SDPA with an additive mask, as HF decoder layers take it."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.qkv = torch.nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, ROWS, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        with sdpa_kernel([SDPBackend.MATH]):  # deterministic, for the bitwise comparison
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + a.transpose(1, 2).reshape(ROWS, D)


def _window(dev: torch.device, width: int) -> torch.Tensor:
    i = torch.arange(ROWS, device=dev)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < width)
    return torch.zeros(ROWS, ROWS, device=dev).masked_fill(~keep, float("-inf"))


def test_one_mask_for_every_layer_trains_bitwise_and_alternating_masks_raise(cuda_device: torch.device) -> None:
    """The mask sample is one static buffer for every layer (as in torch). One mask per step trains
    bitwise like eager (copied once per step); alternating masks (sliding-window and full layers,
    one shared sample) raise SharedInputError at the second layer instead of computing the first
    layer's backward from the second's mask, as torch's graphs do."""
    mods = [MaskedAttention(i).to(cuda_device) for i in range(3)]
    ref = copy.deepcopy(mods)
    x = torch.randn(ROWS, D, device=cuda_device, requires_grad=True)
    sample = _window(cuda_device, ROWS)
    graphed = gograph.make_graphed_callables(tuple(mods), tuple((x, sample) for _ in range(3)))
    assert all(g.forward.shared_inputs == frozenset({1}) for g in graphed)
    gen = torch.Generator().manual_seed(3)
    for calls in (graphed, ref):
        gen.manual_seed(3)
        for width in (ROWS, 16):  # two steps, a new mask each
            mask = _window(cuda_device, width)
            h = torch.randn(ROWS, D, generator=gen).to(cuda_device).requires_grad_()
            for c in calls:
                h = c(h, mask)
            h.square().mean().backward()
    assert all(torch.equal(a.qkv.weight.grad, b.qkv.weight.grad) for a, b in zip(mods, ref))
    full, window = _window(cuda_device, ROWS), _window(cuda_device, 16)
    h = graphed[0](torch.randn(ROWS, D, device=cuda_device, requires_grad=True), full)
    with pytest.raises(gograph.SharedInputError, match="graphed callable 1 .*graphed callable 0"):
        graphed[1](h, window)
    assert torch.equal(graphed[0].forward.static_input_surface[1], full)
    h.square().mean().backward()  # layer 0's backward still reads its own mask
    for g in graphed:
        g.forward.reset()
