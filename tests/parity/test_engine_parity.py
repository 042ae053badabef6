"""The same scenario on both engines, compared with eager: observables a user debugging on the
eager engine relies on must be the CUDA engine's (hook calls, grads, ``.grad`` identity)."""

from __future__ import annotations

import copy

import pytest
import torch

import gograph

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_parameter_hook_fires_once_per_backward_and_changes_the_grad_once(device: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)).to(device)
    ref = copy.deepcopy(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8, device=device, requires_grad=True),))
    calls: list[int] = []
    handle = model[0].weight.register_hook(lambda g: (calls.append(1), g * 2)[1])
    ref[0].weight.register_hook(lambda g: g * 2)
    for step in range(3):  # accumulation: .grad is added into from the second step on
        x = torch.randn(4, 8, device=device)
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        assert len(calls) == step + 1
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    handle.remove()
    model(torch.randn(4, 8, device=device)).sum().backward()
    assert len(calls) == 3  # removed: suspended hooks came back as they were, removal still works
    model.reset()
