"""An argument that requires grad where its sample did not: the forward runs, the backward refuses.

A graph's backward computes gradients only for the sample args that required grad at capture.
Called with such an argument requiring grad, a graphed callable runs its forward as eagerly (its
outputs require grad where eager's would) and raises only when a backward asks for the gradient
the graph cannot give -- never at the forward (PyTorch's own
``test_graph_make_graphed_callables_parameterless_nograd_module`` calls a parameterless module so
and never runs a backward), and never by dropping that gradient silently.
"""

from __future__ import annotations

import pytest
import torch

import gograph

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
UNGRAPHED = r"argument leaf 0 of graphed callable 0 \(.*\) requires grad, but its sample arg did not"


class Gather(torch.nn.Module):
    """No parameters; a dict in, a dict out; reads ``x`` only (``unused`` reaches no output)."""

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = inputs["x"]
        rows = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, rows)}


def _gather_graphed(device: str, with_amp: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    graphed, control = torch.nn.Sequential(Gather()).to(device), torch.nn.Sequential(Gather()).to(device)
    x = torch.randn(64, 32, device=device)  # needs no grad
    unused = torch.randn(64, 16, device=device, requires_grad=True)
    with torch.autocast(device_type=device, enabled=with_amp, cache_enabled=False):
        gograph.make_graphed_callables(graphed, ({"x": x, "unused_input": unused},), allow_unused_input=True)
    return graphed, control


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_amp", [False, True])
def test_a_parameterless_module_runs_with_inputs_that_require_grad(device: str, with_amp: bool) -> None:
    graphed, control = _gather_graphed(device, with_amp)
    torch.manual_seed(5)
    batches = [
        {"x": torch.rand(64, 32, device=device, requires_grad=True), "unused_input": torch.rand(64, 16, device=device)}
        for _ in range(3)
    ]
    for data in batches:
        with torch.autocast(device_type=device, enabled=with_amp, cache_enabled=False):
            out, ref = graphed(data), control(data)
        assert torch.equal(out["output"], ref["output"])
        assert out["output"].requires_grad == ref["output"].requires_grad  # as eager's
    graphed.eval()
    control.eval()
    assert torch.equal(graphed(batches[0])["output"], control(batches[0])["output"])  # eval runs ungraphed


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_that_needs_the_missing_grad_raises(device: str) -> None:
    graphed, _ = _gather_graphed(device, with_amp=False)
    x = torch.rand(64, 32, device=device, requires_grad=True)
    out = graphed({"x": x, "unused_input": torch.rand(64, 16, device=device)})
    with pytest.raises(RuntimeError, match=UNGRAPHED):
        out["output"].sum().backward()
    assert x.grad is None
    graphed.forward.reset()  # a failed CUDA backward's task may hold the node until autograd's next one


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_trains_its_weights_while_an_input_it_has_no_grad_for_requires_grad(device: str, no_tf32: None) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).to(device)
    ref = torch.nn.Linear(8, 8).to(device)
    ref.load_state_dict(layer.state_dict())
    gograph.make_graphed_callables(layer, (torch.randn(4, 8, device=device),))
    x = torch.randn(4, 8, device=device, requires_grad=True)  # e.g. an embedding's output

    # a gradient nobody asks for is not refused: torch.autograd.grad of the weight alone. (Losses
    # with a dense output grad: sum()'s is an expanded tensor, which eager's matmul reads with
    # stride 0 and a graph reads from its static grad buffer, another cuBLAS kernel on CUDA.)
    (gw,) = torch.autograd.grad(layer(x).square().sum(), [layer.weight])
    (rw,) = torch.autograd.grad(ref(x).square().sum(), [ref.weight])
    assert torch.equal(gw, rw)

    # loss.backward() asks for x's gradient, which the graph cannot give: refused, never dropped
    with pytest.raises(RuntimeError, match=UNGRAPHED):
        layer(x).sum().backward()
    assert x.grad is None

    # without grad on x (detached, or under no_grad) nothing is asked of the graph
    layer(x.detach()).square().sum().backward()
    ref(x.detach()).square().sum().backward()
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    layer.forward.reset()
