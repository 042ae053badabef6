"""TransformerEngine extensions on the CUDA engine: what only a GPU shows (replay on a side
stream, pool memory handed back by buffer reuse, separate weight-gradient graphs). The schedule,
kwargs, hooks and validation tests of tests/te/test_te_schedule.py also run here, parametrized
with a ``cuda`` device."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import gograph
from gograph.core import _native

from te_models import Block, DelayedLinear, init_grads

pytestmark = pytest.mark.cuda

ORDER_2x1x3 = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def test_replay_on_cuda_graph_stream(cuda_device: torch.device) -> None:
    ref = Block(64, seed=0).to(cuda_device)
    mod = copy.deepcopy(ref)
    x = torch.randn(32, 64, device=cuda_device, requires_grad=True)
    gograph.make_graphed_callables(mod, (x,))
    side = torch.cuda.Stream(cuda_device)
    for _it in range(3):
        xv = torch.randn(32, 64, device=cuda_device)
        dy = torch.randn(32, 64, device=cuda_device)
        xr, xg = xv.clone().requires_grad_(), xv.clone().requires_grad_()
        out_r = ref(xr)
        out_g = mod(xg, cuda_graph_stream=side)  # forward and (via autograd) backward replay on `side`
        assert torch.equal(out_r, out_g)
        out_r.backward(dy)
        out_g.backward(dy)
        assert torch.equal(xr.grad, xg.grad)
    for p, q in zip(ref.parameters(), mod.parameters()):
        assert torch.equal(p.grad, q.grad)
    # With an event the current stream waits for that event instead of the whole side stream.
    event = torch.cuda.Event()
    event.record(side)
    out = mod(x, cuda_graph_stream=side, cuda_graph_event=event)
    torch.cuda.synchronize(cuda_device)
    assert torch.equal(out, ref(x))
    mod.reset()


def _retained_bytes(device: torch.device, reuse: bool) -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    mods = tuple(Block(512, seed=i).to(device) for i in range(2))
    samples = tuple((torch.randn(1024, 512, device=device, requires_grad=True),) for _ in range(6))
    graphed = gograph.make_graphed_callables(
        mods, samples, num_warmup_iters=1, _order=ORDER_2x1x3, _reuse_graph_input_output_buffers=reuse
    )
    del samples
    gc.collect()
    torch.cuda.synchronize(device)
    retained = torch.cuda.memory_allocated(device) - base
    # the graphs still compute correctly
    x = torch.randn(1024, 512, device=device, requires_grad=True)
    out = graphed[0](x)
    expected = mods[0](x)
    assert torch.equal(out, expected)
    del x, out, expected  # an input, an output alias and an eager result with its autograd graph
    for g in graphed:
        g.reset()
    del graphed, mods
    gc.collect()
    torch.cuda.synchronize(device)
    return retained, torch.cuda.memory_allocated(device) - base


def test_buffer_reuse_retains_less_memory(cuda_device: torch.device) -> None:
    _retained_bytes(cuda_device, reuse=False)  # first use of the side stream: cuBLAS workspace etc.
    plain, plain_after = _retained_bytes(cuda_device, reuse=False)
    reused, reused_after = _retained_bytes(cuda_device, reuse=True)
    # 6 sample inputs (2 MiB each) kept as 4 slots; grad outputs 6 -> 1 slot; outputs, input and
    # parameter grads handed back to the pool once dead.
    assert reused < plain, (reused, plain)
    assert plain_after < 1 << 20 and reused_after < 1 << 20, "reset + delete must return everything"


def test_delayed_wgrad_is_its_own_graph(cuda_device: torch.device) -> None:
    mod = DelayedLinear(64, seed=1).to(cuda_device)
    init_grads(mod)
    x = torch.randn(16, 64, device=cuda_device, requires_grad=True)
    gograph.make_graphed_callables(mod, (x,))
    gc_ = mod.forward
    assert _native.core.pass_graph(gc_.pass_id, 2) != 0  # kind 2: wgrad
    graphs = gograph.live_graphs()
    mod.weight.grad.zero_()
    mod(x).sum().backward()
    assert torch.count_nonzero(mod.weight.grad) == 0
    mod.backward_dw()
    torch.cuda.synchronize(cuda_device)
    assert torch.count_nonzero(mod.weight.grad) > 0
    assert not mod._stash, "replays do not touch the module's Python state"
    mod.reset()
    assert gograph.live_graphs() == graphs - 3
    with pytest.raises(RuntimeError, match="was reset"):
        mod.backward_dw()
    assert gograph.live_graphs() == graphs - 3


def test_order_without_options_hands_param_grads_back(cuda_device: torch.device) -> None:
    """On a device pool an ``_order`` build without options keeps no parameter-grad buffer per
    microbatch pass: each goes back to the pool after its backward (the grads reach ``.grad`` as
    owned copies, or added by AccumulateGrad), and training stays exact (the bitwise pipeline
    tests above run this build too)."""
    mods = tuple(Block(64, seed=i).to(cuda_device) for i in range(2))
    ref = copy.deepcopy(mods[0])
    samples = tuple((torch.randn(32, 64, device=cuda_device, requires_grad=True),) for _ in range(6))
    graphed = gograph.make_graphed_callables(mods, samples, num_warmup_iters=1, _order=ORDER_2x1x3)
    report = gograph.memory_report(graphed)
    for p in report.passes:
        assert p.param_grad_bytes > 0 and p.pool_planned_bytes == p.param_grad_bytes, p
        assert p.lent_param_grads == 0
    for q in mods[0].parameters():
        q.grad = None
    x = torch.randn(32, 64, device=cuda_device, requires_grad=True)
    graphed[0](x).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    for p, q in zip(ref.parameters(), mods[0].parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(x.grad, x2.grad)
    for g in graphed:
        g.reset()
