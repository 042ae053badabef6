"""Bad arguments a new user passes get gograph's clear error: what was wrong, where, what to do
-- never a raw ``TypeError``/``IndexError`` from deep inside, and never silent acceptance."""

from __future__ import annotations

import pytest
import torch

import gograph

from helpers import make_mlp, twin


def _sample() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 8, requires_grad=True),)


def test_sample_args_none_names_the_argument():
    with pytest.raises(TypeError, match=r"sample_args is None; pass the sample args"):
        gograph.make_graphed_callables(make_mlp(), None)
    with pytest.raises(TypeError, match=r"sample_args is None"):
        gograph.make_graphed_callables((make_mlp(), make_mlp()), None)
    assert gograph.live_passes() == 0


def test_a_sample_entry_that_is_no_tuple_names_its_index():
    with pytest.raises(TypeError, match=r"sample_args\[1\] is a NoneType"):
        gograph.make_graphed_callables((make_mlp(), make_mlp()), (_sample(), None))


@pytest.mark.parametrize(
    "option", ["progress", "debug_replay_order", "clone_param_grads_on_return", "_reuse_graph_input_output_buffers"]
)
def test_bool_options_refuse_other_values(option):
    calls = []
    with pytest.raises(TypeError, match=rf"{option} must be a bool.*got 'yes'"):
        gograph.make_graphed_callables(lambda a: (calls.append(1), a * 2)[1], (torch.randn(2),), **{option: "yes"})
    assert calls == []  # refused before any warmup


def test_allow_unused_input_refuses_other_values():
    with pytest.raises(TypeError, match=r"allow_unused_input must be a bool \(True or False\), got 1"):
        gograph.make_graphed_callables(make_mlp(), _sample(), 3, 1)


def test_none_stays_allowed_where_it_means_not_given():
    m = make_mlp()
    gograph.make_graphed_callables(m, _sample(), debug_replay_order=None, _clone_param_grads_on_return=None)
    m.reset()


class _TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_unused_input_names_gographs_option_not_autograds():
    args = (torch.randn(2, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True))
    with pytest.raises(RuntimeError) as info:
        gograph.make_graphed_callables(_TwoInputs(), args)
    msg = str(info.value)
    assert "callable 0 (_TwoInputs) failed during warmup" in msg
    assert "a sample arg of shape (3, 4) does not reach the outputs" in msg
    assert "allow_unused_input=True" in msg and "allow_unused=True" not in msg
    assert gograph.live_passes() == 0
    m = _TwoInputs()
    gograph.make_graphed_callables(m, args, allow_unused_input=True)
    m.reset()


def test_unused_input_with_an_order_names_the_option_too():
    args = [(torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True))] * 2
    with pytest.raises(RuntimeError, match=r"grad is None after backward pass.*allow_unused_input=True"):
        gograph.make_graphed_callables((_TwoInputs(),), args, _order=[1, 1, -1, -1])


# ---------------------------------------------------------------------------------------------
# megatron_order: Megatron-LM's rules for its interleaved schedule
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0, 1, 1), r"pipeline_size must be >= 1, got 0"),
        ((2, 0, 0, 4), r"chunks must be >= 1, got 0"),
        ((2, 0, 2, 0), r"microbatches must be >= 1, got 0"),
        ((2, 5, 2, 4), r"rank must be in \[0, pipeline_size\) = \[0, 2\), got 5"),
        ((2, -1, 2, 4), r"rank must be in \[0, pipeline_size\) = \[0, 2\), got -1"),
        ((4, 0, 2, 2), r"needs at least pipeline_size \(4\) microbatches, got 2"),
        ((2, 0, 2, 3), r"refuses 3 microbatches in groups of 2: the last group would hold 1"),
        ((2, 0, 2, 4, 0), r"group_size must be in \[pipeline_size, microbatches\] = \[2, 4\] .*, got 0"),
        ((2, 0, 2, 4, 5), r"group_size must be in .* got 5"),
        ((6, 0, 2, 10, 6), r"groups of 6: the last group would hold 4, fewer than pipeline_size 6"),
    ],
)
def test_megatron_order_refuses_what_megatron_refuses(args, match):
    with pytest.raises(gograph.ScheduleError, match=match):
        gograph.megatron_order(*args)


@pytest.mark.parametrize("bad", ["2", 2.0, True, None])
def test_megatron_order_refuses_non_ints(bad):
    with pytest.raises(TypeError, match=r"megatron_order: pipeline_size must be an int"):
        gograph.megatron_order(bad, 0, 2, 4)


def test_megatron_order_accepts_megatrons_schedules():
    assert gograph.megatron_order(1, 0, 1, 1) == [1, -1]
    order = gograph.megatron_order(2, 1, 2, 6, group_size=3)  # a last group of 3 >= pipeline_size
    assert sorted(order) == sorted([1] * 6 + [2] * 6 + [-1] * 6 + [-2] * 6)


# ---------------------------------------------------------------------------------------------
# The 5th positional argument: torch's pool, TransformerEngine's sample_kwargs
# ---------------------------------------------------------------------------------------------
class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale


def test_a_dict_as_fifth_positional_is_transformer_engines_sample_kwargs():
    x, scale = torch.randn(2, 4, requires_grad=True), torch.full((1,), 2.0)
    m = _Scaled()
    ref = twin(m)
    gograph.make_graphed_callables(m, (x,), 3, False, {"scale": scale})
    assert torch.equal(m(x, scale=scale), ref(x, scale=scale))
    m.reset()


def test_a_sequence_of_dicts_as_fifth_positional_is_sample_kwargs_per_callable():
    a, b = _Scaled(), _Scaled()
    x, scale = torch.randn(2, 4, requires_grad=True), torch.full((1,), 3.0)
    ga, gb = gograph.make_graphed_callables((a, b), ((x,), (x,)), 3, False, [{"scale": scale}, {"scale": scale}])
    assert ga.forward.len_user_args == 2  # the kwarg's tensor is part of the static input surface
    ga.reset()
    gb.reset()


def test_a_pool_token_as_fifth_positional_is_torchs_pool():
    pool = gograph.graph_pool_handle()
    m = make_mlp()
    gograph.make_graphed_callables(m, (torch.randn(2, 8),), 3, False, pool)
    assert m.forward.pool is pool
    m.reset()


@pytest.mark.parametrize("bad", ["pool", 7, [1, 2], (1, "x")])
def test_anything_else_as_fifth_positional_names_both_meanings(bad):
    with pytest.raises(TypeError) as info:
        gograph.make_graphed_callables(make_mlp(), (torch.randn(2, 8),), 3, False, bad)
    msg = str(info.value)
    assert "pool must be a token" in msg and "sample_kwargs" in msg and "torch.cuda.MemPool" in msg


def test_sample_kwargs_given_twice_is_refused():
    with pytest.raises(TypeError, match="sample_kwargs given twice"):
        gograph.make_graphed_callables(
            _Scaled(), (torch.randn(2, 4),), 3, False, {"scale": torch.ones(1)}, sample_kwargs={"scale": torch.ones(1)}
        )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: gograph.EagerEngine(pool_model="yes"), r"EagerEngine: pool_model must be a bool, got str"),
        (lambda: gograph.EagerEngine(pool_model=True, isolate_outputs=1), r"isolate_outputs must be a bool, got int"),
        (lambda: gograph.CudaEngine(isolate_outputs="yes"), r"CudaEngine: isolate_outputs must be a bool, got str"),
    ],
    ids=["pool_model", "eager-isolate_outputs", "cuda-isolate_outputs"],
)
def test_engine_flags_refuse_other_values(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_isolation_is_modelled_only_with_the_pool_model():
    assert not gograph.EagerEngine(isolate_outputs=True).isolates_outputs  # no pool: nothing to keep apart
    engine = gograph.EagerEngine(pool_model=True, isolate_outputs=True)
    assert engine.isolates_outputs and repr(engine) == "EagerEngine(pool_model=True, isolate_outputs=True)"
