"""An eval callable never stops a gradient silently.

As eagerly and with torch's make_graphed_callables, a callable gets a backward exactly when grad
mode is on and its outputs require grad, whatever its module's train/eval mode: a frozen
``BatchNorm1d(8).eval()`` between two trained layers passes the gradient through, and a tuple
may mix train and eval modules. Graphed forward-only (under ``torch.no_grad()``, or
TransformerEngine's eval-mode ``_order``) its outputs still require grad where eager's would, and
a backward that reaches it raises naming ``train()`` and ``torch.no_grad()``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import gograph

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _stack(device: str) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(8)
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    mods = [torch.nn.Linear(8, 8), norm.eval().requires_grad_(False), torch.nn.Linear(8, 8)]
    return [m.to(device) for m in mods]


@pytest.mark.parametrize("device", DEVICES)
def test_a_frozen_eval_layer_passes_the_gradient(device: str, no_tf32: Any) -> None:
    mods = _stack(device)
    ref = copy.deepcopy(mods)
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=i > 0),) for i in range(3))
    graphed = gograph.make_graphed_callables(tuple(mods), samples)
    assert graphed[1].forward.has_backward, "the eval layer's outputs require grad (its input does)"
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g).to(device)
        for calls in (graphed, ref):
            h = x
            for c in calls:
                h = c(h)
            assert h.requires_grad
            h.square().sum().backward()
    for a, b in zip(mods, ref):
        for p, q in zip(a.parameters(), b.parameters()):
            assert (p.grad is None) == (q.grad is None)
            assert p.grad is None or torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        assert all(torch.equal(u, v) for u, v in zip(a.buffers(), b.buffers()))  # eval: running stats untouched
    assert mods[0].weight.grad is not None, "the gradient reached the layer before the eval one"
    for m in graphed:
        m.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_forward_only_callables_raise_on_backward_never_detach(device: str) -> None:
    mods = _stack(device)
    mods[1].requires_grad_(True)
    with torch.no_grad():
        gograph.make_graphed_callables(mods[1], (torch.randn(4, 8, device=device),))
    x = torch.randn(4, 8, device=device, requires_grad=True)
    out = mods[1](x)
    assert out.requires_grad  # as eager's
    with pytest.raises(RuntimeError, match=r"graphed under torch\.no_grad\(\).*torch\.no_grad\(\)"):
        out.sum().backward()
    with torch.no_grad():
        assert not mods[1](x).requires_grad
    mods[1].reset()


@pytest.mark.parametrize("device", DEVICES)
def test_eval_order_is_forward_only_and_names_train(device: str) -> None:
    """TransformerEngine's call shape keeps its inference rule: with ``_order`` and modules in
    eval mode nothing is differentiable; a backward says what to do instead of dropping grads."""
    mods = tuple(torch.nn.Linear(8, 8).to(device).eval() for _ in range(2))
    samples = tuple((torch.randn(4, 8, device=device),) for _ in range(2))
    graphed = gograph.make_graphed_callables(mods, samples, _order=[1, 2], _num_layers_per_chunk=[1, 1])
    out = graphed[1](graphed[0](torch.randn(4, 8, device=device)))
    assert out.requires_grad  # the weights require grad: eager's output would
    with pytest.raises(RuntimeError, match=r"eval mode are graphed forward-only.*train\(\).*torch\.no_grad\(\)"):
        out.sum().backward()
    for g in graphed:
        g.reset()
