"""make_graphed_callables on the eager engine (CPU): values, grads, structure, aliasing, modes."""

from __future__ import annotations

import pytest
import torch

import gograph
from gograph.engines import BACKWARD, FORWARD

from helpers import batches, grads_equal, learn_dropped_grads, make_mlp, params_equal, twin


def test_module_train_mode_matches_eager_bitwise():
    model = make_mlp()
    ref = twin(model)
    sample = torch.randn(6, 8, requires_grad=True)
    graphed = gograph.make_graphed_callables(model, (sample,))

    assert graphed is model
    assert isinstance(model.forward, gograph.GraphedCallable)
    assert model.forward.has_backward
    assert model.forward.state == "ready"

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in batches(4, (6, 8)):
        x_g = x.clone().requires_grad_()
        x_r = x.clone().requires_grad_()
        out = model(x_g)
        out_r = ref(x_r)
        assert out.requires_grad
        assert torch.equal(out, out_r)
        w = torch.randn_like(out)
        (out * w).sum().backward()
        (out_r * w).sum().backward()
        assert torch.equal(x_g.grad, x_r.grad)
        assert grads_equal(model, ref)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    assert params_equal(model, ref)
    # the graphed forward really is the replay: the returned tensor aliases the static output
    out = model(x_g)
    assert out.data_ptr() == model.forward.static_outputs[0].data_ptr()


def test_function_callable_with_mixed_outputs():
    def fn(a, b):
        return (a * b).sin(), b.detach() * 2  # second output does not require grad

    a0 = torch.randn(3, 5, requires_grad=True)
    b0 = torch.randn(3, 5, requires_grad=True)
    graphed = gograph.make_graphed_callables(fn, (a0, b0))
    assert isinstance(graphed, gograph.GraphedCallable)
    assert graphed.module is None

    a, b = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    ar, br = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y, z = graphed(a, b)
    yr, zr = fn(ar, br)
    assert torch.equal(y, yr) and torch.equal(z, zr)
    assert y.requires_grad and not z.requires_grad
    y.sum().backward()
    yr.sum().backward()
    assert torch.equal(a.grad, ar.grad)
    assert torch.equal(b.grad, br.grad)


def test_tuple_of_callables_with_pytree_and_dict_args():
    m1 = make_mlp(seed=3, d_out=6)
    m1_ref = twin(m1)

    def f2(d, scale):
        return {"prod": d["h"] * d["b"] * scale[0], "diff": (d["h"] - d["b"],)}

    x0 = torch.randn(4, 8, requires_grad=True)
    h0 = torch.randn(4, 6, requires_grad=True)
    b0 = torch.randn(4, 6)
    s0 = [torch.tensor(1.5)]
    g1, g2 = gograph.make_graphed_callables((m1, f2), ((x0,), ({"h": h0, "b": b0}, s0)))
    assert g1 is m1
    assert isinstance(g2, gograph.GraphedCallable)
    assert g2.len_user_args == 3  # h, b, scale[0]

    for x, b in zip(batches(3, (4, 8), seed=5), batches(3, (4, 6), seed=6)):
        s = [torch.tensor(0.5)]
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = g2({"h": g1(xg), "b": b}, s)
        out_r = f2({"h": m1_ref(xr), "b": b}, s)
        assert set(out) == {"prod", "diff"} and isinstance(out["diff"], tuple)
        assert torch.equal(out["prod"], out_r["prod"])
        assert torch.equal(out["diff"][0], out_r["diff"][0])
        (out["prod"].sum() + out["diff"][0].square().sum()).backward()
        (out_r["prod"].sum() + out_r["diff"][0].square().sum()).backward()
        assert torch.equal(xg.grad, xr.grad)
        assert grads_equal(m1, m1_ref)


def test_tuple_captures_share_one_pool_with_one_reference_per_capture(eager_engine):
    m1, m2 = make_mlp(seed=1), make_mlp(seed=2, d_in=4)
    pool = gograph.graph_pool_handle()
    _g1, _g2 = gograph.make_graphed_callables(
        (m1, m2), ((torch.randn(2, 8),), (torch.randn(2, 4),)), pool=pool, engine=eager_engine
    )
    # two callables x (forward + backward) captures, all in the given pool
    assert eager_engine.pool_refs(pool) == 4
    assert m1.forward.pool is pool and m2.forward.pool is pool
    m1.reset()
    assert eager_engine.pool_refs(pool) == 2
    m2.reset()
    assert eager_engine.pool_refs(pool) == 0


def test_no_grad_build_is_forward_only_and_training_flag_fallback():
    model = make_mlp()
    model.eval()
    ref = twin(model)
    sample = torch.randn(5, 8)
    with torch.no_grad():
        gograph.make_graphed_callables(model, (sample,))
    gcall = model.forward
    assert not gcall.has_backward
    assert gcall.static_grad_inputs == (None,) * len(gcall.static_input_surface)
    with pytest.raises(RuntimeError, match="backward"):
        gcall.engine.replay(gcall.pass_id, BACKWARD)  # the core knows there is no backward graph

    x = torch.randn(5, 8)
    with torch.no_grad():
        out = model(x)
    assert not out.requires_grad
    assert torch.equal(out, ref(x))
    assert out.data_ptr() == gcall.static_outputs[0].data_ptr()
    # under grad mode the output requires grad where eager's does; a backward through it raises
    # (never a silently dropped gradient)
    out = model(x)
    assert out.requires_grad and ref(x).requires_grad
    with pytest.raises(RuntimeError, match=r"graphed under torch\.no_grad\(\), so no gradient flows through it"):
        out.sum().backward()

    # train mode differs from the captured mode: the original forward runs eagerly
    static_before = gcall.static_outputs[0].clone()
    model.train()
    ref.train()
    x2 = torch.randn(5, 8)
    out_train = model(x2)
    assert out_train.requires_grad
    assert out_train.data_ptr() != gcall.static_outputs[0].data_ptr()
    assert torch.equal(out_train, ref(x2))
    assert torch.equal(gcall.static_outputs[0], static_before)  # the graph was not replayed
    out_train.sum().backward()
    assert all(p.grad is not None for p in model.parameters())

    model.eval()
    assert model(x2).data_ptr() == gcall.static_outputs[0].data_ptr()


def test_train_mode_capture_falls_back_in_eval_mode():
    model = make_mlp(dropout=0.5)
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(3, 8),))
    model.eval()
    ref.eval()
    x = torch.randn(3, 8)
    out = model(x)
    assert out.data_ptr() != model.forward.static_outputs[0].data_ptr()
    assert torch.equal(out, ref(x))  # eval: no dropout, eager forward


def test_outputs_and_input_grads_alias_static_buffers():
    model = make_mlp()
    gograph.make_graphed_callables(model, (torch.randn(4, 8, requires_grad=True),))
    gcall = model.forward
    x1, x2 = batches(2, (4, 8), requires_grad=True)
    o1 = model(x1)
    o1_copy = o1.clone()
    o2 = model(x2)
    assert o1.data_ptr() == o2.data_ptr() == gcall.static_outputs[0].data_ptr()
    assert torch.equal(o1, o2)  # the second replay overwrote the first call's output
    assert not torch.equal(o1, o1_copy)
    # user input copied into the static input; a call with the static input itself copies nothing
    assert torch.equal(gcall.static_input_surface[0], x2)
    static_x = gcall.static_input_surface[0]
    assert model(static_x).data_ptr() == gcall.static_outputs[0].data_ptr()

    x = torch.randn(4, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x).sum(), x)
    assert gx.data_ptr() == gcall.static_grad_inputs[0].data_ptr()


def test_param_grads_cloned_by_default_accumulate_over_micro_batches():
    model = make_mlp()
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8),))
    static_param_grads = model.forward.static_grad_inputs[1:]
    for x in batches(2, (4, 8), seed=9):  # two micro-batches, no zero_grad in between
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert grads_equal(model, ref)
    for p, s in zip(model.parameters(), static_param_grads):
        assert p.grad.data_ptr() != s.data_ptr()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_param_grads_never_become_static_buffers_across_steps(set_to_none):
    model = make_mlp()
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8),))
    static_ptrs = {s.data_ptr() for s in model.forward.static_grad_inputs[1:]}
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in batches(4, (4, 8), seed=3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=set_to_none)
            m(x).square().sum().backward()
            m(x * 2).square().sum().backward()  # a second micro-batch accumulates into .grad
            o.step()
        assert grads_equal(model, ref)
        assert not {p.grad.data_ptr() for p in model.parameters()} & static_ptrs
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_skip_backward_post_hook_params_are_not_cloned():
    model = make_mlp()
    marked = next(iter(model.parameters()))
    marked.skip_backward_post_hook = True
    gograph.make_graphed_callables(model, (torch.randn(4, 8),))
    static = model.forward.static_grad_inputs[1]
    learn_dropped_grads(model, torch.randn(4, 8))
    model(torch.randn(4, 8)).sum().backward()
    assert marked.grad.data_ptr() == static.data_ptr()  # handed over as is, by request
    others = list(model.parameters())[1:]
    static_ptrs = {s.data_ptr() for s in model.forward.static_grad_inputs if s is not None}
    assert all(p.grad.data_ptr() in static_ptrs for p in others)  # lent: no clone was made
    kept = [p.grad.clone() for p in others]
    model(torch.randn(4, 8))  # a replay that overwrites the buffers: .grad is copied out first
    assert all(p.grad.data_ptr() not in static_ptrs for p in others)
    assert all(torch.equal(p.grad, k) for p, k in zip(others, kept))


def test_lent_grads_returned_by_autograd_grad_are_copied_out():
    """torch.autograd.grad hands the caller the backward's tensor (no AccumulateGrad): a caller
    that keeps it past the next replay keeps the values it got (copied out, like .grad)."""
    model = make_mlp()
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8),))
    x1, x2 = batches(2, (4, 8), seed=5)
    grads = torch.autograd.grad(model(x1).square().sum(), list(model.parameters()))
    want = torch.autograd.grad(ref(x1).square().sum(), list(ref.parameters()))
    model(x2).square().sum().backward()  # both replays overwrite the lent buffers
    assert all(torch.equal(g, w) for g, w in zip(grads, want))
    assert all(p.grad is not None for p in model.parameters())


def test_a_kept_view_of_a_lent_grad_raises_before_the_replay_changes_it():
    model = make_mlp()
    gograph.make_graphed_callables(model, (torch.randn(4, 8),))
    learn_dropped_grads(model, torch.randn(4, 8))
    model(torch.randn(4, 8)).sum().backward()
    view = next(iter(model.parameters())).grad.view(-1)
    before = view.clone()
    with pytest.raises(RuntimeError, match="lent to .grad by an earlier backward is still alive"):
        model(torch.randn(4, 8))
    assert torch.equal(view, before)


def test_a_refused_replay_copies_out_once_the_view_is_gone():
    model = make_mlp()
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8),))
    x1, x2 = batches(2, (4, 8), seed=6)
    learn_dropped_grads(model, x1)
    model(x1).sum().backward()
    ref(x1).sum().backward()
    view = next(iter(model.parameters())).grad.view(-1)
    with pytest.raises(RuntimeError, match="still alive"):
        model(x2)
    del view  # the next replay checks the lent buffers again
    model(x2).sum().backward()
    ref(x2).sum().backward()
    assert grads_equal(model, ref)


def test_param_grads_not_cloned_with_opt_out_alias_static_buffers():
    model = make_mlp()
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8),), clone_param_grads_on_return=False)
    static_param_grads = model.forward.static_grad_inputs[1:]
    x1, x2 = batches(2, (4, 8), seed=9)
    model(x1).square().sum().backward()
    ref(x1).square().sum().backward()
    assert grads_equal(model, ref)  # first micro-batch: correct values ...
    aliased = [p.grad.data_ptr() == s.data_ptr() for p, s in zip(model.parameters(), static_param_grads)]
    assert all(aliased)  # ... but .grad is the static buffer itself (pytorch issue 181723)
    model(x2).square().sum().backward()
    ref(x2).square().sum().backward()
    assert not grads_equal(model, ref)  # the replay overwrote .grad before accumulation


def test_num_warmup_iters_zero():
    model = make_mlp()
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(2, 8, requires_grad=True),), num_warmup_iters=0)
    x = torch.randn(2, 8, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out, out_r = model(x), ref(xr)
    assert torch.equal(out, out_r)
    out.sum().backward()
    out_r.sum().backward()
    assert torch.equal(x.grad, xr.grad) and grads_equal(model, ref)


def test_allow_unused_input():
    def fn(a, b):
        return a * 3

    a0, b0 = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="not have been used") as info:
        gograph.make_graphed_callables(fn, (a0, b0))
    assert "warmup" in str(info.value)
    with pytest.raises(RuntimeError, match="backward capture"):
        gograph.make_graphed_callables(fn, (a0, b0), num_warmup_iters=0)

    graphed = gograph.make_graphed_callables(fn, (a0, b0), allow_unused_input=True)
    assert graphed.static_grad_inputs[1] is None
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    graphed(a, b).sum().backward()
    assert torch.equal(a.grad, torch.full((3,), 3.0))
    assert b.grad is None


def test_inputs_not_requiring_grad_and_frozen_params():
    model = make_mlp()
    ref = twin(model)
    for m in (model, ref):
        m[0].weight.requires_grad_(False)
    gograph.make_graphed_callables(model, (torch.randn(2, 8),))
    x = torch.randn(2, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert model[0].weight.grad is None
    assert grads_equal(model, ref)


def test_no_backward_graph_when_no_output_requires_grad():
    def fn(a):
        return a * 2

    graphed = gograph.make_graphed_callables(fn, (torch.randn(3),))
    assert not graphed.has_backward
    out = graphed(torch.ones(3))
    assert not out.requires_grad and torch.equal(out, torch.full((3,), 2.0))


def test_graph_mode_under_no_grad_context():
    model = make_mlp()
    with torch.no_grad():
        gograph.make_graphed_callables(model, (torch.randn(2, 8),))
    assert not model.forward.has_backward
    with torch.no_grad():
        assert not model(torch.randn(2, 8)).requires_grad
    out = model(torch.randn(2, 8))  # grad mode: requires grad as eager's would, and cannot be trained through
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="graphed under torch.no_grad"):
        out.sum().backward()


def test_rng_dropout_matches_eager_and_graphing_does_not_shift_rng():
    model = make_mlp(dropout=0.5)
    ref = twin(model)
    sample = torch.randn(8, 8)
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    gograph.make_graphed_callables(model, (sample,))
    assert torch.equal(torch.rand(4), expected), "graphing consumed the user's random stream"

    xs = batches(3, (8, 8), seed=2)
    torch.manual_seed(7)
    outs = []
    for x in xs:
        out = model(x)
        outs.append(out.clone())
        out.sum().backward()
    torch.manual_seed(7)
    for x, got in zip(xs, outs):
        out_r = ref(x)
        assert torch.equal(got, out_r)
        out_r.sum().backward()
    assert grads_equal(model, ref)
    # each replay draws a fresh mask, as eager dropout does
    a = model(xs[0]).clone()
    b = model(xs[0]).clone()
    assert not torch.equal(a, b)


def test_engine_selection():
    f = gograph.make_graphed_callables(lambda a: a + 1, (torch.randn(2),), engine="eager")
    assert isinstance(f.engine, gograph.EagerEngine)
    eng = gograph.EagerEngine()
    f2 = gograph.make_graphed_callables(lambda a: a + 1, (torch.randn(2),), engine=eng)
    assert f2.engine is eng
    with pytest.raises(ValueError, match="engine"):
        gograph.make_graphed_callables(lambda a: a + 1, (torch.randn(2),), engine="bogus")


@pytest.mark.skipif(gograph.cuda_available(), reason="checks the error raised without the CUDA core")
def test_cuda_engine_without_cuda_core_names_the_reason():
    reason = gograph.cuda_unavailable_reason()
    assert reason
    with pytest.raises(RuntimeError, match="CUDA core is unavailable") as info:
        gograph.make_graphed_callables(lambda a: a + 1, (torch.randn(2),), engine="cuda")
    assert reason in str(info.value)
    with pytest.raises(RuntimeError, match="cuda flavor"):
        gograph.CudaEngine()


def test_call_checks_argument_structure():
    graphed = gograph.make_graphed_callables(lambda a, b: a * b, (torch.randn(2), torch.randn(2)))
    with pytest.raises(TypeError, match="captured with 2 tensor argument"):
        graphed(torch.randn(2))
    with pytest.raises(
        TypeError, match=r"keyword argument\(s\) \['b'\] are not graphed inputs: pass them positionally"
    ):
        graphed(torch.randn(2), b=torch.randn(2))


def test_eager_engine_reports_backward_without_forward_replay():
    graphed = gograph.make_graphed_callables(lambda a: a.sin(), (torch.randn(3, requires_grad=True),))
    a = torch.randn(3, requires_grad=True)
    o1 = graphed(a)
    o2 = graphed(a)  # o1's activations are gone (a graph would reuse them silently)
    with pytest.raises(RuntimeError, match="without a forward replay"):
        (o1 + o2).sum().backward()


def test_eager_engine_replays_record_kinds_in_the_core():
    graphed = gograph.make_graphed_callables(lambda a: a.exp(), (torch.randn(3, requires_grad=True),))
    core = gograph.core._native.core
    assert core.pass_state(graphed.pass_id) == "ready"
    assert core.pass_graph(graphed.pass_id, FORWARD) == 0  # eager: nothing to launch
    assert core.pass_graph(graphed.pass_id, BACKWARD) == 0


def test_identity_callable_output_aliases_its_input():
    graphed = gograph.make_graphed_callables(lambda a: a, (torch.randn(3, requires_grad=True),))
    static_in = graphed.static_input_surface[0]
    assert graphed.static_outputs[0].data_ptr() == static_in.data_ptr()
    a = torch.randn(3, requires_grad=True)
    out = graphed(a)
    assert torch.equal(out, a)
    (out * torch.arange(3.0)).sum().backward()
    assert torch.equal(a.grad, torch.arange(3.0))


def test_static_shapes_are_required():
    graphed = gograph.make_graphed_callables(lambda a: a * 2, (torch.randn(2, 4),))
    with pytest.raises(RuntimeError):
        graphed(torch.randn(3, 4))
