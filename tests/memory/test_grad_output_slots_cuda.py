"""Grad-output buffers shared by backward steps, on the CUDA engine (marker ``cuda``): default
builds train bitwise like eager with one buffer for every layer's incoming grad, and backwards
replayed on two streams each read their own incoming grad (the copy-in waits for the other
stream's replay that still reads the buffer). The eager-engine counterparts are in
test_grad_output_slots.py."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import gograph

from helpers import ChainLayer, params_equal

pytestmark = pytest.mark.cuda

D, ROWS = 256, 128


def make_layer(seed: int, dropout: float = 0.0) -> ChainLayer:
    return ChainLayer(seed, D, dropout, torch.nn.functional.gelu)


class LateRead(torch.nn.Module):
    """Two outputs; the backward reads the second one's incoming grad last, after a long chain of
    matmuls (autograd runs the node made first in the forward last)."""

    def __init__(self, seed: int, width: int, depth: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(width, width, generator=g) / width**0.5)
        self.depth = depth

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        late = x * 2
        h = x
        for _ in range(self.depth):
            h = torch.tanh(h @ self.w)
        return h, late


@pytest.fixture
def layers(cuda_device: torch.device) -> Callable[..., list[torch.nn.Module]]:
    def make(n: int = 3, dropout: float = 0.0) -> list[torch.nn.Module]:
        return [make_layer(i, dropout).to(cuda_device) for i in range(n)]

    return make


def _reset(graphed: Sequence[Any]) -> None:
    for m in graphed:
        m.reset()


def _forward(c: Any) -> gograph.GraphedCallable:
    return c if isinstance(c, gograph.GraphedCallable) else c.forward


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_default_build_shares_one_grad_output_and_trains_bitwise(
    layers: Callable[..., list[torch.nn.Module]], set_to_none: bool, dropout: float
) -> None:
    eager = layers(3, dropout)
    mods = copy.deepcopy(eager)
    dev = next(mods[0].parameters()).device
    samples = tuple((torch.randn(ROWS, D, device=dev, requires_grad=i > 0),) for i in range(3))
    calls = gograph.make_graphed_callables(tuple(mods), samples)
    assert len({_forward(c).static_grad_outputs[0].data_ptr() for c in calls}) == 1
    assert gograph.memory_report(calls).totals.grad_output_bytes == ROWS * D * 4
    for run, model in ((eager, eager), (calls, mods)):
        torch.manual_seed(11)
        opt = torch.optim.SGD([p for m in model for p in m.parameters()], lr=0.05)
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            for _ in range(2):  # two accumulated micro-batches
                x = torch.randn(ROWS, D, generator=gen).to(dev)
                for c in run:
                    x = c(x)
                x.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    assert all(params_equal(a, b) for a, b in zip(eager, mods))
    _reset(calls)


def _two_streams(run: Sequence[Any], x: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """Each layer's forward on a stream of its own; the loss weights each output differently, so
    each backward's incoming grads differ. Returns x's grad."""
    streams = [torch.cuda.Stream() for _ in run]
    main = torch.cuda.current_stream()
    outs = []
    for c, s in zip(run, streams):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs += list(c(x))
        main.wait_stream(s)
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    loss.backward()  # autograd runs each graphed backward on its forward's stream
    torch.cuda.synchronize()
    assert x.grad is not None
    return x.grad


def test_cuda_backwards_on_two_streams_read_their_own_grads(cuda_device: torch.device) -> None:
    width, rows = 2048, 2048
    eager = [LateRead(i, width, 12).to(cuda_device) for i in range(2)]
    mods = copy.deepcopy(eager)
    samples = tuple((torch.randn(rows, width, device=cuda_device, requires_grad=True),) for _ in range(2))
    calls = gograph.make_graphed_callables(tuple(mods), samples)
    late = [_forward(c).static_grad_outputs[1].data_ptr() for c in calls]
    assert late[0] == late[1], "the two backwards share the late-read grad-output buffer"
    weights = (1.0, 3.0, 5.0, 7.0)
    x = torch.randn(rows, width, device=cuda_device)
    want = _two_streams(eager, x.clone().requires_grad_(), weights)
    for _ in range(3):
        got = _two_streams(calls, x.clone().requires_grad_(), weights)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    _reset(calls)
