"""The CPU memory gate: every footprint cell's modelled peak reserved memory against its record.

bench/footprint_model.py runs a footprint cell (workload, arm, ``zero_grad`` mode) at full size on
the CPU without computing, puts each allocation in the pool it takes on CUDA and runs them through
the core's model of the caching allocator. That model reproduces what the layout of gograph's own
buffers costs on a GPU: on the chain workload, one packed allocation per backward for a first
step's owned grad copies models 198 MiB (``set_to_none=True``) and 326 MiB (``False``) above
copies of natural sizes, exactly what an H200 measured. Each cell's figure is recorded in
footprint_gate.json; a cell more than 1 % above its record fails. After a change that lowers
cells, rewrite the record:

    PYTHONPATH=python python bench/footprint_model.py --arms eager,gograph,gograph:lend_param_grads=true,\\
        gograph:chain_buffers=true+shared_samples=all+recv_into_static=1,\\
        gograph:chain_buffers=true+shared_samples=all+recv_into_static=1+loss_in_graph=1 \\
        --json tests/memory/footprint_gate.json
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import pytest
import torch

import gograph.graphed

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
RECORD = pathlib.Path(__file__).with_name("footprint_gate.json")
TOLERANCE = 0.01
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


def _records() -> dict[tuple[str, str, str], int]:
    rows = json.loads(RECORD.read_text())["rows"]
    return {(r["workload"], r["arm"], r["mode"]): int(r["peak_reserved"]) for r in rows}


RECORDS = _records()


@pytest.mark.parametrize(("workload", "arm", "mode"), sorted(RECORDS), ids=["-".join(c) for c in sorted(RECORDS)])
def test_a_cell_reserves_no_more_than_its_record(workload: str, arm: str, mode: str) -> None:
    recorded = RECORDS[(workload, arm, mode)]
    got = _model().run_cell(workload, arm, mode)["peak_reserved"]
    assert got <= recorded * (1 + TOLERANCE), (
        f"{workload} {arm} set_to_none={mode == 'none'}: modelled peak reserved {got / MiB:.0f} MiB, "
        f"{(got / recorded - 1) * 100:.1f} % above its record ({recorded / MiB:.0f} MiB)"
    )
    if got < recorded * (1 - TOLERANCE):
        pytest.fail(
            f"{workload} {arm}: modelled {got / MiB:.0f} MiB, more than 1 % below its record "
            f"({recorded / MiB:.0f} MiB): rewrite tests/memory/footprint_gate.json (module docstring) so the gate "
            "holds the new figure"
        )


def test_the_gate_sees_a_first_step_that_packs_its_grad_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout that raised every chain cell (one packed allocation per backward for the first
    step's owned copies) would fail the gate: the model sees what it cost on the GPU."""
    packed = gograph.graphed.owned_copies
    monkeypatch.setattr(gograph.graphed, "owned_copies", lambda grads, natural=False: packed(grads, False))
    recorded = RECORDS[("chain", "gograph", "zero")]
    got = _model().run_cell("chain", "gograph", "zero")["peak_reserved"]
    assert got > recorded * (1 + TOLERANCE), f"packed copies modelled at {got / MiB:.0f} MiB"
