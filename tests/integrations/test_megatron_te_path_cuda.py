"""Megatron-Core's TransformerEngine graph path with gograph's CUDA engine: the GPU counterpart of
test_megatron_te_path.py, bf16 with Megatron's own optimizer (``get_megatron_optimizer``, Adam).

The layers Megatron graphed must hold gograph's graphed callables on the CUDA engine with live
device graphs (an eager fallback fails), and training must be bitwise equal to eager. Where
TransformerEngine is installed, its ``make_graphed_callables`` is checked the same way.

On a GPU machine: Megatron-Core 0.19.2 importable (pip install megatron-core==0.19.2, or its
cp312 wheel / package folder on PYTHONPATH), then ``pytest -m cuda tests/integrations``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_runs import assert_trains_like_eager, needs_megatron, train

pytestmark = [pytest.mark.cuda, needs_megatron]

SIZES = ("--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--micro-batch", "2", "--microbatches", "2")


def _real_te() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except (ImportError, ValueError):
        return False


def _device_graphs(trace: dict[str, Any], layers: int) -> None:
    graphs = trace["graphs"]
    assert graphs["count"] == layers and graphs["types"] == ["GraphedCallable"], graphs
    assert graphs["engines"] == ["cuda"], (
        f"Megatron's layers were graphed on {graphs['engines']}, not gograph's CUDA engine"
    )
    assert graphs["live_graphs"] >= 2 * layers, "a forward and a backward device graph per layer must be live"


def test_megatron_trains_bitwise_with_gograph_cuda_graphs(tmp_path: Path) -> None:
    (traces,) = train(tmp_path, "--device", "cuda", "--arms", "eager,gograph", "--steps", "5", *SIZES)
    assert_trains_like_eager(traces)
    _device_graphs(traces[1], layers=2)


@pytest.mark.skipif(not _real_te(), reason="needs TransformerEngine (pip install transformer-engine[pytorch])")
def test_transformer_engine_trains_like_gograph_on_the_same_path(tmp_path: Path) -> None:
    (traces,) = train(tmp_path, "--device", "cuda", "--arms", "eager,te,gograph", "--steps", "5", *SIZES)
    assert_trains_like_eager(traces)
