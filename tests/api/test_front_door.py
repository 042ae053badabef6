"""The front door in a straight line: ``normalize`` checks every argument that needs neither the
core nor an engine, once; the core then plans the schedule once (a buffer-reuse request's sample
entries reorganised over that same schedule); then the build; nothing returns to the argument
checks after the core was asked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gograph
from gograph import megatron_order
from gograph.core import _plan

F = 8


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Every schedule the core is asked to plan, by its arguments."""
    calls: list[tuple[Any, ...]] = []
    plan = _plan.plan_schedule

    def counted(*args: Any, **kwargs: Any) -> _plan.Schedule:
        calls.append(args)
        return plan(*args, **kwargs)

    monkeypatch.setattr(_plan, "plan_schedule", counted)
    yield calls


def _layers(n: int) -> tuple[torch.nn.Module, ...]:
    torch.manual_seed(0)
    return tuple(torch.nn.Linear(F, F) for _ in range(n))


def _samples(n: int) -> list[tuple[torch.Tensor, ...]]:
    return [(torch.randn(4, F, requires_grad=True),) for _ in range(n)]


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "buffer_reuse"])
def test_the_schedule_is_planned_once(plans: list[tuple[Any, ...]], reuse: bool) -> None:
    micro = 4
    graphed = gograph.make_graphed_callables(
        _layers(2),
        _samples(2 * micro),
        _order=megatron_order(2, 0, 1, micro),
        _num_layers_per_chunk=2,
        _reuse_graph_input_output_buffers=reuse,
    )
    assert len(plans) == 1
    for g in graphed:
        g.reset()


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ({"engine": "gpu"}, ValueError, "engine must be None"),
        ({"sample": "not a tensor"}, AssertionError, "must contain only Tensors"),
    ],
    ids=["engine name", "non-tensor leaf"],
)
def test_argument_errors_come_before_the_core_plans(
    plans: list[tuple[Any, ...]], bad: dict[str, Any], error: type[Exception], match: str
) -> None:
    """A bad ``engine=`` or a sample leaf that is not a tensor is refused by ``normalize``, with
    a malformed ``_order`` beside it that only the core would refuse: the core is never asked."""
    samples: list[Any] = _samples(2)
    if "sample" in bad:
        samples[1] = (bad["sample"],)
    with pytest.raises(error, match=match):
        gograph.make_graphed_callables(
            _layers(1),
            samples,
            _order=[1, 1, 1, -1, -1],  # more forwards than samples: the core's ScheduleError
            _num_layers_per_chunk=1,
            engine=bad.get("engine"),
        )
    assert plans == []
    assert gograph.live_passes() == 0


def test_a_malformed_order_alone_is_the_cores_error(plans: list[tuple[Any, ...]]) -> None:
    with pytest.raises(gograph.ScheduleError):
        gograph.make_graphed_callables(_layers(1), _samples(2), _order=[1, 1, 1, -1, -1], _num_layers_per_chunk=1)
    assert len(plans) == 1
