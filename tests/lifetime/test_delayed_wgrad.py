"""Delayed weight gradients (``need_backward_dw()`` / ``backward_dw()``) behave as eagerly and as
in TransformerEngine: the weight-gradient step runs only after a backward that ran (never in an
inference build), a delayed layer whose input needs no grad still stashes its work, a build
without warmup still captures the weight-gradient graph, ``backward_dw()`` replays are checked
against lent grads like every other replay, and a ``.grad`` replaced or dropped after graphing
gets eager's gradient (every grad state: test_wgrad_grad_states.py)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import gograph

from te_models import DelayedLinear, init_grads

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
F = 8


def _layers(n: int, device: str) -> list[DelayedLinear]:
    return [DelayedLinear(F, seed=i).to(device) for i in range(n)]


def _inputs(n: int, device: str, requires_grad: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, F, generator=g).to(device).requires_grad_(requires_grad) for _ in range(n)]


def _train(calls: Sequence[Any], mods: Sequence[DelayedLinear], xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per input: forward through the layers, backward, then every layer's backward_dw() (as a
    pipeline schedule runs them after the backward); returns the grads after all of them."""
    for x in xs:
        h = x
        for c in calls:
            h = c(h)
        h.square().sum().backward()
        for c in reversed(calls):
            c.backward_dw()
    return [p.grad.detach().clone() for m in mods for p in m.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("warmup", [0, 2])
@pytest.mark.parametrize("first_input_grad", [True, False], ids=["input_grad", "first_layer"])
def test_delayed_layers_train_like_eager(device: str, warmup: int, first_input_grad: bool, no_tf32: Any) -> None:
    mods = _layers(2, device)
    ref = copy.deepcopy(mods)
    init_grads(*mods, *ref)  # backward_dw accumulates into weight.grad (TransformerEngine's main_grad)
    samples = tuple((torch.randn(4, F, device=device, requires_grad=first_input_grad or i > 0),) for i in range(2))
    graphed = gograph.make_graphed_callables(tuple(mods), samples, num_warmup_iters=warmup)
    xs = _inputs(3, device, first_input_grad)
    got = _train(graphed, mods, xs)
    want = _train([_Eager(m) for m in ref], ref, xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(m._stash == [] for m in mods), "a backward stashed work no backward_dw() consumed"
    assert all(g.forward._wgrad is not None for g in graphed), "no weight-gradient graph was captured"
    for m in mods:
        m.reset()


class _Eager:
    """An eager layer with the graphed callable's ``backward_dw()``."""

    def __init__(self, m: DelayedLinear) -> None:
        self.m = m

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x)

    def backward_dw(self) -> None:
        self.m.backward_dw()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["no_grad", "eval_order"])
def test_inference_builds_never_run_backward_dw(device: str, how: str) -> None:
    mods = _layers(2, device)
    ref = copy.deepcopy(mods)
    samples = tuple((torch.randn(4, F, device=device),) for _ in range(2))
    if how == "no_grad":
        with torch.no_grad():
            graphed = gograph.make_graphed_callables(tuple(mods), samples)
    else:  # TransformerEngine's inference: modules in eval mode, a forward-only _order
        for m in mods:
            m.eval()
        graphed = gograph.make_graphed_callables(tuple(mods), samples, _order=[1, 2], _num_layers_per_chunk=[1, 1])
    assert all(m.dw_calls == 0 for m in mods)
    x = _inputs(1, device, False)[0]
    with torch.no_grad():
        assert torch.equal(graphed[1](graphed[0](x)), ref[1](ref[0](x)))
        graphed[0].backward_dw()  # nothing to replay: a no-op
    assert all(m.dw_calls == 0 and m._stash == [] for m in mods)
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_backward_dw_replays_never_overwrite_a_held_grad(device: str, no_tf32: Any) -> None:
    """The weight-gradient graph of layer 1 is captured before layer 0's backward, so its replay
    may overwrite what that backward lent: no ``.grad`` is a static buffer that a ``backward_dw()``
    replay of the step may overwrite, and each keeps its address through the step (grads dropped
    after each step, the loop the lending was made for)."""
    mods = _layers(2, device)
    ref = copy.deepcopy(mods)
    samples = tuple((torch.randn(4, F, device=device, requires_grad=True),) for _ in range(2))
    init_grads(*mods)
    graphed = gograph.make_graphed_callables(tuple(mods), samples)
    init_grads(*ref)
    for step, x in enumerate(_inputs(4, device, True)):
        for m in (*mods, *ref):  # weight.grad stays in place: the weight-gradient graph writes it
            m.weight.grad.zero_()  # type: ignore[union-attr]
            m.bias.grad = None
        h = graphed[1](graphed[0](x))
        h.square().sum().backward()
        held = [(m.bias.grad, m.bias.grad.data_ptr()) for m in mods]  # type: ignore[union-attr]
        for i, g in enumerate(graphed):  # lent (the static buffer itself) only where no wgrad replay overwrites it
            f = g.forward
            k = f.len_user_args + next(j for j, q in enumerate(f.module_params) if q is mods[i].bias)
            if held[i][1] == f.static_grad_inputs[k].data_ptr():
                # the core's answer: from which lending backward each weight-gradient replay overwrites
                later = [o.forward._wgrad_lent_from for o in graphed]
                assert all(s > g.forward._bwd_seq for s in later), f"step {step}: .grad of layer {i} may be overwritten"
        graphed[1].backward_dw()
        graphed[0].backward_dw()
        assert all(m.bias.grad is t and t.data_ptr() == p for m, (t, p) in zip(mods, held))
        del held
        _train([_Eager(m) for m in ref], ref, [x])
        got = [p.grad for m in mods for p in m.parameters()]
        want = [p.grad for m in ref for p in m.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step}"  # type: ignore[arg-type]
        del got, want  # no reference to a lent .grad outlives the step
    for m in mods:
        m.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_backward_dw_serves_a_grad_replaced_or_dropped_after_graphing(device: str, no_tf32: Any) -> None:
    """The weight-gradient graph adds into the ``.grad`` it captured. Replaced since, the new
    tensor gets the gradient added into it, as eagerly, and the old one keeps its values; set to
    None, it gets the gradient alone (AccumulateGrad's rule: this module's own ``backward_dw()``
    would fail on None eagerly, so the reference is a twin whose ``.grad`` was zeroed)."""
    mod = DelayedLinear(F, seed=3).to(device)
    ref = copy.deepcopy(mod)
    init_grads(mod, ref)
    graphed = gograph.make_graphed_callables(mod, (torch.randn(4, F, device=device, requires_grad=True),))
    captured = mod.weight.grad
    xs = _inputs(3, device, True)
    init_grads(mod, ref)  # replaced
    for m in (mod, ref):
        m.weight.grad.add_(1.0)  # type: ignore[union-attr]
    got, want = _train([graphed], [mod], xs[:1]), _train([_Eager(ref)], [ref], xs[:1])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.count_nonzero(captured) == 0, "the .grad the caller replaced changed"  # type: ignore[arg-type]
    mod.weight.grad = None  # dropped
    ref.weight.grad.zero_()  # type: ignore[union-attr]
    got, want = _train([graphed], [mod], xs[1:2]), _train([_Eager(ref)], [ref], xs[1:2])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.count_nonzero(captured) == 0, "the .grad held here changed"  # type: ignore[arg-type]
    graphed.reset()
