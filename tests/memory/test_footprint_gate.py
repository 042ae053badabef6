"""The CPU memory gate: every footprint cell's modelled peak reserved memory against its record.

bench/footprint_model.py runs a footprint cell (workload, arm, ``zero_grad`` mode) at full size on
the CPU without computing, puts each allocation in the pool it takes on CUDA and runs them through
the core's model of the caching allocator. That model reproduces what the layout of gograph's own
buffers costs on a GPU: on the chain workload, one packed allocation per backward for a first
step's owned grad copies models 198 MiB (``set_to_none=True``) and 326 MiB (``False``) above
copies of natural sizes, exactly what an H200 measured. The pipeline rank's build
(``pipeline-build``, bench/pipeline.py's call with buffer reuse, its samples in a list) is held
at 8 and 64 microbatches: what graphing allocates must not grow with the microbatch count.

The model is deterministic, so each cell's figures (peak reserved and peak allocated) are held
exactly: a change that moves any cell, up or down, fails here until the record is rewritten in
the same commit (with the GPU's figure beside it in docs/BENCHMARKS.md where one exists):

    PYTHONPATH=python python bench/footprint_model.py --arms eager,gograph,gograph:lend_param_grads=true,\\
        gograph:chain_buffers=true+shared_samples=all+recv_into_static=1,\\
        gograph:chain_buffers=true+shared_samples=all+recv_into_static=1+loss_in_graph=1 \\
        --pipeline-arms gograph:_reuse_graph_input_output_buffers=true --json tests/memory/footprint_gate.json
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import pytest
import torch

import gograph.replay.graphed

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
RECORD = pathlib.Path(__file__).with_name("footprint_gate.json")
MiB = 2**20

pytestmark = [
    pytest.mark.one_python,  # ~1 min of full-size cells: once per CI run, not per CPython
    pytest.mark.skipif(not torch.autograd.kineto_available(), reason="the model records with the profiler (kineto)"),
]


def _model() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import footprint_model
    finally:
        sys.path.remove(str(BENCH))
    return footprint_model


def _records() -> dict[tuple[str, str, str], tuple[int, int]]:
    rows = json.loads(RECORD.read_text())["rows"]
    return {(r["workload"], r["arm"], r["mode"]): (int(r["peak_reserved"]), int(r["peak_allocated"])) for r in rows}


RECORDS = _records()
PIPELINE = "pipeline-build"


def _figures(cell: dict[str, Any]) -> tuple[int, int]:
    return int(cell["peak_reserved"]), int(cell["peak_allocated"])


@pytest.mark.parametrize(("workload", "arm", "mode"), sorted(RECORDS), ids=["-".join(c) for c in sorted(RECORDS)])
def test_a_cell_models_its_record_exactly(workload: str, arm: str, mode: str) -> None:
    recorded = RECORDS[(workload, arm, mode)]
    got = _figures(_model().run_cell(workload, arm, mode))
    if got != recorded:
        (r, a), (gr, ga) = recorded, got
        pytest.fail(
            f"{workload} {arm} {mode}: modelled peak reserved {gr / MiB:.3f} MiB (record {r / MiB:.3f}), peak "
            f"allocated {ga / MiB:.3f} MiB (record {a / MiB:.3f}). A regression, or an improvement to record: rewrite "
            "tests/memory/footprint_gate.json (module docstring) in the same commit"
        )


def test_the_pipeline_build_is_flat_in_the_microbatch_count() -> None:
    """With buffer reuse and its samples in a list, graphing the pipeline rank allocates the same
    at 64 microbatches as at 8 (the record holds both; this says why they must be equal)."""
    arms = {arm for (w, arm, _) in RECORDS if w == PIPELINE}
    assert arms, "the record holds no pipeline build cell"
    for arm in arms:
        assert RECORDS[(PIPELINE, arm, "8")] == RECORDS[(PIPELINE, arm, "64")], arm


GRAPHED_CELLS = sorted(k for k in RECORDS if k[0] != PIPELINE and k[1] != "eager")


@pytest.mark.parametrize(("workload", "arm", "mode"), GRAPHED_CELLS, ids=["-".join(c) for c in GRAPHED_CELLS])
def test_the_gate_sees_a_first_step_that_packs_its_grad_copies(
    monkeypatch: pytest.MonkeyPatch, workload: str, arm: str, mode: str
) -> None:
    """The layout that raised every chain cell (one packed allocation per backward for the first
    step's owned copies) fails the gate in every cell that owns copies: the model sees what it cost
    on the GPU (chain: +198 / +326 MiB as an H200 measured; blocks: +42 MiB, 1 %, which a tolerance
    of 1 % let through). Cells whose grads are lent own no copies and must not move."""
    packed = gograph.replay.graphed.owned_copies
    monkeypatch.setattr(gograph.replay.graphed, "owned_copies", lambda grads, natural=False: packed(grads, False))
    got = _figures(_model().run_cell(workload, arm, mode))
    if "lend_param_grads=true" in arm:
        assert got == RECORDS[(workload, arm, mode)], "lent grads: no copies to pack"
    else:
        assert got != RECORDS[(workload, arm, mode)], f"packed copies modelled at {got[0] / MiB:.0f} MiB, as recorded"
