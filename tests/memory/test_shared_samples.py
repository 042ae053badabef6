"""Sample args whose memory is shared -- one tensor passed as the sample of several callables,
views of one tensor, the same tensor twice in one callable, a parameter as a sample -- on the
eager engine. torch uses each sample as its graph's static input, so there one static buffer is
read by several graphs and a later copy-in silently changes what an earlier forward's pending
backward reads. gograph's planner gives a buffer of its own to every leaf that requires grad and
whose memory another live pass reads (by the schedule; passes run one after another keep
sharing), to a second leaf of one callable, and to any sample that overlaps a parameter, so these
train bitwise like eager; a shared mask (no grad) stays one buffer, as in torch. (The CUDA counterparts are in
test_shared_samples_cuda.py.)"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import gograph

from helpers import Masked, params_equal

FEATURES = 8


class Layer(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Pair(torch.nn.Module):
    """Reads two inputs (the same tensor twice in its samples)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.fc = torch.nn.Linear(FEATURES, FEATURES)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fc(a) * b


def _one_sample(n: int, device: str = "cpu") -> tuple[tuple[torch.Tensor], ...]:
    x = torch.randn(4, FEATURES, device=device, requires_grad=True)
    return tuple((x,) for _ in range(n))


def _view_samples(n: int, device: str = "cpu") -> tuple[tuple[torch.Tensor], ...]:
    x = torch.randn(4, FEATURES, device=device, requires_grad=True)
    return tuple((x.detach().requires_grad_(),) for _ in range(n))


SAMPLES = {"one tensor": _one_sample, "views": _view_samples}


def _train(calls: Sequence[Callable[..., Any]], layers: Sequence[torch.nn.Module], set_to_none: bool) -> None:
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for _ in range(2):  # two micro-batches: forwards of all layers, then backwards
            x = torch.randn(4, FEATURES, generator=gen).requires_grad_()
            for c in calls:
                x = c(x)
            x.square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("samples", sorted(SAMPLES))
@pytest.mark.parametrize("chain", [False, True])
def test_layers_sharing_one_sample_train_bitwise_eager(samples: str, set_to_none: bool, chain: bool) -> None:
    layers = [Layer(i) for i in range(3)]
    ref = copy.deepcopy(layers)
    graphed = gograph.make_graphed_callables(tuple(layers), SAMPLES[samples](3), chain_buffers=chain)
    _train(graphed, layers, set_to_none)
    _train(ref, ref, set_to_none)
    assert all(params_equal(a, b) for a, b in zip(layers, ref))
    for g in graphed:
        g.forward.reset()


def test_only_later_occurrences_get_a_buffer_of_their_own() -> None:
    samples = _one_sample(3)
    x = samples[0][0]
    graphed = gograph.make_graphed_callables(tuple(Layer(i) for i in range(3)), samples)
    statics = [g.forward.static_input_surface[0] for g in graphed]
    assert statics[0] is x  # the first keeps the caller's sample, as torch's would
    ptrs = {s.data_ptr() for s in statics}
    assert len(ptrs) == 3 and all(s.requires_grad for s in statics)
    out = graphed[0](x)  # called with its own static input: nothing copied, nothing changed
    assert out.shape == (4, FEATURES)
    for g in graphed:
        g.forward.reset()


def test_chained_view_samples_need_no_buffer_of_their_own() -> None:
    samples = _view_samples(3)
    graphed = gograph.make_graphed_callables(tuple(Layer(i) for i in range(3)), samples, chain_buffers=True)
    first = graphed[0].forward.static_input_surface[0]
    assert first is samples[0][0]
    for prev, g in itertools.pairwise(graphed):
        assert g.forward.static_input_surface[0].data_ptr() == prev.forward.static_outputs[0].data_ptr()
    for g in graphed:
        g.forward.reset()


def test_the_same_sample_twice_in_one_callable() -> None:
    pair = Pair()
    ref = copy.deepcopy(pair)
    x = torch.randn(4, FEATURES, requires_grad=True)
    graphed = gograph.make_graphed_callables(pair, (x, x))
    a, b = torch.randn(4, FEATURES, requires_grad=True), torch.randn(4, FEATURES, requires_grad=True)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out, want = graphed(a, b), ref(a2, b2)
    assert torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)
    assert params_equal(pair, ref) and torch.equal(pair.fc.weight.grad, ref.fc.weight.grad)
    same = graphed(x, x)  # the caller's one tensor in both places still works
    assert torch.equal(same, ref(x, x))
    graphed.forward.reset() if isinstance(graphed, torch.nn.Module) else graphed.reset()


def test_a_parameter_as_a_sample_is_never_written() -> None:
    layer = Layer(0)

    def scale(w: torch.Tensor) -> torch.Tensor:
        return w * 2.0

    weight = layer.fc.weight
    before = weight.detach().clone()
    graphed = gograph.make_graphed_callables(scale, (weight,))
    assert graphed.static_input_surface[0] is not weight
    other = torch.randn_like(weight)
    assert torch.equal(graphed(other), other * 2.0)
    assert torch.equal(weight.detach(), before)  # the copy-in went to a buffer of its own
    graphed.forward.reset() if isinstance(graphed, torch.nn.Module) else graphed.reset()


def test_memory_report_counts_the_buffers_of_their_own() -> None:
    graphed = gograph.make_graphed_callables(tuple(Layer(i) for i in range(3)), _one_sample(3))
    report = gograph.memory_report(graphed)
    one = 4 * FEATURES * 4  # fp32 rows
    assert [p.static_input_bytes for p in report.passes] == [one] * 3
    assert report.totals.static_input_bytes == 3 * one  # three buffers, none of them shared
    # (what the passes share is their grad-output buffer: one slot for three backwards)
    assert [[h.split()[-1] for h in s.holders] for s in report.shared] == [["grad_output[0]"] * 3]
    assert [p.separated_inputs for p in report.passes] == [[], ["input[0]"], ["input[0]"]]
    assert "2 input(s) separated" in str(report)
    plan = gograph.plan_memory(tuple(Layer(i) for i in range(3)), _one_sample(3))
    assert [p.static_input_bytes for p in plan.passes] == [one] * 3
    assert plan.totals.new_buffer_bytes == 2 * one + one  # the two clones and the grad-output slot
    for g in graphed:
        g.forward.reset()


@pytest.mark.parametrize(
    ("order", "kept"),
    [
        ([1, -1, 1, -1, 1, -1], 3),  # one microbatch at a time: all three share (Megatron's reuse)
        ([1, 1, -1, 1, -1, -1], 2),  # microbatch 1 is in flight with 0: it gets a buffer of its own
    ],
)
def test_a_schedule_shares_samples_whose_passes_do_not_overlap(order: list[int], kept: int) -> None:
    layer = Layer(0)
    ref = copy.deepcopy(layer)
    x = torch.randn(4, FEATURES, requires_grad=True)
    graphs = gograph.make_graphed_callables(
        (layer,), ((x,),) * 3, _order=order, _reuse_graph_input_output_buffers=True, num_warmup_iters=1
    )
    assert sum(g.static_input_surface[0] is x for g in graphs) == kept
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, FEATURES, generator=gen) for _ in range(3)]
    for call, m in ((lambda m, v: graphs[m](v), layer), (lambda m, v: ref(v), ref)):
        pending, fwd, bwd = [], 0, 0
        for e in order:
            if e > 0:
                pending.append(call(fwd, xs[fwd].clone().requires_grad_()))
                fwd += 1
            else:
                pending[bwd].square().sum().backward()
                bwd += 1
        assert m.fc.weight.grad is not None
    assert torch.equal(layer.fc.weight.grad, ref.fc.weight.grad) and torch.equal(layer.fc.bias.grad, ref.fc.bias.grad)
    for g in graphs:
        g.reset()


def test_a_mask_shared_by_every_layer_stays_one_buffer() -> None:
    """An input that does not require grad (a mask, rotary embeddings) shared by the layers keeps
    one static buffer, as in torch: every layer of a step gets the same contents, and passing the
    sample itself copies nothing."""
    layers = [Masked(i) for i in range(3)]
    ref = copy.deepcopy(layers)
    mask = (torch.rand(4, FEATURES) > 0.3).float()
    x = torch.randn(4, FEATURES, requires_grad=True)
    graphed = gograph.make_graphed_callables(tuple(layers), tuple((x, mask) for _ in range(3)))
    assert all(g.forward.static_input_surface[1] is mask for g in graphed)
    assert len({g.forward.static_input_surface[0].data_ptr() for g in graphed}) == 3  # x: separated
    for calls in (graphed, ref):
        gen = torch.Generator().manual_seed(4)
        for _ in range(2):
            h = torch.randn(4, FEATURES, generator=gen).requires_grad_()
            for c in calls:
                h = c(h, mask)
            h.square().sum().backward()
    assert all(torch.equal(a.fc.weight.grad, b.fc.weight.grad) for a, b in zip(layers, ref))
    for g in graphed:
        g.forward.reset()


@pytest.mark.parametrize(("rows", "separated"), [((4, 8), False), ((2, 6), True)])
def test_views_share_only_when_their_bytes_overlap(rows: tuple[int, int], separated: bool) -> None:
    big = torch.randn(8, FEATURES)
    a = big[:4].requires_grad_()
    b = big[rows[0] : rows[1]].requires_grad_()  # rows 4..8: disjoint from a; rows 2..6: overlapping
    graphed = gograph.make_graphed_callables((Layer(0), Layer(1)), ((a,), (b,)))
    assert graphed[0].forward.static_input_surface[0] is a
    assert (graphed[1].forward.static_input_surface[0] is not b) == separated
    for g in graphed:
        g.forward.reset()


def test_the_build_says_what_it_separated(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="gograph"):
        graphed = gograph.make_graphed_callables(tuple(Layer(i) for i in range(3)), _one_sample(3))
    said = [r.getMessage() for r in caplog.records if "share memory" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("2 sample arg(s) of 2 pass(es) share memory")
    for g in graphed:
        g.forward.reset()
