"""A static input shared by passes that have no backward is not guarded for one.

The shared-input guard refuses new contents for a buffer while another sharer's backward, still
to run, reads it. A forward-only pass (TransformerEngine's eval ``_order``, a build under
``torch.no_grad()``, a layer whose inputs and parameters need no grad) has no backward: the capture
program captures none for it, so nothing of it waits, and its sharers copy freely, as eager runs
them. A sharer that does have a backward still refuses changed contents while it waits.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gograph

from helpers import Masked

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ROWS, FEATURES = 4, 8


def _mask(seed: int, device: str) -> torch.Tensor:
    return (torch.rand(ROWS, FEATURES, generator=torch.Generator().manual_seed(seed)) > 0.3).float().to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_an_inference_order_build_sharing_one_sample_runs_as_eager(device: str) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(FEATURES, FEATURES).to(device).eval() for _ in range(2)]
    sample = torch.randn(ROWS, FEATURES, device=device)  # one sample for every pass
    graphed = gograph.make_graphed_callables(
        tuple(layers), tuple((sample,) for _ in range(4)), _order=[1, 1], _num_layers_per_chunk=[2]
    )
    for seed in range(3):
        x = torch.randn(ROWS, FEATURES, generator=torch.Generator().manual_seed(seed)).to(device)
        with torch.no_grad():
            want = layers[1].forward(layers[0].forward(x))
        assert torch.equal(graphed[1](graphed[0](x)), want)
    assert all(not g.shared_inputs for g in graphed)  # no backward to guard


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chain_buffers", [False, True])
def test_a_no_grad_build_sharing_a_mask_takes_new_masks(device: str, chain_buffers: bool) -> None:
    layers = [Masked(i).to(device) for i in range(3)]
    ref = copy.deepcopy(layers)
    x = torch.randn(ROWS, FEATURES, device=device)
    mask = _mask(0, device)
    with torch.no_grad():
        graphed = gograph.make_graphed_callables(
            tuple(layers), tuple((x, mask) for _ in range(3)), chain_buffers=chain_buffers
        )
    h = r = torch.randn(ROWS, FEATURES, device=device)
    for k, (g, m) in enumerate(zip(graphed, ref)):
        mask_k = _mask(10 + k, device)  # another mask per layer, while earlier layers' outputs are live
        h, r = g(h, mask_k), m(r, mask_k)
    assert torch.equal(h, r.detach())


def _mixed(device: str) -> tuple[tuple[torch.nn.Module, ...], torch.Tensor]:
    """Layer 0 trains (its input requires grad); layer 1 is frozen and fed a plain tensor, so it
    has no backward. Both were graphed with one mask sample."""
    trained, frozen = Masked(0).to(device), Masked(1).to(device)
    frozen.requires_grad_(False)
    mask = _mask(0, device)
    x_trained = torch.randn(ROWS, FEATURES, device=device, requires_grad=True)
    x_frozen = torch.randn(ROWS, FEATURES, device=device)
    gograph.make_graphed_callables((trained, frozen), ((x_trained, mask), (x_frozen, mask)))
    return (trained, frozen), mask


@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_only_sharer_never_waits(device: str) -> None:
    (trained, frozen), _ = _mixed(device)
    assert trained.forward.shared_inputs == frozen.forward.shared_inputs == frozenset({1})
    frozen(torch.randn(ROWS, FEATURES, device=device), _mask(3, device))  # it has no backward to wait for
    x = torch.randn(ROWS, FEATURES, device=device, requires_grad=True)
    y = trained(x, _mask(4, device))  # other contents than the frozen layer's call: nothing waits
    y.sum().backward()
    ref = Masked(0).to(device)
    ref(x.detach().requires_grad_(), _mask(4, device)).sum().backward()
    assert torch.equal(trained.fc.weight.grad, ref.fc.weight.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_a_sharer_with_a_pending_backward_still_refuses_other_contents(device: str) -> None:
    (trained, frozen), _ = _mixed(device)
    y = trained(torch.randn(ROWS, FEATURES, device=device, requires_grad=True), _mask(5, device))
    with pytest.raises(gograph.SharedInputError, match=r"whose backward has not run yet"):
        frozen(torch.randn(ROWS, FEATURES, device=device), _mask(6, device))
    frozen(torch.randn(ROWS, FEATURES, device=device), _mask(5, device))  # the same contents pass
    y.sum().backward()
    frozen(torch.randn(ROWS, FEATURES, device=device), _mask(6, device))  # the backward ran
