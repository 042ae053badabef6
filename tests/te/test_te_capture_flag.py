"""TransformerEngine's capture flag: its modules read
``transformer_engine.pytorch.graph.is_graph_capturing()``, which its ``make_graphed_callables``
sets (``set_capture_start``) before warmup and clears (``set_capture_end``) after the captures;
gograph does the same whenever TransformerEngine is imported, and clears it on failure too.

A small stand-in for ``transformer_engine.pytorch.graph`` (the three functions, as TE defines
them) is installed in ``sys.modules``; the module under test reads the flag in its forward.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import gograph

from helpers import make_mlp

TE_GRAPH = "transformer_engine.pytorch.graph"


@pytest.fixture
def te_graph(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType(TE_GRAPH)
    state = {"capturing": False}

    def set_capture_start() -> None:
        state["capturing"] = True

    def set_capture_end() -> None:
        state["capturing"] = False

    mod.set_capture_start = set_capture_start  # type: ignore[attr-defined]
    mod.set_capture_end = set_capture_end  # type: ignore[attr-defined]
    mod.is_graph_capturing = lambda: state["capturing"]  # type: ignore[attr-defined]
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, TE_GRAPH, mod)
    return mod


class ReadsTheFlag(torch.nn.Module):
    """Records ``is_graph_capturing()`` at each forward, as TE modules consult it."""

    def __init__(self, te: types.ModuleType, fail: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.te, self.fail, self.seen = te, fail, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.te.is_graph_capturing())
        if self.fail:
            raise ValueError("boom")
        return self.lin(x)


def test_flag_is_set_while_graphing_and_cleared_after(te_graph):
    m = ReadsTheFlag(te_graph)
    assert not te_graph.is_graph_capturing()
    gograph.make_graphed_callables(m, (torch.randn(2, 4, requires_grad=True),), num_warmup_iters=2)
    assert m.seen and all(m.seen)  # every warmup and capture forward saw it set
    assert not te_graph.is_graph_capturing()
    n = len(m.seen)
    m(torch.randn(2, 4)).sum().backward()  # an eager-engine replay re-runs the forward: not graphing
    assert m.seen[n:] == [False]
    m.reset()


def test_flag_is_cleared_when_graphing_fails(te_graph):
    m = ReadsTheFlag(te_graph, fail=True)
    with pytest.raises(ValueError, match="boom"):
        gograph.make_graphed_callables(m, (torch.randn(2, 4),))
    assert m.seen == [True]
    assert not te_graph.is_graph_capturing()
    with pytest.raises(TypeError):  # refused before warmup: cleared too
        gograph.make_graphed_callables(m, (torch.randn(2, 4),), progress="yes")
    assert not te_graph.is_graph_capturing()


def test_plan_memory_warms_up_as_the_build_does(te_graph):
    m = ReadsTheFlag(te_graph)
    gograph.plan_memory(m, (torch.randn(2, 4, requires_grad=True),))
    assert m.seen == [True]
    assert not te_graph.is_graph_capturing()


def test_without_transformer_engine_nothing_is_touched(monkeypatch):
    monkeypatch.delitem(sys.modules, TE_GRAPH, raising=False)
    m = make_mlp()
    gograph.make_graphed_callables(m, (torch.randn(2, 8),))
    assert TE_GRAPH not in sys.modules  # not imported by gograph
    m.reset()
