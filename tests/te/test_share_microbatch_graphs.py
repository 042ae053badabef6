"""``share_microbatch_graphs``: the microbatches of a layer that an ``_order`` never has in flight
together replay one set of graphs.

The core colours each layer's passes over the schedule (internal/lifetime share.go); the first
pass of a colour captures, the others replay its graphs with its static buffers. What a user sees:
one graphed callable per (chunk, microbatch, layer) as before, fewer captures (the layer's
in-flight depth, not the microbatch count), the same training bitwise, a clear error when the
schedule's order is not kept, and reset semantics for callables that share graphs.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch

import gograph
from gograph import megatron_order

from te_models import Block, DelayedLinear, init_grads, run_pipeline

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
F = 8
ONE_F_ONE_B = [1, 1, -1, 1, -1, 1, -1, -1]  # two stages, rank 0: two microbatches in flight


def _layers(device: str, n: int = 2, dropout: bool = False) -> list[torch.nn.Module]:
    mods: list[torch.nn.Module] = []
    for i in range(n):
        block: torch.nn.Module = Block(F, seed=10 + i)
        if dropout:
            block = torch.nn.Sequential(block, torch.nn.Dropout(0.3))
        mods.append(block.to(device))
    return mods


def _graph(layers: list[torch.nn.Module], order: list[float], per_chunk: list[int], micro: int, **kw: Any) -> Any:
    samples = tuple(
        (torch.randn(4, F, device=next(layers[0].parameters()).device, requires_grad=True),)
        for _ in range(len(layers) * micro)
    )
    return gograph.make_graphed_callables(tuple(layers), samples, _order=order, _num_layers_per_chunk=per_chunk, **kw)


def _train(calls: Any, order: list[float], per_chunk: list[int], micro: int, steps: int, device: str) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        inputs = {
            (c, m): torch.randn(4, F, generator=gen).to(device).requires_grad_()
            for c in range(len(per_chunk))
            for m in range(micro)
        }
        dys = {(c, m): torch.randn(4, F, generator=gen).to(device) for c in range(len(per_chunk)) for m in range(micro)}
        run_pipeline(order, per_chunk, micro, calls, inputs, dys, chain=True)


def _grads(mods: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p.grad.clone() for m in mods for p in m.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout", [False, True])
def test_1f1b_captures_the_in_flight_depth_and_trains_as_eager(device: str, dropout: bool, no_tf32: None) -> None:
    micro, per_chunk = 4, [2]
    shared, separate, eager = _layers(device, dropout=dropout), None, None
    separate = copy.deepcopy(shared)
    eager = copy.deepcopy(shared)
    for m in (shared, separate, eager):
        init_grads(*m)
    g_shared = _graph(shared, ONE_F_ONE_B, per_chunk, micro, share_microbatch_graphs=True)
    g_separate = _graph(separate, ONE_F_ONE_B, per_chunk, micro)
    assert len(g_shared) == len(g_separate) == 2 * micro  # one callable per (microbatch, layer), as TE's
    assert len({g.pass_id for g in g_shared}) == 2 * 2  # two in flight x two layers
    assert len(g_shared[0].build_stats.captures) == 2 * 2 * 2  # forward + backward per colour
    assert len(g_separate[0].build_stats.captures) == 2 * micro * 2
    assert gograph.memory_report(g_shared).totals.graphs == 2 * 2 * 2  # each set counted once
    for calls in (g_shared, g_separate):
        torch.manual_seed(3)
        _train(lambda p, x, calls=calls: calls[p](x), ONE_F_ONE_B, per_chunk, micro, 2, device)
    torch.manual_seed(3)
    _train(lambda p, x: eager[p % 2](x), ONE_F_ONE_B, per_chunk, micro, 2, device)
    assert all(torch.equal(a, b) for a, b in zip(_grads(shared), _grads(separate)))
    assert all(torch.equal(a, b) for a, b in zip(_grads(shared), _grads(eager)))


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_with_weight_gradient_entries(device: str, no_tf32: None) -> None:
    chunks, micro = 2, 4
    order: list[float] = []
    for e in megatron_order(2, 0, chunks, micro):  # each backward followed by its weight-gradient entry
        order.append(e)
        if e < 0:
            order.append(e - 0.5)
    shared = [DelayedLinear(F, seed=s).to(device) for s in range(chunks)]
    eager = copy.deepcopy(shared)
    init_grads(*shared, *eager)
    graphed = _graph(shared, order, [1] * chunks, micro, share_microbatch_graphs=True)
    assert len({g.pass_id for g in graphed}) < len(graphed)
    inputs = {(c, m): torch.randn(4, F, device=device).requires_grad_() for c in range(chunks) for m in range(micro)}
    dys = {(c, m): torch.randn(4, F, device=device) for c in range(chunks) for m in range(micro)}
    for m in shared:  # warmup's weight gradients out, in place: the weight-gradient graph writes these
        for p in m.parameters():
            p.grad.zero_()  # type: ignore[union-attr]
    run_pipeline(
        order,
        [1] * chunks,
        micro,
        lambda p, x: graphed[p](x),
        inputs,
        dys,
        chain=True,
        wgrad=lambda p: graphed[p].backward_dw(),
    )
    run_pipeline(
        order,
        [1] * chunks,
        micro,
        lambda p, x: eager[p // micro](x),
        inputs,
        dys,
        chain=True,
        wgrad=lambda p: eager[p // micro].backward_dw(),
    )
    assert all(torch.equal(a, b) for a, b in zip(_grads(shared), _grads(eager)))


def test_a_forward_out_of_the_schedule_order_is_refused() -> None:
    layers = _layers("cpu")
    graphed = _graph(layers, ONE_F_ONE_B, [2], 4, share_microbatch_graphs=True)
    assert graphed[4].pass_id == graphed[0].pass_id  # microbatch 2 replays microbatch 0's graphs
    y = graphed[1](graphed[0](torch.randn(4, F, requires_grad=True)))
    refused = r"microbatch 2\].*replays the graphs of .*microbatch 0\].*backward has not run"
    with pytest.raises(RuntimeError, match=refused):
        graphed[4](torch.randn(4, F, requires_grad=True))
    with torch.no_grad(), pytest.raises(RuntimeError, match="backward has not run"):
        graphed[4](torch.randn(4, F))  # an evaluation forward would overwrite the saved activations too
    y.sum().backward()
    graphed[5](graphed[4](torch.randn(4, F, requires_grad=True))).sum().backward()  # its turn now


def test_backward_dw_pending_blocks_the_next_member() -> None:
    mod = DelayedLinear(F, seed=1)
    init_grads(mod)
    order = [1, -1, -1.5, 1, -1, -1.5]
    graphed = _graph([mod], order, [1], 2, share_microbatch_graphs=True)
    assert graphed[1].pass_id == graphed[0].pass_id
    graphed[0](torch.randn(4, F, requires_grad=True)).sum().backward()
    with pytest.raises(RuntimeError, match=r"backward_dw\(\) has not run"):
        graphed[1](torch.randn(4, F, requires_grad=True))
    graphed[0].backward_dw()
    graphed[1](torch.randn(4, F, requires_grad=True)).sum().backward()
    graphed[1].backward_dw()


def test_reset_releases_the_graphs_with_the_last_member() -> None:
    passes = gograph.live_passes()
    layers = _layers("cpu", n=1)
    graphed = _graph(layers, [1, -1, 1, -1, 1, -1], [1], 3, share_microbatch_graphs=True)
    assert len({g.pass_id for g in graphed}) == 1 and gograph.live_passes() == passes + 1
    graphed[0].reset()
    with pytest.raises(RuntimeError, match=r"graphed callable 0 .* was reset"):
        graphed[0](torch.randn(4, F, requires_grad=True))
    graphed[1](torch.randn(4, F, requires_grad=True)).sum().backward()  # the others still replay
    assert graphed[0].is_reset and graphed[2].state == "ready"  # the core's pass still serves them
    graphed[1].reset()
    graphed[2].reset()
    assert graphed[2].state == "reset"  # the last reset released the graphs
    with pytest.raises(RuntimeError, match="was reset"):
        graphed[2](torch.randn(4, F, requires_grad=True))
    del graphed
    gc.collect()
    assert gograph.live_passes() == passes


def test_an_inference_order_shares_one_graph_per_layer() -> None:
    layers = [m.eval() for m in _layers("cpu")]
    micro = 4
    graphed = _graph(layers, [1] * micro, [2], micro, share_microbatch_graphs=True)
    assert len({g.pass_id for g in graphed}) == 2
    assert len(graphed[0].build_stats.captures) == 2  # one forward per layer
    for m in range(micro):
        x = torch.randn(4, F)
        with torch.no_grad():
            assert torch.equal(graphed[2 * m + 1](graphed[2 * m](x)), layers[1](layers[0](x)))


def test_more_microbatches_capture_no_more_graphs() -> None:
    captures = []
    for micro in (4, 8, 16):
        layers = _layers("cpu")
        order = megatron_order(2, 0, 2, micro)
        graphed = _graph(layers + _layers("cpu"), order, [2, 2], micro, share_microbatch_graphs=True)
        captures.append(len(graphed[0].build_stats.captures))
        for g in graphed:
            g.reset()
    assert captures[0] == captures[1] == captures[2], captures


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs _order"),
        ({"chain_buffers": True}, "cannot be combined with chain_buffers"),
        ({"clone_param_grads_on_return": False}, "needs clone_param_grads_on_return=True"),
        ({"share_microbatch_graphs": 1}, "must be a bool"),
    ],
)
def test_what_cannot_share_is_refused(options: dict[str, Any], message: str) -> None:
    layers = _layers("cpu", n=1)
    kw: dict[str, Any] = {"share_microbatch_graphs": True, **options}
    samples = tuple((torch.randn(4, F, requires_grad=True),) for _ in range(2))
    if (
        "_reuse_graph_input_output_buffers" in options
        or "chain_buffers" in options
        or "clone" in str(options)
        or (options.get("share_microbatch_graphs") == 1)
    ):
        kw.update(_order=[1, -1, 1, -1], _num_layers_per_chunk=[1])
    else:
        samples = samples[:1]
    with pytest.raises((ValueError, TypeError), match=message):
        gograph.make_graphed_callables(tuple(layers), samples, **kw)
