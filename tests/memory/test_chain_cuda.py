"""chain_buffers on the CUDA engine (marker ``cuda``): training bitwise equal to eager (both
zero_grad modes, accumulation, dropout, autocast, a residual), the lent ``.grad`` being the
graph's own buffer, and the pool memory a chain saves. The eager-engine counterparts are in
test_chain.py; the schedule (``_order``) case runs on both engines in tests/te."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import gograph

from helpers import ChainLayer, WithLoss, params_equal

pytestmark = pytest.mark.cuda

D, ROWS = 256, 128


def make_layer(seed: int, dropout: float = 0.0) -> ChainLayer:
    return ChainLayer(seed, D, dropout, torch.nn.functional.gelu)


@pytest.fixture
def layers(cuda_device: torch.device) -> Callable[..., list[torch.nn.Module]]:
    def make(n: int = 3, dropout: float = 0.0) -> list[torch.nn.Module]:
        return [make_layer(i, dropout).to(cuda_device) for i in range(n)]

    return make


def _graph(mods: Sequence[torch.nn.Module], chain: bool = True, **kwargs: Any) -> tuple[Any, ...]:
    dev = next(mods[0].parameters()).device
    samples = tuple((torch.randn(ROWS, D, device=dev, requires_grad=i > 0),) for i in range(len(mods)))
    return gograph.make_graphed_callables(tuple(mods), samples, chain_buffers=chain, **kwargs)


def _train(
    calls: Sequence[Callable[..., Any]],
    mods: Sequence[torch.nn.Module],
    set_to_none: bool,
    micro: int,
    autocast: bool = False,
) -> list[torch.Tensor]:
    """Four SGD steps of ``micro`` accumulated micro-batches; returns each loss."""
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(5)
    dev = next(mods[0].parameters()).device
    losses = []
    for _ in range(4):
        for _ in range(micro):
            x = torch.randn(ROWS, D, generator=gen).to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
                for c in calls:
                    x = c(x)
                loss = x.float().square().mean()
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return losses


def _reset(graphed: Sequence[Any]) -> None:
    for m in graphed:
        m.reset()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("micro", [1, 2])
def test_chained_training_is_bitwise_eager(layers, set_to_none: bool, micro: int) -> None:
    mods = layers()
    ref = copy.deepcopy(mods)
    graphed = _graph(mods)
    got = _train(graphed, mods, set_to_none, micro)
    want = _train(ref, ref, set_to_none, micro)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(params_equal(a, b) for a, b in zip(mods, ref))
    _reset(graphed)


def test_dropout_chain_is_bitwise_eager(layers) -> None:
    mods = layers(dropout=0.2)
    ref = copy.deepcopy(mods)
    graphed = _graph(mods)
    torch.manual_seed(11)
    got = _train(graphed, mods, True, 2)
    torch.manual_seed(11)
    want = _train(ref, ref, True, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(params_equal(a, b) for a, b in zip(mods, ref))
    _reset(graphed)


def test_autocast_chain_is_bitwise_eager(layers) -> None:
    """bf16 autocast around capture and replay (cache_enabled=False, as torch requires for graphs)."""
    mods = layers()
    ref = copy.deepcopy(mods)
    dev = next(mods[0].parameters()).device
    # the first layer takes fp32; under autocast the later ones take the bf16 output before them
    samples = tuple((torch.randn(ROWS, D, device=dev, dtype=torch.bfloat16 if i else torch.float32,
                                 requires_grad=i > 0),) for i in range(3))  # fmt: skip
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = gograph.make_graphed_callables(tuple(mods), samples, chain_buffers=True)
    assert graphed[1].forward.chained_inputs == {0} and graphed[2].forward.chained_inputs == {0}
    got = _train(graphed, mods, True, 1, autocast=True)
    want = _train(ref, ref, True, 1, autocast=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(params_equal(a, b) for a, b in zip(mods, ref))
    _reset(graphed)


def test_residual_chain_is_bitwise_eager(layers) -> None:
    mods = layers(2)
    ref = copy.deepcopy(mods)
    graphed = _graph(mods)
    dev = next(mods[0].parameters()).device
    for _ in range(3):
        x = torch.randn(ROWS, D, device=dev)
        outs = []
        for calls in (graphed, ref):
            h = calls[0](x)
            out = h + calls[1](h)
            out.square().mean().backward()
            outs.append(out.detach().clone())
        assert torch.equal(*outs)
    for a, b in zip(mods, ref):
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    _reset(graphed)


def test_lent_grad_is_the_graph_buffer(layers) -> None:
    mods = layers(2)
    graphed = _graph(mods)
    dev = next(mods[0].parameters()).device
    graphed[1](graphed[0](torch.randn(ROWS, D, device=dev))).sum().backward()
    static = graphed[1].forward.static_grad_inputs[1]
    assert mods[1].fc.weight.grad.data_ptr() != static.data_ptr()  # the first grad is owned
    for m in mods:  # the grads are dropped after a step: the next backward lends
        m.zero_grad(set_to_none=True)
    graphed[1](graphed[0](torch.randn(ROWS, D, device=dev))).sum().backward()
    assert mods[1].fc.weight.grad.data_ptr() == static.data_ptr()
    held = mods[1].fc.weight.grad
    graphed[1](graphed[0](torch.randn(ROWS, D, device=dev))).sum().backward()  # accumulates
    assert mods[1].fc.weight.grad is held and held.data_ptr() != static.data_ptr()
    _reset(graphed)


def _built_bytes(mods: Sequence[torch.nn.Module], chain: bool) -> tuple[int, int]:
    """(distinct static storages in the report, memory_allocated growth across the build)."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graphed = _graph(mods, chain=chain)
    gc.collect()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    static = gograph.memory_report(graphed).totals.static_bytes
    _reset(graphed)
    del graphed
    gc.collect()
    return static, grown


def test_a_chain_holds_less_memory(layers) -> None:
    """Each chained edge drops one activation-sized input buffer, in the report and in what the
    caching allocator holds after the build. (Grad-output buffers are one either way: unchained,
    the four backwards share one slot; chained, only the last layer has one.)"""
    mods = layers(4)
    _built_bytes(mods, False)  # first captures: cuBLAS workspaces on the capture stream
    plain, chained = _built_bytes(mods, False), _built_bytes(mods, True)
    saved = 3 * ROWS * D * 4
    assert plain[0] - chained[0] == saved, (plain, chained)
    assert plain[1] - chained[1] >= saved * 0.9, (plain, chained)


def _train_with_loss(calls: Sequence[Callable[..., Any]], mods: Sequence[torch.nn.Module], set_to_none: bool) -> list:
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(2)
    dev = next(mods[0].parameters()).device
    losses = []
    for _ in range(3):
        for _ in range(2):
            x, target = torch.randn(ROWS, D, generator=gen).to(dev), torch.randn(ROWS, D, generator=gen).to(dev)
            for c in calls[:-1]:
                x = c(x)
            loss = calls[-1](x, target)
            loss.backward()
            losses.append(loss.detach().clone())  # kept past the backward, as a loop logs it
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return losses


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_loss_in_the_last_graph_is_bitwise_eager(layers, set_to_none: bool) -> None:
    mods = [*layers(2, dropout=0.2), WithLoss(layers(3, dropout=0.2)[2])]
    ref = copy.deepcopy(mods)
    dev = next(mods[0].parameters()).device
    first = torch.randn(ROWS, D, device=dev)
    shared = first.detach().requires_grad_()  # the chained samples: a view of the first
    samples = ((first,), (shared,), (shared, torch.randn(ROWS, D, device=dev)))
    graphed = gograph.make_graphed_callables(tuple(mods), samples, chain_buffers=True)
    assert graphed[1].forward.chained_inputs == graphed[2].forward.chained_inputs == {0}
    torch.manual_seed(7)
    got = _train_with_loss(graphed, mods, set_to_none)
    torch.manual_seed(7)
    want = _train_with_loss(ref, ref, set_to_none)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(params_equal(a, b) for a, b in zip(mods, ref))
    _reset(graphed)
