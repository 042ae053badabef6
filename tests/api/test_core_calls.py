"""How many times the build and the replays call into the Go core: a recording core wraps every
function of ``gograph.core._core`` (every call site goes through that module) and logs the calls."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import gograph
from gograph.core import _core

from helpers import make_mlp


@pytest.fixture
def recording_core(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    # The counts below are the default path's; GOGRAPH_DEBUG=1 adds the checkers' calls.
    monkeypatch.delenv("GOGRAPH_DEBUG", raising=False)
    log: list[str] = []

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any) -> Any:
            log.append(name)
            return fn(*args)

        return recorded

    for name in (*_core.NAMES, "raw_replay"):
        monkeypatch.setattr(_core, name, wrap(name, getattr(_core, name)))
    yield log


def _build(n: int = 3, **kwargs: Any) -> tuple[list[torch.nn.Module], Any]:
    layers = [make_mlp(seed=i, d_in=8, d_out=8) for i in range(n)]
    samples = tuple((torch.randn(4, 8, requires_grad=i > 0),) for i in range(n))
    return layers, gograph.make_graphed_callables(tuple(layers), samples, engine=gograph.EagerEngine(), **kwargs)


def test_a_capture_is_two_core_calls(recording_core: list[str]) -> None:
    _, graphed = _build()
    log = recording_core
    captures = [i for i, name in enumerate(log) if name == "begin_pass_capture"]
    assert len(captures) == 6  # 3 forwards, 3 backwards
    for i in captures:  # nothing else crosses into the core while a capture is open
        assert log[i + 1] == "end_pass_capture", log[i : i + 3]
    assert Counter(log) == Counter(
        {
            "plan_schedule": 1,  # the schedule, planned and held in Go by handle
            "plan_steps": 1,  # read once
            "plan_warmup": 1,  # the warmup program
            "plan_capture": 1,  # the capture program, from what warmup learned
            "free_plan": 1,
            "new_pass": 3,
            "begin_pass_capture": 6,
            "end_pass_capture": 6,
            "seal_pass": 3,
        }
    )
    assert len(log) == 6 * 3 + 5  # 6N + 5 for N callables: 2 per capture, 1 per pass and seal, 5 per plan
    for m in graphed:
        m.reset()


def test_a_memory_plan_plans_its_captures_once(recording_core: list[str]) -> None:
    """plan_memory runs the build until planned: one warmup program, one capture program, which the
    core keeps for its prediction (on CUDA ``plan_memory`` reads it: no second planning)."""
    layers = [make_mlp(seed=i, d_in=8, d_out=8) for i in range(3)]
    samples = tuple((torch.randn(4, 8, requires_grad=i > 0),) for i in range(3))
    gograph.plan_memory(tuple(layers), samples, engine=gograph.EagerEngine())
    counts = Counter(recording_core)
    assert counts["plan_warmup"] == 1 and counts["plan_capture"] == 1
    assert counts["plan_memory"] == 0  # the eager engine has no device pool to predict
    assert counts["begin_pass_capture"] == 0 and counts["new_pass"] == counts["drop_pass"] == 3


def test_the_debug_guard_adds_one_call_per_pass_at_build(recording_core: list[str]) -> None:
    _, graphed = _build(debug_replay_order=True)
    assert Counter(recording_core)["set_replay_order_check"] == 3
    for m in graphed:
        m.reset()


def test_a_replay_is_one_core_call_and_a_reset_two(recording_core: list[str]) -> None:
    _, graphed = _build(2)
    recording_core.clear()
    x = torch.randn(4, 8)
    graphed[1](graphed[0](x)).sum().backward()
    assert recording_core == ["replay"] * 4  # the eager engine's lifecycle check; CUDA: raw_replay
    recording_core.clear()
    graphed[0].reset()
    assert recording_core == ["reset_pass", "pass_reset_error"]  # the count, then whether a destroy failed
    del graphed
