"""torch.cuda.make_graphed_callables parity on the eager engine (CPU): release points, RNG
state, pools, pytree args."""
from __future__ import annotations

import gc

import pytest
import torch

import gograph

from helpers import make_mlp, twin
from parity_models import OutputRecorder, two_blocks


def test_warmup_outputs_released_before_the_next_warmup_iteration():
    rec = OutputRecorder()
    gograph.make_graphed_callables(rec, (torch.randn(4, 8, requires_grad=True),), num_warmup_iters=3)
    # three warmup forwards, then the capture forward: none saw an earlier output alive
    assert rec.alive_at_call == [0, 0, 0, 0]
    assert all(r() is None for r in rec.refs[:3])
    rec.reset()


def test_eval_mode_warmup_outputs_released_even_when_inputs_require_grad():
    rec = OutputRecorder().eval()
    gograph.make_graphed_callables(rec, (torch.randn(4, 8, requires_grad=True),), num_warmup_iters=3)
    assert rec.alive_at_call == [0, 0, 0, 0]
    assert all(r() is None for r in rec.refs[:3])
    assert rec.forward.has_backward is False
    rec.reset()


def test_rng_state_after_graphing_equals_state_before():
    model = make_mlp(dropout=0.5)
    sample = torch.randn(4, 8)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    gograph.make_graphed_callables(model, (sample,))
    assert torch.equal(torch.get_rng_state(), before)
    model.reset()


def test_pool_shared_between_calls_and_torch_style_pool_tokens():
    pool = gograph.graph_pool_handle()
    a, b = make_mlp(seed=1), make_mlp(seed=2)
    ra, rb = twin(a), twin(b)
    gograph.make_graphed_callables(a, (torch.randn(2, 8),), pool=pool)
    gograph.make_graphed_callables(b, (torch.randn(2, 4 * 2),), pool=pool)
    assert a.forward.pool is pool and b.forward.pool is pool
    x = torch.randn(2, 8)
    assert torch.equal(a(x), ra(x)) and torch.equal(b(x), rb(x))
    a.reset()
    assert torch.equal(b(x), rb(x))  # resetting one call's callable leaves the other working
    b.reset()


def test_dict_inputs_dropout_two_callables_ten_steps_bitwise_equal():
    head, tail = two_blocks(16, 4, p=0.25, device="cpu")
    ref_head, ref_tail = twin(head), twin(tail)
    x = torch.randn(8, 16)
    shift = torch.randn(8, 16)
    h = torch.randn(8, 16, requires_grad=True)
    gograph.make_graphed_callables((head, tail), (({"x": x, "shift": shift},), (h,)))
    params = list(head.parameters()) + list(tail.parameters())
    ref_params = list(ref_head.parameters()) + list(ref_tail.parameters())
    opt, ref_opt = torch.optim.SGD(params, lr=0.05), torch.optim.SGD(ref_params, lr=0.05)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(10)]
    for (hd, tl, o), seed in ((head, tail, opt), 11), ((ref_head, ref_tail, ref_opt), 11):
        torch.manual_seed(seed)
        for xi, si, yi in data:
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(tl(hd({"x": xi, "shift": si})), yi)
            loss.backward()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    head.reset()
    tail.reset()
    del head, tail
    gc.collect()


def test_create_graph_backward_gives_grads_and_refuses_double_backward():
    """backward(create_graph=True) through a graphed callable returns the same grads as without
    it, and differentiating those grads again raises (the graph's backward is once-differentiable,
    as torch's graphed callables are)."""
    model = make_mlp(seed=3)
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8, requires_grad=True),))
    x = torch.randn(4, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    xr = x.detach().requires_grad_()
    (gr,) = torch.autograd.grad(ref(xr).square().sum(), xr)
    assert torch.equal(gx, gr)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()
    model.reset()


def test_graphed_call_under_vmap_takes_torch_path_and_refuses():
    """Under a functorch transform the call goes through torch.autograd.Function.apply, which
    refuses a Function without setup_context (as for torch's graphed callables) instead of
    replaying on batched tensors."""
    model = make_mlp(seed=4)
    gograph.make_graphed_callables(model, (torch.randn(4, 8),))
    with pytest.raises(RuntimeError, match="setup_context|functorch"):
        torch.func.vmap(model)(torch.randn(3, 4, 8))
    model.reset()
