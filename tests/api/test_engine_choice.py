"""Which engine runs, said where it matters: CPU tensors on a machine with CUDA run the eager
engine (nothing is graphed), which gograph says once, as a UserWarning at the caller's line;
the build's log line counts passes, not graphs, on the eager engine."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import gograph
from gograph.runtime import engines

from helpers import make_mlp


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine where torch sees a GPU (the engine choice reads torch.cuda.is_available())."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engines, "_warned_eager", [])


def test_cpu_tensors_beside_cuda_warn_once_at_the_callers_line(cuda_present):
    m = make_mlp()
    with pytest.warns(UserWarning, match=r"CPU tensors.*runs the eager engine.*although CUDA is available") as rec:
        gograph.make_graphed_callables(m, (torch.randn(2, 8),))
    assert [w.filename for w in rec] == [__file__]  # stacklevel: the user's call, not gograph's internals
    m.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m2 = make_mlp()
        gograph.make_graphed_callables(m2, (torch.randn(2, 8),))  # once per process
        m2.reset()


def test_plan_memory_warns_too(cuda_present):
    with pytest.warns(UserWarning, match="eager engine") as rec:
        gograph.plan_memory(make_mlp(), (torch.randn(2, 8),))
    assert [w.filename for w in rec] == [__file__]


@pytest.mark.parametrize("engine", ["eager", "engine"])
def test_an_explicit_eager_engine_does_not_warn(cuda_present, engine):
    chosen = gograph.EagerEngine() if engine == "engine" else engine
    m = make_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gograph.make_graphed_callables(m, (torch.randn(2, 8),), engine=chosen)
    m.reset()


def test_no_warning_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(engines, "_warned_eager", [])
    m = make_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gograph.make_graphed_callables(m, (torch.randn(2, 8),))
    m.reset()


def test_progress_warning_points_at_the_caller(monkeypatch):
    import sys

    from gograph.runtime import _observe

    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(_observe, "_said_no_tqdm", [])
    with pytest.warns(UserWarning, match="tqdm") as rec:
        f = gograph.make_graphed_callables(lambda t: t + 1, (torch.randn(2),), progress=True, engine="eager")
    assert [w.filename for w in rec] == [__file__]
    f.reset()


def test_the_eager_build_line_counts_passes(caplog):
    m = make_mlp()
    with caplog.at_level(logging.INFO, logger="gograph"):
        gograph.make_graphed_callables(m, (torch.randn(2, 8),), engine="eager")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built ")]
    assert line.startswith("built 1 pass(es) (no CUDA graph") and "graph(s)" not in line
    m.reset()
