"""Megatron-Core 0.19.2's own TransformerEngine graph path (``TECudaGraphHelper``) trains with
``gograph.make_graphed_callables`` bound in its place, bit for bit like eager: CPU, eager engine.

A GPT from Megatron's local layer spec in Float16Module (bf16) and Megatron's DDP, trained by
Megatron's schedules with ``cuda_graph_impl="transformer_engine"``, ``create_cudagraphs()`` at
``cuda_graph_warmup_steps`` (bench/megatron_train.py). Every microbatch loss, every step's
``main_grad``s and the final parameters are compared with the eager run of the same model, data
and seeds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_runs import assert_trains_like_eager, needs_megatron, train

pytestmark = needs_megatron

SMALL = ("--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--micro-batch", "2")


def test_megatron_trains_bitwise_with_gograph(tmp_path: Path) -> None:
    (traces,) = train(
        tmp_path, "--device", "cpu", "--arms", "eager,gograph", "--steps", "4", "--microbatches", "2", *SMALL
    )
    assert_trains_like_eager(traces)
    graphs = traces[1]["graphs"]
    # without a pipeline Megatron captures one microbatch per layer, with _order=[1, -1]
    assert graphs["count"] == 2 and graphs["types"] == ["GraphedCallable"] and graphs["engines"] == ["eager"]
    assert graphs["labels"] == [
        "TransformerLayer[chunk 1 layer 0 microbatch 0]",
        "TransformerLayer[chunk 1 layer 1 microbatch 0]",
    ]
    assert graphs["chained"] == 1  # the switch chains the second layer to the first (whole layers)


def test_megatron_interleaved_pipeline_trains_bitwise_with_gograph(tmp_path: Path) -> None:
    """Two pipeline ranks (gloo) with two virtual chunks each: Megatron passes ``_order`` for its
    interleaved 1F1B schedule over 2 microbatches, ``_num_layers_per_chunk`` and buffer reuse.
    (At world size 1 Megatron builds no virtual chunks, and its helper asserts one chunk.)"""
    ranks = train(
        tmp_path,
        "--device",
        "cpu",
        "--arms",
        "eager,gograph",
        "--steps",
        "3",
        "--layers",
        "4",
        "--vpp",
        "2",
        "--microbatches",
        "2",
        *SMALL[2:],
        ranks=2,
        timeout=400,
    )
    for traces in ranks:
        assert_trains_like_eager(traces)
        labels = traces[1]["graphs"]["labels"]
        assert len(labels) == 4 and {"chunk 2", "microbatch 1"} <= {w for lab in labels for w in _words(lab)}
    assert any(t["losses"][0] for t in ranks[-1]) and not any(t["losses"][0] for t in ranks[0])  # the last stage's


def _words(label: str) -> set[str]:
    inner = label[label.index("[") + 1 : -1]
    parts = inner.split()
    return {f"{a} {b}" for a, b in zip(parts[::2], parts[1::2])}


def test_the_surface_leaves_megatrons_own_graphs_a_tracker_check() -> None:
    """Megatron's own CudaGraphManager (``cuda_graph_impl="local"``) asserts, once
    ``HAVE_TE_GRAPHS`` is set, ``isinstance(rng_tracker, TECudaRNGStatesTracker)`` with the class
    from ``megatron.core.extensions.transformer_engine``: with the surface in place that is a class
    Megatron's own tracker is not an instance of (not None: ``isinstance`` would raise)."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    code = (
        "import sys\n"
        "import megatron.core.transformer.cuda_graphs as cg\n"
        f"sys.path.append({str(bench)!r})  # after Megatron: bench/megatron.py is not the package\n"
        "from megatron_te_surface import provide\n"
        "assert provide() and cg.HAVE_TE_GRAPHS\n"
        "from megatron.core.extensions.transformer_engine import TECudaRNGStatesTracker as T\n"
        "from megatron.core.tensor_parallel.random import CudaRNGStatesTracker\n"
        "assert isinstance(T, type) and not isinstance(CudaRNGStatesTracker(), T), T\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
