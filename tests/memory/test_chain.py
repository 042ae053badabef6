"""chain_buffers on the eager engine: which buffers are one, when each dies, the safety rules,
and training bitwise equal to eager (the CUDA counterparts are in test_chain_cuda.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import gograph

from helpers import ChainLayer, WithLoss, params_equal

FEATURES = 8


def make_layer(seed: int, dropout: float = 0.0) -> ChainLayer:
    return ChainLayer(seed, FEATURES, dropout)


def _layers(n: int = 3, dropout: float = 0.0) -> list[torch.nn.Module]:
    return [make_layer(i, dropout) for i in range(n)]


def _graph(layers: Sequence[torch.nn.Module], **kwargs: Any) -> tuple[Any, ...]:
    samples = tuple((torch.randn(4, FEATURES, requires_grad=i > 0),) for i in range(len(layers)))
    return gograph.make_graphed_callables(tuple(layers), samples, chain_buffers=True, **kwargs)


def _step(calls: Sequence[Callable[..., Any]], x: torch.Tensor) -> torch.Tensor:
    for c in calls:
        x = c(x)
    x.square().sum().backward()
    return x.detach().clone()


def _learn_dropped_grads(graphed: Sequence[Callable[..., Any]], layers: Sequence[torch.nn.Module]) -> None:
    """A step whose grads are dropped: the callables lend their grad buffers from the next
    backward after the next replay on (they lend only once the caller was seen dropping grads)."""
    _step(graphed, torch.randn(4, FEATURES))
    for m in layers:
        m.zero_grad(set_to_none=True)


def _train(
    calls: Sequence[Callable[..., Any]], layers: Sequence[torch.nn.Module], set_to_none: bool, micro: int, seed: int
) -> None:
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        for _ in range(micro):
            _step(calls, torch.randn(4, FEATURES, generator=gen))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("micro", [1, 2])
def test_chained_training_is_bitwise_eager(set_to_none: bool, micro: int) -> None:
    layers = _layers()
    ref = copy.deepcopy(layers)
    graphed = _graph(layers)
    torch.manual_seed(3)
    _train(graphed, layers, set_to_none, micro, seed=5)
    torch.manual_seed(3)
    _train(ref, ref, set_to_none, micro, seed=5)
    assert all(params_equal(a, b) for a, b in zip(layers, ref))
    for m in graphed:
        m.reset()


def test_dropout_chain_is_bitwise_eager() -> None:
    layers = _layers(dropout=0.3)
    ref = copy.deepcopy(layers)
    graphed = _graph(layers)
    torch.manual_seed(11)
    _train(graphed, layers, True, 2, seed=1)
    torch.manual_seed(11)
    _train(ref, ref, True, 2, seed=1)
    assert all(params_equal(a, b) for a, b in zip(layers, ref))
    for m in graphed:
        m.reset()


def test_the_chain_is_one_buffer_per_edge() -> None:
    graphed = _graph(_layers())
    g0, g1, g2 = (m.forward for m in graphed)
    # layer i+1 reads layer i's output in place; its input grad is layer i's grad-output buffer
    assert g1.static_input_surface[0].data_ptr() == g0.static_outputs[0].data_ptr()
    assert g2.static_input_surface[0].data_ptr() == g1.static_outputs[0].data_ptr()
    assert g0.static_grad_outputs[0].data_ptr() == g1.static_grad_inputs[0].data_ptr()
    assert g1.static_grad_outputs[0].data_ptr() == g2.static_grad_inputs[0].data_ptr()
    assert (g0.chained_inputs, g1.chained_inputs, g2.chained_inputs) == (frozenset(), {0}, {0})
    assert (g0.chained_grad_outputs, g1.chained_grad_outputs, g2.chained_grad_outputs) == ({0}, {0}, frozenset())
    assert [g.lent_param_grads for g in (g0, g1, g2)] == [2, 2, 2]
    assert g0.buffer_reuse is not None and g0.buffer_reuse.chained == 4 and g0.buffer_reuse.lent_param_grads == 6
    report = gograph.memory_report(graphed)
    assert [p.chained_slots for p in report.passes] == [
        ["grad_output[0]"],
        ["input[0]", "grad_output[0]"],
        ["input[0]"],
    ]
    assert "4 chained slot(s); 6 parameter grad(s) lent to .grad" in str(report)
    for m in graphed:
        m.reset()


def test_a_chained_input_must_be_the_previous_output() -> None:
    layers = _layers()
    graphed = _graph(layers)
    y0 = graphed[0](torch.randn(4, FEATURES))
    before = y0.clone()
    with pytest.raises(gograph.ChainedInputError, match="argument leaf 0 of graphed callable 1 .* is chained"):
        graphed[1](torch.randn(4, FEATURES, requires_grad=True))
    with pytest.raises(gograph.ChainedInputError):
        graphed[1](y0.t().contiguous().t())  # another buffer with the same shape
    assert torch.equal(y0, before)  # nothing was copied into the producer's output
    assert isinstance(gograph.ChainedInputError("x"), gograph.StaticInputMismatchError)
    _step(graphed, torch.randn(4, FEATURES))  # still usable
    for m in graphed:
        m.reset()


def test_a_residual_reading_the_output_after_the_next_layer() -> None:
    """h = l1(x); y = l2(h); out = h + y: h is still valid after l2 ran, and its grad (a sum
    autograd forms) is copied into l1's grad-output buffer."""
    layers = _layers(2)
    ref = copy.deepcopy(layers)
    graphed = _graph(layers)

    def block(calls: Sequence[Callable[..., Any]], x: torch.Tensor) -> torch.Tensor:
        h = calls[0](x)
        out = h + calls[1](h)
        out.square().sum().backward()
        return out.detach().clone()

    for _ in range(3):
        x = torch.randn(4, FEATURES)
        assert torch.equal(block(graphed, x), block(ref, x))
    assert all(p.grad is not None and torch.equal(p.grad, q.grad) for a, b in zip(layers, ref)
               for p, q in zip(a.parameters(), b.parameters()))  # fmt: skip
    for m in graphed:
        m.reset()


def test_a_held_grad_is_copied_out_before_the_next_replay_overwrites_it() -> None:
    """Accumulation: .grad (lent) is still held at the next forward, so it becomes an owned copy
    -- the same tensor object, which every holder sees -- and the next backward adds into it."""
    layers = _layers(2)
    ref = copy.deepcopy(layers)
    graphed = _graph(layers)
    _learn_dropped_grads(graphed, layers)
    p, q = layers[1].fc.weight, ref[1].fc.weight
    x0, x1 = torch.randn(4, FEATURES), torch.randn(4, FEATURES)
    _step(graphed, x0)
    _step(ref, x0)
    held = p.grad
    static = graphed[1].forward.static_grad_inputs[1]
    assert held is not None and held.data_ptr() == static.data_ptr()  # lent: no clone was made
    _step(graphed, x1)
    _step(ref, x1)
    assert p.grad is held and held.data_ptr() != static.data_ptr()  # copied out, then accumulated into
    assert torch.equal(held, q.grad)
    for m in graphed:
        m.reset()


def test_an_old_grad_taken_off_its_parameter_and_kept_raises() -> None:
    """held = p.grad; p.grad = None: gograph cannot reach the tensor to redirect it, so the replay
    that would overwrite it refuses (nothing launched) instead of changing it."""
    layers = _layers(2)
    graphed = _graph(layers)
    _learn_dropped_grads(graphed, layers)
    _step(graphed, torch.randn(4, FEATURES))
    held = layers[1].fc.weight.grad
    value = held.clone()
    for m in layers:
        m.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="lent to .grad by an earlier backward is still alive"):
        _step(graphed, torch.randn(4, FEATURES))
    assert torch.equal(held, value)
    del held
    _step(graphed, torch.randn(4, FEATURES))
    for m in graphed:
        m.reset()


def test_a_view_of_an_old_grad_raises_instead_of_being_overwritten() -> None:
    layers = _layers(2)
    graphed = _graph(layers)
    _learn_dropped_grads(graphed, layers)
    _step(graphed, torch.randn(4, FEATURES))
    view = layers[0].fc.weight.grad.view(-1)  # a view gograph cannot redirect
    for m in layers:
        m.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="still alive .* Clone a gradient you keep"):
        graphed[0](torch.randn(4, FEATURES))
    del view
    _step(graphed, torch.randn(4, FEATURES))  # fine once nothing holds it
    for m in graphed:
        m.reset()


def test_reset_copies_out_lent_grads() -> None:
    layers = _layers(2)
    graphed = _graph(layers)
    _step(graphed, torch.randn(4, FEATURES))
    grads = [p.grad.clone() for m in layers for p in m.parameters()]
    for m in graphed:
        m.reset()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, (p for m in layers for p in m.parameters())))


def test_only_matching_positions_chain() -> None:
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(FEATURES, FEATURES)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * mask

    mods = (Two(), Two())
    samples = ((torch.randn(4, FEATURES), torch.ones(4, FEATURES)),
               (torch.randn(4, FEATURES, requires_grad=True), torch.ones(4, FEATURES)))  # fmt: skip
    g = gograph.make_graphed_callables(mods, samples, chain_buffers=True)
    assert g[1].forward.chained_inputs == {0}  # the mask keeps its own static input
    mask = torch.ones(4, FEATURES)
    g[1](g[0](torch.randn(4, FEATURES), mask), mask).sum().backward()
    for m in g:
        m.reset()


def test_chain_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="chain_buffers needs num_warmup_iters >= 1"):
        _graph(_layers(), num_warmup_iters=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chain_buffers_typo'"):
        _graph(_layers(), chain_buffers_typo=1)
    samples = tuple((torch.randn(4, FEATURES, requires_grad=i > 0),) for i in range(2))
    with pytest.raises(TypeError, match="chain_buffers must be a bool"):
        gograph.make_graphed_callables(tuple(_layers(2)), samples, chain_buffers=1)  # type: ignore[arg-type]
    assert gograph.live_plans() == 0


def _train_with_loss(calls: Sequence[Callable[..., Any]], mods: Sequence[torch.nn.Module], set_to_none: bool) -> list:
    """Three SGD steps of two accumulated micro-batches; the last call returns the loss."""
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(3):
        for _ in range(2):
            x, target = torch.randn(4, FEATURES, generator=gen), torch.randn(4, FEATURES, generator=gen)
            for c in calls[:-1]:
                x = c(x)
            loss = calls[-1](x, target)
            loss.backward()
            losses.append(loss.item())  # kept past the backward, as a training loop logs it
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return losses


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_loss_in_the_last_graph_trains_like_eager(set_to_none: bool) -> None:
    """The target is the last callable's second sample arg (not chained: the previous layer has
    one output); the loss is what the last graph returns."""
    mods = [*_layers(2, dropout=0.2), WithLoss(make_layer(2, dropout=0.2))]
    ref = copy.deepcopy(mods)
    first = torch.randn(4, FEATURES)
    shared = first.detach().requires_grad_()  # the chained samples: a view of the first
    samples = ((first,), (shared,), (shared, torch.randn(4, FEATURES)))
    graphed = gograph.make_graphed_callables(tuple(mods), samples, chain_buffers=True)
    assert graphed[1].forward.chained_inputs == graphed[2].forward.chained_inputs == {0}
    torch.manual_seed(7)
    got = _train_with_loss(graphed, mods, set_to_none)
    torch.manual_seed(7)
    want = _train_with_loss(ref, ref, set_to_none)
    assert got == want
    assert all(params_equal(a, b) for a, b in zip(mods, ref))
    for m in graphed:
        m.reset()
