"""Hardening: user mistakes at make_graphed_callables and at replay come back as errors that say
what was wrong and what to do, with no side effects (no pass, no pool reference, no replaced
forward, generator state untouched). CPU (eager engine) unless marked ``cuda``."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch

import gograph
from gograph.engines import EagerEngine

from helpers import make_mlp, twin

mgc = gograph.make_graphed_callables


class _NoSideEffects:
    """Records what a failed make_graphed_callables must leave untouched."""

    def __init__(self, *modules: torch.nn.Module) -> None:
        gc.collect()
        self.passes = gograph.live_passes()
        self.graphs = gograph.live_graphs()
        self.rng = torch.get_rng_state()
        self.modules = [(m, m.__dict__.get("forward")) for m in modules]

    def check(self) -> None:
        gc.collect()
        assert gograph.live_passes() == self.passes, "a failed call left a pass record behind"
        assert gograph.live_graphs() == self.graphs, "a failed call left a graph behind"
        assert torch.equal(torch.get_rng_state(), self.rng), "a failed call moved the generator"
        for m, fwd in self.modules:
            assert m.__dict__.get("forward") is fwd, "a failed call replaced a module's forward"
            assert not isinstance(m.forward, gograph.GraphedCallable) or fwd is not None


# ---------------------------------------------------------------------------------------------
# make_graphed_callables arguments
# ---------------------------------------------------------------------------------------------
def test_empty_callables_tuple_is_refused():
    probe = _NoSideEffects()
    with pytest.raises(ValueError, match="empty tuple of callables.*pass a module or function"):
        mgc((), ())
    probe.check()


def test_list_of_callables_is_refused_with_a_hint():
    m = make_mlp()
    x = torch.randn(2, 8)
    probe = _NoSideEffects(m)
    with pytest.raises(TypeError, match=r"callable 0 is a list.*tuple\(\.\.\.\)"):
        mgc([m], ((x,),))
    probe.check()


def test_non_callable_is_refused():
    with pytest.raises(TypeError, match=r"callable 1 \(of type int\) is not callable"):
        mgc((lambda a: a * 2, 3), ((torch.randn(2),), (torch.randn(2),)))


@pytest.mark.parametrize("n_args", [1, 3])
def test_mismatched_lengths(n_args):
    fns = (lambda a: a * 2, lambda a: a * 3)
    with pytest.raises(ValueError, match=f"one tuple of args per callable \\(2 callables, got {n_args}\\)"):
        mgc(fns, tuple((torch.randn(2),) for _ in range(n_args)))
    with pytest.raises(ValueError, match="one tuple of args per callable"):
        mgc(fns, [(torch.randn(2),), (torch.randn(2),)])  # a list, not a tuple


@pytest.mark.parametrize("bad", [3, 2.5, "x", None, [1, 2]])
def test_non_tensor_leaves_name_the_leaf_and_the_fix(bad):
    x = torch.randn(2)
    probe = _NoSideEffects()
    with pytest.raises(AssertionError) as info:
        mgc(lambda a, b: a * 2, (x, bad))
    msg = str(info.value)
    assert "must contain only Tensors" in msg  # torch's message first (drop-in)
    assert "callable 0" in msg and "functools.partial" in msg
    probe.check()


def test_non_tensor_leaf_inside_a_pytree():
    with pytest.raises(AssertionError, match=r"leaf 1 of the sample args of callable 1 .* is a str"):
        mgc((lambda a: a * 2, lambda d: d["a"]), ((torch.randn(2),), ({"a": torch.randn(2), "b": "label"},)))


def test_modules_mixing_train_and_eval_are_accepted_per_callable():
    """As torch's make_graphed_callables: each callable keeps its mode (an eval layer's forward is
    its eval forward) and, under grad mode, gets a backward (its parameters require grad)."""
    m0, m1, m2 = make_mlp(seed=0), make_mlp(seed=1, d_in=4, dropout=0.5).eval(), make_mlp(seed=2, d_in=4)
    refs = [copy.deepcopy(m) for m in (m0, m1, m2)]
    args = ((torch.randn(2, 8),), (torch.randn(2, 4),), (torch.randn(2, 4),))
    mgc((m0, m1, m2), args)
    assert [m.forward.has_backward for m in (m0, m1, m2)] == [True, True, True]
    x = torch.randn(2, 4)
    assert torch.equal(m1(x), refs[1](x))  # eval: dropout off, as eagerly
    m1(x).square().sum().backward()
    refs[1](x).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(m1.parameters(), refs[1].parameters()))
    for m in (m0, m1, m2):
        m.reset()


def test_modules_mixing_train_and_eval_are_refused_with_order():
    """TransformerEngine's rule for its _order call shape: the modules all in one mode."""
    m0, m1 = make_mlp(seed=0, d_in=4, d_out=4), make_mlp(seed=1, d_in=4, d_out=4).eval()
    args = tuple((torch.randn(2, 4),) for _ in range(2))
    probe = _NoSideEffects(m0, m1)
    with pytest.raises(ValueError) as info:
        mgc((m0, m1), args, _order=[1, 2, -2, -1], _num_layers_per_chunk=[1, 1])
    msg = str(info.value)
    assert "all in training mode or all in" in msg and "[0] are training" in msg and "[1] are in eval" in msg
    assert ".train() or .eval()" in msg
    probe.check()


def test_same_module_twice_is_refused():
    m = make_mlp()
    args = ((torch.randn(2, 8),), (torch.randn(2, 8),))
    probe = _NoSideEffects(m)
    with pytest.raises(ValueError, match="callable 1 is the same module as callable 0.*separate copies"):
        mgc((m, m), args)
    probe.check()


def test_same_function_twice_is_fine():
    def f(a):
        return a * 2

    g1, g2 = mgc((f, f), ((torch.randn(2),), (torch.randn(3),)))
    assert torch.equal(g1(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(g2(torch.ones(3)), torch.full((3,), 2.0))


def test_live_graphed_module_is_refused_and_reset_one_can_be_graphed_again():
    m = make_mlp()
    mgc(m, (torch.randn(2, 8),))
    first = m.forward
    with pytest.raises(ValueError, match=r"already graphed .* Call its reset\(\) first"):
        mgc(m, (torch.randn(2, 8),))
    assert m.forward is first and first.state == "ready"
    m.reset()
    mgc(m, (torch.randn(4, 8),))  # graphs the original forward again
    second = m.forward
    assert second is not first and second.state == "ready"
    ref = make_mlp()
    x = torch.randn(4, 8)
    assert torch.equal(m(x), ref(x))
    with pytest.raises(RuntimeError, match="was reset"):
        first(torch.randn(2, 8))


def test_graphed_callable_passed_as_a_callable_is_refused():
    g = mgc(lambda a: a * 2, (torch.randn(2),))
    with pytest.raises(TypeError, match="already a graphed callable; pass the original"):
        mgc(g, (torch.randn(2),))


@pytest.mark.parametrize("iters, exc", [(-1, ValueError), (1.5, TypeError), ("3", TypeError), (True, TypeError)])
def test_bad_num_warmup_iters(iters, exc):
    with pytest.raises(exc, match="num_warmup_iters"):
        mgc(lambda a: a * 2, (torch.randn(2),), num_warmup_iters=iters)


def test_bad_engine_name():
    with pytest.raises(ValueError, match="engine must be None, 'eager', 'cuda'"):
        mgc(lambda a: a * 2, (torch.randn(2),), engine="tpu")


@pytest.mark.skipif(gograph.cuda_available(), reason="checks the error without the CUDA core")
def test_cuda_engine_without_cuda_core_names_the_cause():
    with pytest.raises(RuntimeError, match="CUDA core is unavailable.*engine='eager'"):
        mgc(lambda a: a * 2, (torch.randn(2),), engine="cuda")


@pytest.mark.parametrize("ret", [None, (), [], {}])
def test_callable_returning_nothing(ret):
    x = torch.randn(2)
    probe = _NoSideEffects()
    with pytest.raises(TypeError) as info:
        mgc(lambda a: ret, (x,))
    msg = str(info.value)
    assert "callable 0" in msg and "warmup" in msg and "must return at least one Tensor" in msg
    probe.check()


def test_callable_returning_nothing_without_warmup_fails_in_capture():
    x = torch.randn(2)
    probe = _NoSideEffects()
    with pytest.raises(TypeError, match="forward capture.*at least one Tensor"):
        mgc(lambda a: None, (x,), num_warmup_iters=0)
    probe.check()


@pytest.mark.parametrize("ret", [lambda a: (a * 2, 3), lambda a: {"y": a * 2, "n": "s"}, lambda a: [a, None]])
def test_callable_returning_non_tensors(ret):
    with pytest.raises(TypeError, match="outputs of a graphed callable must be Tensors"):
        mgc(ret, (torch.randn(2),))


def test_outputs_aliasing_inputs_keep_torch_semantics():
    """Outputs that are inputs, views of inputs or of parameters are allowed (as in torch): they
    alias the static input, which the next call overwrites -- the rule for every output."""
    view = mgc(lambda a: a.view(2, 3)[0], (torch.randn(6, requires_grad=True),))
    a = torch.randn(6, requires_grad=True)
    out = view(a)
    assert torch.equal(out, a.detach()[:3])
    out.sum().backward()
    assert torch.equal(a.grad, torch.tensor([1.0, 1, 1, 0, 0, 0]))

    lin = torch.nn.Linear(2, 2)

    class ReturnsWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x), self.lin.weight

    m = ReturnsWeight()
    mgc(m, (torch.randn(1, 2),))
    _y, w = m(torch.randn(1, 2))
    assert torch.equal(w, lin.weight.detach())
    m.reset()


def test_failed_argument_checks_leave_no_pass_and_no_pool_refs():
    eng = EagerEngine()
    pool = gograph.graph_pool_handle()
    m0, m1 = make_mlp(), make_mlp(seed=3).eval()
    x, y = torch.randn(2, 8), torch.randn(2)
    probe = _NoSideEffects(m0, m1)
    for bad in [
        lambda: mgc((m0, m0), ((x,), (x,)), pool=pool, engine=eng),
        lambda: mgc((m0, 5), ((x,), (y,)), pool=pool, engine=eng),
        lambda: mgc((m0,), ((x, object()),), pool=pool, engine=eng),
    ]:
        with pytest.raises((ValueError, TypeError, AssertionError)):
            bad()
        assert eng.pool_refs(pool) == 0
    probe.check()


# ---------------------------------------------------------------------------------------------
# Replay-time checks
# ---------------------------------------------------------------------------------------------
def _graphed_ab() -> gograph.GraphedCallable:
    # Not a fixture: pytest keeps fixture values referenced until after the leak check runs.
    return mgc(lambda a, b: a * b + 1, (torch.randn(2, 3), torch.randn(2, 3, requires_grad=True)))


def test_wrong_number_of_args():
    graphed_ab = _graphed_ab()
    with pytest.raises(TypeError, match=r"captured with 2 tensor argument\(s\) and called with 1"):
        graphed_ab(torch.randn(2, 3))
    with pytest.raises(TypeError, match="called with 3"):
        graphed_ab(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3))


@pytest.mark.parametrize(
    "bad, what",
    [
        (torch.randn(3, 3), "shape (3, 3)"),
        (torch.randn(2, 3, 1), "shape (2, 3, 1)"),
        (torch.randn(1, 3), "shape (1, 3)"),  # would broadcast in copy_
        (torch.randn(3), "shape (3,)"),  # would broadcast too
        (torch.randn(2, 3, 1, dtype=torch.float64), "shape (2, 3, 1)"),  # a cast does not help a shape
    ],
)
def test_shape_mismatch_is_refused_not_broadcast(bad, what):
    graphed_ab = _graphed_ab()
    static = graphed_ab.static_input_surface[1].clone()
    with pytest.raises(gograph.StaticInputMismatchError) as info:
        graphed_ab(torch.randn(2, 3), bad)
    msg = str(info.value)
    assert "argument leaf 1 of graphed callable 0" in msg and what in msg
    assert "captured with shape (2, 3), dtype torch.float32, device cpu" in msg
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    assert torch.equal(graphed_ab.static_input_surface[1], static)  # nothing was copied


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_a_dtype_the_copy_casts_is_accepted_as_torch_does(dtype, caplog):
    """torch's graphed callables copy_ every arg into its static input, which casts (torch's AMP
    test trains fp32-graphed MLPs on the fp16 outputs of autocast): the same here, noted once."""
    graphed_ab = _graphed_ab()
    a = torch.randn(2, 3)
    b = (torch.randn(2, 3) * 4).to(dtype)
    with caplog.at_level(logging.DEBUG, logger="gograph"):
        out = graphed_ab(a, b)
        graphed_ab(a, b)
    assert torch.equal(out, a * b.float() + 1)
    assert sum("casts it" in r.getMessage() for r in caplog.records) == 1


def test_mismatch_of_the_first_arg_copies_nothing():
    graphed_ab = _graphed_ab()
    s0, s1 = (t.clone() for t in graphed_ab.static_input_surface[:2])
    with pytest.raises(gograph.StaticInputMismatchError, match="argument leaf 1"):
        graphed_ab(torch.ones(2, 3), torch.ones(4, 3))
    # leaf 0 was checked and copied before leaf 1 failed; leaf 1 was not touched, and no replay
    # ran (outputs unchanged): the callable is still usable
    assert torch.equal(graphed_ab.static_input_surface[1], s1)
    out = graphed_ab(torch.full((2, 3), 2.0), torch.full((2, 3), 3.0))
    assert torch.equal(out, torch.full((2, 3), 7.0))
    del s0


@pytest.mark.parametrize("bad", [5, 2.0, None, [torch.randn(2, 3)], "t"])
def test_non_tensor_arg_at_replay(bad):
    graphed_ab = _graphed_ab()
    with pytest.raises(TypeError, match="argument leaf 1 .* not a Tensor"):
        graphed_ab(torch.randn(2, 3), bad)


def test_keyword_argument_for_a_positional_one_is_refused():
    graphed_ab = _graphed_ab()
    with pytest.raises(TypeError, match=r"called with 1; .* \['b'\] are not graphed inputs: pass them positionally"):
        graphed_ab(torch.randn(2, 3), b=torch.randn(2, 3))


def test_pytree_structure_mismatch_is_refused():
    g = mgc(lambda d, t: d["a"] * d["b"] + t[0], ({"a": torch.randn(2), "b": torch.randn(2)}, (torch.randn(2),)))
    a, b, c = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
    assert torch.equal(g({"a": a, "b": b}, (c,)), torch.full((2,), 5.0))
    with pytest.raises(TypeError, match=r"pytree structure of its sample_args, \(\{'a': T, 'b': T\}, \(T,\)\)"):
        g({"b": b, "a": a}, (c,))  # same leaves, keys in another order: would swap a and b
    with pytest.raises(TypeError, match="pytree structure"):
        g({"a": a, "b": b}, [c])
    with pytest.raises(TypeError, match="pytree structure"):
        g(a, b, c)
    g.reset()


def test_flat_args_passed_as_a_list_are_refused():
    graphed_ab = _graphed_ab()
    with pytest.raises(TypeError):
        graphed_ab([torch.randn(2, 3), torch.randn(2, 3)])


def test_requires_grad_where_the_sample_did_not_is_refused_at_the_backward():
    graphed_ab = _graphed_ab()
    out = graphed_ab(torch.randn(2, 3, requires_grad=True), torch.randn(2, 3))  # the forward runs
    with pytest.raises(RuntimeError, match="argument leaf 0 .* requires grad, but its sample arg did not"):
        out.sum().backward()
    # fine without grad mode, or detached
    with torch.no_grad():
        graphed_ab(torch.randn(2, 3, requires_grad=True), torch.randn(2, 3))
    graphed_ab(torch.randn(2, 3, requires_grad=True).detach(), torch.randn(2, 3))


def test_an_arg_requiring_grad_reaches_a_forward_only_callable():
    m = make_mlp()
    with torch.no_grad():
        mgc(m, (torch.randn(2, 8),))
    out = m(torch.randn(2, 8, requires_grad=True))  # no backward graph: the grad is not dropped silently
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=r"has no backward graph: it was graphed under torch\.no_grad\(\)"):
        out.sum().backward()
    m.reset()


def test_static_inputs_passed_back_skip_the_copy():
    graphed_ab = _graphed_ab()
    s0, s1 = graphed_ab.static_input_surface[:2]
    with torch.no_grad():
        s0.fill_(2.0), s1.fill_(3.0)
    assert torch.equal(graphed_ab(s0, s1), torch.full((2, 3), 7.0))


def test_backward_twice_through_the_same_outputs_is_refused():
    g = mgc(lambda a: (a * a).sum(-1), (torch.randn(4, 3, requires_grad=True),))
    a = torch.randn(4, 3, requires_grad=True)
    out = g(a)
    out.sum().backward(retain_graph=True)
    first = a.grad.clone()
    with pytest.raises(RuntimeError, match="a second time for the same forward call"):
        out.sum().backward()
    assert torch.equal(a.grad, first)  # the refused backward added nothing
    # a new forward can be differentiated again
    a.grad = None
    g(a).sum().backward()
    assert torch.allclose(a.grad, 2 * a.detach())
    g.reset()


def test_backward_twice_via_autograd_grad_is_refused():
    g = mgc(lambda a: a.sin(), (torch.randn(3, requires_grad=True),))
    a = torch.randn(3, requires_grad=True)
    out = g(a)
    (ga,) = torch.autograd.grad(out.sum(), a, retain_graph=True)
    assert torch.allclose(ga, a.detach().cos())
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out.sum(), a)
    g.reset()


# ---------------------------------------------------------------------------------------------
# Nested capture
# ---------------------------------------------------------------------------------------------
def test_graphed_callable_inside_a_second_capture_is_refused(eager_engine):
    inner = mgc(lambda a: a * 3, (torch.randn(2),), engine=eager_engine)
    x = torch.randn(2)
    probe = _NoSideEffects()
    with pytest.raises(RuntimeError) as info:
        mgc(lambda a: inner(a) + 1, (x,), engine=eager_engine)
    msg = str(info.value)
    assert "callable 0" in msg and "forward capture" in msg
    assert "graphed callable 0" in msg and "capture is underway" in msg and "together in one" in msg
    probe.check()
    assert eager_engine.pool_refs(inner.pool) == 1 and inner.state == "ready"  # untouched (forward only)
    # the inner one still works, and the two graph fine together
    assert torch.equal(inner(torch.ones(2)), torch.full((2,), 3.0))
    both = mgc((lambda a: a * 3, lambda b: b + 1), ((torch.randn(2),), (torch.randn(2),)), engine=eager_engine)
    assert torch.equal(both[1](both[0](torch.ones(2))), torch.full((2,), 4.0))


def test_graphed_callable_inside_a_backward_capture_is_refused(eager_engine):
    inner = mgc(lambda a: a * 3, (torch.randn(2),), engine=eager_engine)

    class UsesInnerInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return inner(g.detach()) * 0 + g * 2

    with pytest.raises(RuntimeError, match="backward capture.*capture is underway"):
        mgc(UsesInnerInBackward.apply, (torch.randn(2, requires_grad=True),), engine=eager_engine)


def test_make_graphed_callables_inside_a_capture_is_refused(eager_engine):
    x = torch.randn(2)
    probe = _NoSideEffects()

    def builds_inside(a):
        mgc(lambda b: b * 2, (a,), engine=eager_engine)
        return a * 2

    with pytest.raises(
        RuntimeError, match="forward capture.*make_graphed_callables was called while a CUDA graph capture is underway"
    ):
        mgc(builds_inside, (x,), num_warmup_iters=0, engine=eager_engine)
    probe.check()


def test_calls_in_warmup_are_allowed(eager_engine):
    """Warmup runs eagerly: calling a graphed callable there is fine; only capture refuses."""
    inner = mgc(lambda a: a * 3, (torch.randn(2),), engine=eager_engine)
    calls = []

    def outer(a):
        if len(calls) < 2:
            calls.append(inner(a))
        return a + 1

    g = mgc(outer, (torch.randn(2),), num_warmup_iters=2, engine=eager_engine)
    assert len(calls) == 2
    assert torch.equal(g(torch.ones(2)), torch.full((2,), 2.0))


def test_capture_state_is_per_thread(eager_engine):
    """A capture on one thread does not make replays on another thread fail."""
    import threading

    other = mgc(lambda a: a * 5, (torch.randn(2),), engine=eager_engine)
    started, go_on = threading.Event(), threading.Event()
    results: list[object] = []

    def slow(a):
        started.set()
        go_on.wait(10)
        return a * 2

    def build():
        results.append(mgc(slow, (torch.randn(2),), num_warmup_iters=0, engine=eager_engine))

    t = threading.Thread(target=build)
    t.start()
    assert started.wait(10)
    try:
        assert torch.equal(other(torch.ones(2)), torch.full((2,), 5.0))  # capture underway elsewhere
    finally:
        go_on.set()
        t.join(10)
    assert len(results) == 1 and isinstance(results[0], gograph.GraphedCallable)


# ---------------------------------------------------------------------------------------------
# CUDA: devices
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cpu_sample_args_for_the_cuda_engine_are_refused(cuda_device):
    a, b = torch.randn(2, device=cuda_device), torch.randn(2)
    probe = _NoSideEffects()
    with pytest.raises(
        ValueError,
        match=r"sample arg leaf 1 of callable 0 .* is on cpu, but the CUDA engine "
        r"captures on cuda:\d",
    ):
        mgc(lambda a, b: a * b, (a, b))
    with pytest.raises(ValueError, match="is on cpu, but the CUDA engine"):
        mgc(lambda a: a * 2, (b,), engine="cuda")
    probe.check()


@pytest.mark.cuda
def test_module_on_cpu_with_cuda_args_is_refused(cuda_device):
    m = make_mlp()
    x = torch.randn(2, 8, device=cuda_device)
    probe = _NoSideEffects(m)
    with pytest.raises(ValueError, match=r"parameter '0.weight' of callable 0 \(Sequential\) is on cpu.*module.to"):
        mgc(m, (x,))
    probe.check()


@pytest.mark.cuda
def test_sample_args_on_another_gpu_are_refused(cuda_device):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with pytest.raises(ValueError, match="one CUDA device"):
        mgc(lambda a, b: a * b, (torch.randn(2, device="cuda:0"), torch.randn(2, device="cuda:1")))
    eng = gograph.CudaEngine("cuda:0")
    with pytest.raises(ValueError, match="is on cuda:1, but the CUDA engine captures on cuda:0"):
        mgc(lambda a: a * 2, (torch.randn(2, device="cuda:1"),), engine=eng)


@pytest.mark.cuda
def test_replay_with_cpu_or_other_gpu_tensor_is_refused(cuda_device):
    g = mgc(lambda a: a * 2, (torch.randn(4, device=cuda_device),))
    with pytest.raises(
        gograph.StaticInputMismatchError, match="device cpu, but the graph was captured with .* device cuda"
    ):
        g(torch.randn(4))
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", 1 - cuda_device.index if cuda_device.index in (0, 1) else 0)
        with pytest.raises(gograph.StaticInputMismatchError, match=f"device {other}"):
            g(torch.randn(4, device=other))
    assert torch.equal(g(torch.ones(4, device=cuda_device)), torch.full((4,), 2.0, device=cuda_device))
    g.reset()


@pytest.mark.cuda
def test_output_on_cpu_is_refused_in_warmup(cuda_device):
    x = torch.randn(4, device=cuda_device)
    probe = _NoSideEffects()
    with pytest.raises(ValueError, match="output leaf 0 of callable 0 .* is on cpu.*warmup|warmup.*is on cpu"):
        mgc(lambda a: (a * 2).cpu(), (x,))
    probe.check()


@pytest.mark.cuda
def test_pool_of_the_wrong_kind_is_refused(cuda_device):
    with pytest.raises(TypeError, match="pool must be a token .* for the CUDA engine"):
        mgc(lambda a: a * 2, (torch.randn(4, device=cuda_device),), pool=gograph.EagerPool())


@pytest.mark.cuda
def test_identity_and_view_outputs_on_cuda(cuda_device):
    g = mgc(lambda a: (a, a[1:]), (torch.randn(4, device=cuda_device, requires_grad=True),))
    a = torch.randn(4, device=cuda_device, requires_grad=True)
    out, tail = g(a)
    assert torch.equal(out, a.detach()) and torch.equal(tail, a.detach()[1:])
    (out.sum() + 2 * tail.sum()).backward()
    assert torch.equal(a.grad, torch.tensor([1.0, 3, 3, 3], device=cuda_device))
    g.reset()


@pytest.mark.cuda
def test_replay_inside_torch_cuda_graph_capture_is_refused(cuda_device):
    g = mgc(lambda a: a * 2, (torch.randn(4, device=cuda_device),))
    x = torch.randn(4, device=cuda_device)
    tg = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capturing"):
        with torch.cuda.graph(tg):
            g(x)
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    assert torch.equal(g(torch.ones(4, device=cuda_device)), torch.full((4,), 2.0, device=cuda_device))
    g.reset()


@pytest.mark.cuda
def test_make_graphed_callables_inside_torch_cuda_graph_capture_is_refused(cuda_device):
    tg = torch.cuda.CUDAGraph()
    x = torch.randn(4, device=cuda_device)
    probe_passes = gograph.live_passes()
    with pytest.raises(RuntimeError, match="make_graphed_callables was called while a CUDA graph capture"):
        with torch.cuda.graph(tg):
            mgc(lambda a: a * 2, (x,))
    assert gograph.live_passes() == probe_passes
    g = mgc(lambda a: a * 2, (x,))  # and afterwards it works
    assert torch.equal(g(torch.ones(4, device=cuda_device)), torch.full((4,), 2.0, device=cuda_device))
    g.reset()


@pytest.mark.cuda
def test_nested_graphed_callable_in_cuda_capture_is_refused(cuda_device):
    inner = mgc(lambda a: a * 3, (torch.randn(4, device=cuda_device),))
    base_graphs, base_passes = gograph.live_graphs(), gograph.live_passes()
    with pytest.raises(RuntimeError, match="forward capture.*(capture is underway|capturing)"):
        mgc(lambda a: inner(a) + 1, (torch.randn(4, device=cuda_device),))
    assert gograph.live_graphs() == base_graphs and gograph.live_passes() == base_passes
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.equal(inner(torch.ones(4, device=cuda_device)), torch.full((4,), 3.0, device=cuda_device))
    inner.reset()


@pytest.mark.cuda
def test_backward_twice_on_cuda_is_refused(cuda_device):
    m = make_mlp(device=cuda_device)
    mgc(m, (torch.randn(4, 8, device=cuda_device, requires_grad=True),))
    x = torch.randn(4, 8, device=cuda_device, requires_grad=True)
    out = m(x)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()
    m.reset()


# ---------------------------------------------------------------------------------------------
# Captured kwargs (TransformerEngine's sample_kwargs)
# ---------------------------------------------------------------------------------------------
def test_extra_kwargs_are_ignored_as_transformer_engine_ignores_them(recwarn):
    """Megatron-LM's replay passes every layer kwarg (mostly None) and is_first_microbatch."""
    g = mgc(lambda a, scale: a * scale, (torch.randn(3),), sample_kwargs={"scale": torch.randn(3)})
    two = torch.full((3,), 2.0)
    out = g(torch.ones(3), scale=two, context=None, attention_bias=None, is_first_microbatch=True, n=3, rope=(None,))
    assert torch.equal(out, two)
    assert not [w for w in recwarn if "gograph" in str(w.message)], "non-tensor extra kwargs must pass silently"
    with pytest.warns(UserWarning, match=r"callable 0 \(.*\) ignores keyword argument\(s\) \['bias', 'pair'\]"):
        g(torch.ones(3), scale=two, bias=torch.ones(3), pair=(None, torch.ones(3)), context=None)
    recwarn.clear()
    g(torch.ones(3), scale=two, bias=torch.ones(3))  # said once per graphed callable
    assert not [w for w in recwarn if "gograph" in str(w.message)]
    with pytest.raises(TypeError, match="initialized with kwarg scale, but it was not provided"):
        g(torch.ones(3), bias=torch.ones(3))  # a missing captured kwarg is still an error
    g.reset()


def test_missing_extra_or_mismatched_captured_kwargs():
    g = mgc(lambda a, scale: a * scale, (torch.randn(3),), sample_kwargs={"scale": torch.randn(3)})
    assert torch.equal(g(torch.ones(3), scale=torch.full((3,), 2.0)), torch.full((3,), 2.0))
    with pytest.raises(TypeError, match="initialized with kwarg scale, but it was not provided"):
        g(torch.ones(3))
    with pytest.warns(
        UserWarning, match=r"\['other'\]: they hold tensors but were not in its sample_kwargs \['scale'\]"
    ):
        assert torch.equal(g(torch.ones(3), scale=torch.ones(3), other=torch.ones(3)), torch.ones(3))
    with pytest.raises(gograph.StaticInputMismatchError, match=r"shape \(4,\)"):
        g(torch.ones(3), scale=torch.ones(4))
    with pytest.raises(TypeError, match="not a Tensor"):
        g(torch.ones(3), scale=2.0)
    assert torch.equal(g(torch.ones(3), scale=torch.full((3,), 3.0)), torch.full((3,), 3.0))
    g.reset()


@pytest.mark.cuda
def test_backward_twice_with_retain_graph_in_backward_is_allowed(cuda_device):
    """Captured with retain_graph_in_backward=True the backward graph keeps its activations, so a
    second backward through the same outputs is valid (as eager with retain_graph=True)."""
    m = make_mlp(device=cuda_device)
    ref = twin(m)
    mgc(m, (torch.randn(4, 8, device=cuda_device, requires_grad=True),), retain_graph_in_backward=True)
    x = torch.randn(4, 8, device=cuda_device, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out, out_r = m(x), ref(xr)
    for _ in range(2):
        out.square().sum().backward(retain_graph=True)
        out_r.square().sum().backward(retain_graph=True)
    torch.cuda.synchronize()
    assert torch.allclose(x.grad, xr.grad)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad)
    m.reset()


@pytest.mark.parametrize("pool", [[1], 123, "pool", (0, 0)])
def test_a_pool_that_is_no_token_is_refused_up_front(pool):
    """On the eager engine too: a TypeError before any warmup, nothing left behind."""
    calls = []
    with pytest.raises(TypeError, match="pool must be a"):
        mgc(lambda a: (calls.append(1), a * 2)[1], (torch.randn(4),), pool=pool)
    assert calls == [] and gograph.live_passes() == 0 and gograph.live_plans() == 0
