"""Lifecycle of graphed callables: reset, finalizers, reference cycles, pool references."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import gograph

from helpers import make_mlp, twin


def test_reset_twice_is_harmless_and_call_after_reset_raises(eager_engine):
    model = make_mlp()
    gograph.make_graphed_callables(model, (torch.randn(2, 8),), engine=eager_engine)
    gcall = model.forward
    pool = gcall.pool
    assert model.reset == gcall.reset
    assert eager_engine.pool_refs(pool) == 2  # forward + backward capture
    model.reset()
    assert gcall.is_reset and gcall.state == "reset"
    assert eager_engine.pool_refs(pool) == 0
    assert gcall.static_outputs == () and gcall.static_input_surface == ()
    model.reset()  # harmless
    gcall.reset()
    assert eager_engine.pool_refs(pool) == 0
    with pytest.raises(RuntimeError, match="reset"):
        model(torch.randn(2, 8))


def test_backward_after_reset_raises():
    graphed = gograph.make_graphed_callables(lambda a: a.sin(), (torch.randn(3, requires_grad=True),))
    out = graphed(torch.randn(3, requires_grad=True))
    graphed.reset()
    with pytest.raises(RuntimeError, match="reset"):
        out.sum().backward()


def test_reset_of_one_callable_leaves_the_others_working(eager_engine):
    m1, m2 = make_mlp(seed=1), make_mlp(seed=2, d_in=4)
    r2 = twin(m2)
    _g1, _g2 = gograph.make_graphed_callables(
        (m1, m2), ((torch.randn(2, 8),), (torch.randn(2, 4, requires_grad=True),)), engine=eager_engine
    )
    pool = m1.forward.pool
    m1.reset()
    assert eager_engine.pool_refs(pool) == 2  # m2's two captures keep theirs
    with pytest.raises(RuntimeError, match="reset"):
        m1(torch.randn(2, 8))
    assert m2.forward.state == "ready"
    x = torch.randn(2, 4, requires_grad=True)
    out = m2(x)
    out_r = r2(x)
    assert torch.equal(out, out_r)
    out.sum().backward()
    out_r.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(m2.parameters(), r2.parameters()))


def test_live_passes_drop_after_delete_and_collect():
    base = gograph.live_passes()
    m1, m2 = make_mlp(seed=1), make_mlp(seed=2)
    f = gograph.make_graphed_callables(lambda a: a * 2, (torch.randn(2),))
    gograph.make_graphed_callables((m1, m2), ((torch.randn(2, 8),), (torch.randn(2, 8),)))
    assert gograph.live_passes() == base + 3
    del f
    gc.collect()
    assert gograph.live_passes() == base + 2
    del m1, m2
    gc.collect()
    assert gograph.live_passes() == base


def test_freed_by_refcount_without_gc():
    """No reference cycles: module -> forward -> GraphedCallable -> module is a weakref."""
    base = gograph.live_passes()
    gc.collect()
    gc.disable()
    try:
        model = make_mlp()
        gograph.make_graphed_callables(model, (torch.randn(2, 8, requires_grad=True),))
        out = model(torch.randn(2, 8, requires_grad=True))
        out.sum().backward()
        del out
        gcall_ref = weakref.ref(model.forward)
        model_ref = weakref.ref(model)
        assert gograph.live_passes() == base + 1
        del model
        assert model_ref() is None, "the graphed module was kept alive by a reference cycle"
        assert gcall_ref() is None, "the GraphedCallable was kept alive by a reference cycle"
        assert gograph.live_passes() == base

        fn = gograph.make_graphed_callables(lambda a: a.cos(), (torch.randn(3, requires_grad=True),))
        fn(torch.randn(3, requires_grad=True)).sum().backward()
        assert gograph.live_passes() == base + 1
        del fn
        assert gograph.live_passes() == base
    finally:
        gc.enable()


def test_finalizer_releases_pool_references_without_explicit_reset(eager_engine):
    pool = gograph.graph_pool_handle()
    model = make_mlp()
    gograph.make_graphed_callables(model, (torch.randn(2, 8),), pool=pool, engine=eager_engine)
    assert eager_engine.pool_refs(pool) == 2
    del model
    gc.collect()
    assert eager_engine.pool_refs(pool) == 0


def test_finalizer_does_not_reference_the_graphed_callable():
    graphed = gograph.make_graphed_callables(lambda a: a + 1, (torch.randn(2),))
    fin = graphed._finalizer
    assert fin.alive
    _, _, args, kwargs = fin.peek()
    refs = [*args, *kwargs.values()]
    assert all(r is not graphed for r in refs)
    assert graphed.pass_id in refs
    graphed.reset()
    assert fin.alive  # reset keeps the record (so later calls say "reset"); the finalizer drops it
    del graphed, refs, args, kwargs
    gc.collect()
    assert not fin.alive


def test_module_kept_alive_only_by_its_owner():
    model = make_mlp()
    gograph.make_graphed_callables(model, (torch.randn(2, 8),))
    gcall = model.forward
    assert gcall.module is model
    del model
    gc.collect()
    assert gcall.module is None  # the GraphedCallable held the module weakly
    gcall.reset()
    del gcall


def test_finalizer_during_a_capture_is_deferred_until_it_ends(eager_engine):
    base = gograph.live_passes()
    victim = [gograph.make_graphed_callables(lambda a: a + 1, (torch.randn(2),), engine=eager_engine)]
    victim_pool = victim[0].pool
    seen: dict[str, int] = {}

    def fn(a):
        if victim:  # first call is the capture (no warmup)
            victim.clear()
            gc.collect()  # the victim's finalizer runs now, inside our capture
            seen["passes_inside"] = gograph.live_passes()
            seen["victim_refs_inside"] = eager_engine.pool_refs(victim_pool)
        return a * 2

    graphed = gograph.make_graphed_callables(fn, (torch.randn(2),), num_warmup_iters=0, engine=eager_engine)
    assert seen["passes_inside"] == base + 2  # the victim's release waited for the capture to end
    assert seen["victim_refs_inside"] == 1
    assert gograph.live_passes() == base + 1  # ... and happened right after it
    assert eager_engine.pool_refs(victim_pool) == 0
    assert torch.equal(graphed(torch.ones(2)), torch.full((2,), 2.0))
