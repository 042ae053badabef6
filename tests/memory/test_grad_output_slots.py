"""Grad-output buffers shared by backward steps, without any option, on the eager engine: which
passes share one, which keep their own, and that training stays bitwise equal to eager (the CUDA
counterparts, memory and streams included, are in test_grad_output_slots_cuda.py).

A grad-output buffer is where a backward replay copies its incoming grad; nothing but that
replay (and a delayed weight-gradient graph) reads it, so the core gives passes whose backward
steps differ one buffer per signature (internal/lifetime: internalGradOutput)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import gograph

from helpers import ChainLayer, params_equal
from te_models import DelayedLinear, init_grads

FEATURES = 8


def make_layer(seed: int, dropout: float = 0.0) -> ChainLayer:
    return ChainLayer(seed, FEATURES, dropout)


class TwoOut(torch.nn.Module):
    """Two outputs of one signature: a pass needs two grad-output buffers at once."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(FEATURES, 2 * FEATURES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.fc(x).chunk(2, dim=-1)
        return torch.tanh(a), b * 2


def _samples(n: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    return tuple((torch.randn(4, FEATURES, requires_grad=True),) for _ in range(n))


def _buffer(call: Any, k: int = 0) -> torch.Tensor:
    g = call if isinstance(call, gograph.GraphedCallable) else call.forward
    return g.static_grad_outputs[k]


def _shared(call: Any) -> frozenset[int]:
    g = call if isinstance(call, gograph.GraphedCallable) else call.forward
    return g.shared_grad_outputs


def _reset(calls: Sequence[Any]) -> None:
    for c in calls:
        c.reset()


def test_default_schedule_backwards_share_one_buffer() -> None:
    calls = gograph.make_graphed_callables(tuple(make_layer(i) for i in range(3)), _samples(3))
    assert len({_buffer(c).data_ptr() for c in calls}) == 1
    assert [_shared(c) for c in calls] == [frozenset({0})] * 3
    report = gograph.memory_report(calls)
    assert [[h.split()[-1] for h in s.holders] for s in report.shared] == [["grad_output[0]"] * 3]
    assert report.totals.grad_output_bytes == 4 * FEATURES * 4  # one buffer, not three
    _reset(calls)


def test_one_callable_keeps_its_own_buffer() -> None:
    layer = make_layer(0)
    gograph.make_graphed_callables(layer, (torch.randn(4, FEATURES, requires_grad=True),))
    assert _shared(layer) == frozenset()
    layer.reset()


def test_two_outputs_of_one_pass_get_two_buffers() -> None:
    calls = gograph.make_graphed_callables((TwoOut(0), TwoOut(1)), _samples(2))
    first, second = ((_buffer(c, 0).data_ptr(), _buffer(c, 1).data_ptr()) for c in calls)
    assert first == second and first[0] != first[1]
    _reset(calls)


def _step(calls: Sequence[Callable[..., Any]], x: torch.Tensor) -> None:
    for c in calls:
        x = c(x)
    x.square().sum().backward()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_shared_buffers_train_bitwise_like_eager(set_to_none: bool, micro: int, dropout: float) -> None:
    eager = [make_layer(i, dropout) for i in range(3)]
    layers = copy.deepcopy(eager)
    calls = gograph.make_graphed_callables(tuple(layers), _samples(3))
    assert _shared(calls[0]) == frozenset({0})
    for model, run in ((eager, eager), (layers, calls)):
        torch.manual_seed(7)  # dropout masks: the graphed replays draw what eager draws
        opt = torch.optim.SGD([p for m in model for p in m.parameters()], lr=0.05)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            for _ in range(micro):
                _step(run, torch.randn(4, FEATURES, generator=gen))
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    assert all(params_equal(a, b) for a, b in zip(eager, layers))
    _reset(calls)


def test_independent_branches_read_their_own_grads() -> None:
    """Two graphed layers on one input, weighted differently in the loss: their backwards run
    one after the other through the one buffer, each with its own incoming grad."""
    eager = [make_layer(0), make_layer(1)]
    layers = copy.deepcopy(eager)
    calls = gograph.make_graphed_callables(tuple(layers), _samples(2))
    assert _buffer(calls[0]).data_ptr() == _buffer(calls[1]).data_ptr()
    x = torch.randn(4, FEATURES)
    for a, b in (eager, calls):
        (a(x).sum() * 3 + b(x).square().sum()).backward()
    for e, g in zip(eager, layers):
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(e.parameters(), g.parameters()))
    _reset(calls)


def test_a_delayed_weight_gradient_keeps_its_own_buffer() -> None:
    """backward_dw() reads the grad-output buffer after other backwards ran: no sharing there."""
    eager = [DelayedLinear(FEATURES, seed=i) for i in range(2)]
    mods = copy.deepcopy(eager)
    init_grads(*eager, *mods)  # backward_dw() adds into .grad (TransformerEngine's main_grad)
    calls = gograph.make_graphed_callables(tuple(mods), _samples(2))
    assert [_shared(c) for c in calls] == [frozenset(), frozenset()]
    assert _buffer(calls[0]).data_ptr() != _buffer(calls[1]).data_ptr()
    for p in (p for m in mods for p in m.parameters()):
        p.grad.zero_()  # in place: the weight-gradient graphs write these tensors
    x = torch.randn(4, FEATURES)
    for run, owners in ((eager, eager), (calls, mods)):
        y = x
        for c in run:
            y = c(y)
        (y * torch.arange(FEATURES)).sum().backward()
        for m in reversed(owners):  # after both backwards, as a pipeline's deferred wgrads run
            m.backward_dw()
    assert all(params_equal(a, b) for a, b in zip(eager, mods))
    assert all(torch.equal(a.weight.grad, b.weight.grad) for a, b in zip(eager, mods))
    _reset(calls)


class OrderingEngine(gograph.EagerEngine):
    """The eager engine, noting each stream ordering a replay asks for before a copy-in."""

    def __init__(self) -> None:
        super().__init__()
        self.ordered: list[tuple[int, int]] = []

    def order(self, pass_id: int, kind: int) -> None:
        self.ordered.append((pass_id, kind))


def test_a_shared_buffer_is_written_only_after_ordering_the_stream() -> None:
    """Before copying into a buffer another pass's backward reads, a backward orders the stream
    (on CUDA the core makes it wait for the previous replay on another stream); a pass with a
    buffer of its own does not pay for it."""
    engine = OrderingEngine()
    calls = gograph.make_graphed_callables(tuple(make_layer(i) for i in range(2)), _samples(2), engine=engine)
    _step(calls, torch.randn(4, FEATURES))
    ids = [(c if isinstance(c, gograph.GraphedCallable) else c.forward).pass_id for c in calls]
    assert engine.ordered == [(ids[1], 1), (ids[0], 1)]  # backwards in reverse order, kind 1
    _reset(calls)
    alone = OrderingEngine()
    layer = make_layer(0)
    gograph.make_graphed_callables(layer, (torch.randn(4, FEATURES, requires_grad=True),), engine=alone)
    layer(torch.randn(4, FEATURES)).sum().backward()
    assert alone.ordered == []
    layer.reset()
