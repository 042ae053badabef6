"""``gograph.integrations.megatron``: the one-line switch that binds gograph's
``make_graphed_callables`` into Megatron-Core's TransformerEngine graph path, its version check and
its refusals. In this process, with Megatron-Core imported as installed (no TransformerEngine: the
tests that need its graph names set them with monkeypatch)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from gograph.runtime import _capture_state

from megatron_runs import needs_megatron

pytestmark = needs_megatron


@pytest.fixture
def megatron() -> Iterator[Any]:
    """The switch module, with Megatron's cuda_graphs as it was bound put back afterwards."""
    import gograph.integrations.megatron as gm

    cuda_graphs = sys.modules.get("megatron.core.transformer.cuda_graphs") or __import__(
        "megatron.core.transformer.cuda_graphs", fromlist=["x"]
    )
    before = cuda_graphs.__dict__.get("make_graphed_callables")
    yield gm
    gm.use_transformer_engine()
    if before is None:
        cuda_graphs.__dict__.pop("make_graphed_callables", None)
    else:
        cuda_graphs.make_graphed_callables = before


@pytest.fixture
def te_graph_names(megatron: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Megatron's cuda_graphs as it is with TransformerEngine installed: HAVE_TE_GRAPHS and
    TransformerEngine's make_graphed_callables bound (a stand-in)."""
    import megatron.core.transformer.cuda_graphs as cuda_graphs

    def te_make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("TransformerEngine's function was called")

    monkeypatch.setattr(cuda_graphs, "HAVE_TE_GRAPHS", True)
    monkeypatch.setattr(cuda_graphs, "make_graphed_callables", te_make_graphed_callables, raising=False)
    return te_make_graphed_callables


def test_the_switch_binds_gograph_itself_and_back(megatron: Any, te_graph_names: Any) -> None:
    import megatron.core.transformer.cuda_graphs as cuda_graphs

    assert megatron.megatron_core_version() in megatron.SUPPORTED_VERSIONS
    assert not megatron.in_use()
    megatron.use_gograph()
    megatron.use_gograph()  # twice changes nothing
    # gograph's function behind the plan choice for Megatron's schedules, nothing else
    assert cuda_graphs.make_graphed_callables is megatron.megatron_make_graphed_callables
    assert megatron.in_use()
    assert megatron.record_capture_state in _capture_state._recorders
    megatron.use_transformer_engine()
    assert cuda_graphs.make_graphed_callables is te_graph_names
    assert not megatron.in_use() and megatron.record_capture_state not in _capture_state._recorders


def test_the_switch_refuses_an_untested_megatron(
    megatron: Any, te_graph_names: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import megatron.core.package_info as info
    import megatron.core.transformer.cuda_graphs as cuda_graphs

    monkeypatch.setattr(info, "__shortversion__", "0.18.0")
    with pytest.raises(
        RuntimeError, match=r"Megatron-Core 0\.18\.0 is not a version .*megatron-core==0\.19\.2.*strict=False"
    ):
        megatron.use_gograph()
    assert cuda_graphs.make_graphed_callables is te_graph_names
    with caplog.at_level(logging.WARNING, logger="gograph"):
        megatron.use_gograph(strict=False)
    assert cuda_graphs.make_graphed_callables is megatron.megatron_make_graphed_callables
    assert "0.18.0, which this switch was not tested with" in caplog.text


def test_the_switch_refuses_megatron_without_transformer_engine_graph_names(
    megatron: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import megatron.core.transformer.cuda_graphs as cuda_graphs

    monkeypatch.setattr(cuda_graphs, "HAVE_TE_GRAPHS", False)
    with pytest.raises(RuntimeError, match=r"HAVE_TE_GRAPHS is False.*pip install transformer-engine"):
        megatron.use_gograph()
    assert cuda_graphs.__dict__.get("make_graphed_callables") is not megatron.megatron_make_graphed_callables


def test_the_switch_says_megatron_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import gograph.integrations.megatron as gm

    monkeypatch.setitem(sys.modules, "megatron.core.transformer.cuda_graphs", None)
    with pytest.raises(ImportError, match=r"needs Megatron-Core .*pip install megatron-core==0\.19\.2"):
        gm.use_gograph()


def test_the_recorder_ignores_what_megatron_is_not_capturing(megatron: Any) -> None:
    import megatron.core.transformer.cuda_graphs as cuda_graphs
    import torch

    assert not cuda_graphs.is_graph_capturing()
    assert megatron.record_capture_state(torch.nn.Linear(2, 2)) is None
    cuda_graphs._set_capture_start()
    try:
        assert megatron.record_capture_state(torch.nn.Linear(2, 2)) is None  # not a Megatron layer
    finally:
        cuda_graphs._set_capture_end()


def test_chained_buffers_only_for_whole_transformer_layers_in_an_order(megatron: Any) -> None:
    """The switch asks for chain_buffers where Megatron graphs whole TransformerLayers in an
    _order (its TransformerBlock calls each with the previous one's output), nowhere else."""
    import types

    import torch
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def layer(modules: list[str]) -> Any:
        m = TransformerLayer.__new__(TransformerLayer)  # the type is what matters, not a built layer
        torch.nn.Module.__init__(m)
        m.config = types.SimpleNamespace(cuda_graph_modules=modules)
        return m

    whole = (layer([]), layer([]))
    order = {"_order": [1, -1], "num_warmup_iters": 1}
    assert megatron.chain_allowed(whole, order)
    assert not megatron.chain_allowed(whole, {"num_warmup_iters": 1})  # no _order
    assert not megatron.chain_allowed(whole, {**order, "num_warmup_iters": 0})
    assert not megatron.chain_allowed(whole, {**order, "share_microbatch_graphs": True})
    assert not megatron.chain_allowed((layer([]), layer(["attn"])), order)  # a partial layer
    assert not megatron.chain_allowed((layer([]), torch.nn.Linear(2, 2)), order)  # not a TransformerLayer
