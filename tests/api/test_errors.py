"""Checks and failure paths of make_graphed_callables (torch's messages; clean rollback)."""

from __future__ import annotations

import pytest
import torch

import gograph

from helpers import make_mlp


def test_module_with_hooks_is_refused():
    model = make_mlp()
    model.register_forward_hook(lambda m, i, o: None)
    with pytest.raises(AssertionError, match="must not have hooks registered"):
        gograph.make_graphed_callables(model, (torch.randn(2, 8),))
    model2 = make_mlp()
    model2.register_forward_pre_hook(lambda m, i: None)
    with pytest.raises(AssertionError, match="hooks"):
        gograph.make_graphed_callables(model2, (torch.randn(2, 8),))


def test_hooks_registered_after_graphing_are_allowed():
    model = make_mlp()
    gograph.make_graphed_callables(model, (torch.randn(2, 8),))
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model(torch.randn(2, 8))
    assert seen == [torch.Size([2, 4])]


def test_buffer_requiring_grad_is_refused():
    model = make_mlp()
    model.register_buffer("scale", torch.ones(3, requires_grad=True))
    with pytest.raises(AssertionError, match="only parameters may be trainable"):
        gograph.make_graphed_callables(model, (torch.randn(2, 8),))


def test_non_tensor_sample_arg_is_refused():
    with pytest.raises(AssertionError, match="must contain only Tensors"):
        gograph.make_graphed_callables(lambda a, n: a * n, (torch.randn(2), 3))
    with pytest.raises(AssertionError, match="must contain only Tensors"):
        gograph.make_graphed_callables(lambda d: d["a"], ({"a": torch.randn(2), "k": "x"},))


def test_autocast_cache_is_refused():
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        with pytest.raises(RuntimeError, match="does not support the autocast caching"):
            gograph.make_graphed_callables(lambda a: a * 2, (torch.randn(2),))


def test_sample_args_count_must_match_callables():
    with pytest.raises(ValueError, match="one tuple of args per callable"):
        gograph.make_graphed_callables((lambda a: a, lambda a: a), ((torch.randn(2),),))


def test_output_leaves_must_be_tensors():
    with pytest.raises(TypeError, match="must be Tensors") as info:
        gograph.make_graphed_callables(lambda a: (a * 2, 3), (torch.randn(2),))
    assert "warmup" in str(info.value)


class Boom(ValueError):
    pass


def _failing_after(n_ok: int):
    calls = {"n": 0}

    def fn(a):
        calls["n"] += 1
        if calls["n"] > n_ok:
            raise Boom("boom from the callable")
        return a * 2

    return fn


@pytest.mark.parametrize(
    "n_ok, warmup, phase",
    [(0, 3, "warmup"), (1, 1, "forward capture")],
)
def test_exception_in_callable_names_index_and_phase_and_rolls_back(eager_engine, n_ok, warmup, phase):
    base = gograph.live_passes()
    m0 = make_mlp()
    fn = _failing_after(n_ok)
    pool = gograph.graph_pool_handle()
    samples = ((torch.randn(2, 8),), (torch.randn(2, requires_grad=True),))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with pytest.raises(Boom) as info:
        gograph.make_graphed_callables((m0, fn), samples, num_warmup_iters=warmup, pool=pool, engine=eager_engine)
    msg = str(info.value)
    assert "callable 1" in msg and phase in msg and "boom from the callable" in msg
    assert isinstance(info.value.__cause__, Boom)
    assert gograph.live_passes() == base  # every pass created so far was dropped
    assert eager_engine.pool_refs(pool) == 0  # and its pool references released
    assert torch.equal(torch.rand(3), expected)  # generator state restored
    assert m0.forward.__self__ is m0  # the module's forward was not replaced


class _BackwardFails(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        _BackwardFails.calls += 1
        if _BackwardFails.calls > 1:  # fine in warmup, fails at capture
            raise KeyError("backward exploded")
        return g * 2


def test_exception_in_backward_capture(eager_engine):
    base = gograph.live_passes()
    _BackwardFails.calls = 0
    with pytest.raises(KeyError) as info:
        gograph.make_graphed_callables(
            _BackwardFails.apply, (torch.randn(3, requires_grad=True),), num_warmup_iters=1, engine=eager_engine
        )
    msg = str(info.value)
    assert "callable 0" in msg and "backward capture" in msg and "backward exploded" in msg
    assert gograph.live_passes() == base


def test_exception_type_without_message_constructor_gets_a_note():
    class Picky(Exception):
        def __init__(self, code: int, detail: str) -> None:
            super().__init__(code, detail)

    def fn(a):
        raise Picky(3, "no")

    with pytest.raises(Picky) as info:
        gograph.make_graphed_callables(fn, (torch.randn(2),))
    notes = getattr(info.value, "__notes__", [])
    assert any("callable 0" in n and "warmup" in n for n in notes)


def test_core_panic_comes_back_as_runtime_error():
    with pytest.raises(RuntimeError, match="panic"):
        gograph.core._native.core.trigger_panic_for_test()
