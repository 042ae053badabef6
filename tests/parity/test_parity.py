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
    # an eval module under grad mode is differentiable, as eagerly: its outputs die at its backward
    rec = OutputRecorder().eval()
    gograph.make_graphed_callables(rec, (torch.randn(4, 8, requires_grad=True),), num_warmup_iters=3)
    assert rec.alive_at_call == [0, 0, 0, 0]
    assert all(r() is None for r in rec.refs[:3])
    assert rec.forward.has_backward is True
    rec.reset()


def test_no_grad_warmup_outputs_released_at_once():
    rec = OutputRecorder().eval()
    with torch.no_grad():
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
    # Forwards whose backward never runs: the debug replay-order guard would refuse them by design.
    gograph.make_graphed_callables(a, (torch.randn(2, 8),), pool=pool, debug_replay_order=False)
    gograph.make_graphed_callables(b, (torch.randn(2, 4 * 2),), pool=pool, debug_replay_order=False)
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
    data = [
        (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        for _ in range(10)
    ]
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


# -- the build's backward calls (_bodies.autograd_grad) ------------------------------------------
class _Subclass(torch.Tensor):
    """A tensor subclass: it carries torch's default __torch_function__, so it is dispatchable."""


class _RecordingMode(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def small_graph():
    """outputs (y,) of x -> tanh(x @ w) with an unused parameter u, and a grad buffer like y."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    u = torch.randn(2, requires_grad=True)

    def build():
        y = torch.tanh(x @ w)
        return (y,), torch.randn_like(y)

    return build, x, w, u


@pytest.mark.parametrize("retain_graph", [False, True])
def test_build_backward_equals_torch_autograd_grad(small_graph, retain_graph):
    from gograph.runtime import _bodies

    build, x, w, u = small_graph
    outs, g = build()
    expected = torch.autograd.grad(outs, (x, w, u), (g,), allow_unused=True, retain_graph=True)
    got = _bodies.autograd_grad(outs, (x, w, u), (g,), True, retain_graph)
    assert got[2] is None and expected[2] is None
    assert all(torch.equal(a, b) for a, b in zip(got[:2], expected[:2]))
    if retain_graph:  # the graph is still there for a second backward
        assert torch.equal(_bodies.autograd_grad(outs, (x,), (g,), False)[0], expected[0])
    else:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            _bodies.autograd_grad(outs, (x,), (g,), False)


def test_build_backward_raises_torchs_errors(small_graph):
    from gograph.runtime import _bodies

    build, x, _w, u = small_graph
    outs, g = build()
    with pytest.raises(RuntimeError) as torch_error:
        torch.autograd.grad(outs, (x, u), (g,), retain_graph=True)
    with pytest.raises(RuntimeError) as ours:
        _bodies.autograd_grad(outs, (x, u), (g,), False, True)
    assert str(ours.value.__cause__) == str(torch_error.value)  # the engine's own error, chained
    assert "appears to not have been used in the graph" in str(ours.value)
    # said with gograph's option and the input it is about, not autograd's allow_unused
    assert "a sample arg of shape (2,) does not reach the outputs" in str(ours.value)
    assert "allow_unused_input=True" in str(ours.value) and "allow_unused=" not in str(ours.value)


@pytest.mark.parametrize("case", ["plain", "subclass", "mode", "autograd-debug-log"])
def test_build_backward_takes_torch_autograd_grad_unless_plain(small_graph, monkeypatch, case):
    """The engine is called directly only for plain tensors without torch function modes and with
    autograd's debug logging off; everything else keeps torch.autograd.grad's dispatch."""
    import logging

    from gograph.runtime import _bodies
    from gograph.support import _torch

    build, x, w, _u = small_graph
    engine_calls = []
    real = _torch.run_backward

    def counting(*args, **kwargs):
        engine_calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_torch, "run_backward", counting)
    outs, g = build()
    inputs = (x, w)
    mode = _RecordingMode() if case == "mode" else None
    if case == "subclass":
        g = g.as_subclass(_Subclass)
    if case == "autograd-debug-log":
        monkeypatch.setattr(logging.getLogger("torch.autograd.graph"), "level", logging.DEBUG)
    expected = torch.autograd.grad(outs, inputs, (g,), retain_graph=True)
    if mode is not None:
        with mode:
            got = _bodies.autograd_grad(outs, inputs, (g,), False)
        assert mode.calls > 0  # the mode saw torch.autograd.grad
    else:
        got = _bodies.autograd_grad(outs, inputs, (g,), False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert (len(engine_calls) == 1) == (case == "plain")


def test_eager_engine_takes_torch_cuda_pool_tokens():
    """On a machine with CUDA, graph_pool_handle() returns torch's (int, int) token; calls run by
    the eager engine (CPU modules) share a pool through it as they would through an EagerPool."""
    token = (0, 987654)
    a, b = make_mlp(seed=1), make_mlp(seed=2)
    for m in (a, b):
        gograph.make_graphed_callables(m, (torch.randn(2, 8, requires_grad=True),), pool=token, engine="eager")
    engine = a.forward.engine
    assert a.forward.pool == token and b.forward.engine is engine
    assert engine.pool_refs(token) == 4  # forward and backward graphs of both calls
    a.reset()
    assert engine.pool_refs(token) == 2
    b.reset()
    assert engine.pool_refs(token) == 0
    with pytest.raises(TypeError, match="pool must be a token"):
        gograph.make_graphed_callables(make_mlp(), (torch.randn(2, 8),), pool=(0, "x"), engine="eager")
