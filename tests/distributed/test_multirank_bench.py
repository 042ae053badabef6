"""bench/multirank.py on CPU ranks (gloo, eager engine), as a smoke run: a memory cell's rank
code on the session's spawned ranks, and the step-time phase end to end through the bench's own
launcher. The torch arm needs CUDA and is reported as skipped; on 2 ranks every arm trains to
the same parameters bit for bit (two-rank sums do not depend on the bucket order)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rank_world import gloo_skip_reason

pytestmark = pytest.mark.skipif(gloo_skip_reason() is not None, reason=str(gloo_skip_reason()))

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
multirank: Any = pytest.importorskip("multirank")

SMALL = ["--layers", "2", "--width", "16", "--hidden", "32", "--rows", "8", "--steps", "2", "--rounds", "2"]


def test_memory_cell_on_cpu_ranks(world) -> None:
    cfg = multirank.Config(layers=2, width=16, hidden=32, rows=8, steps=2, rounds=2, cpu=True)
    rows = world("eager").run(multirank.memory_rank, cfg, "gograph", size=2, timeout=60.0)
    summary = multirank.memory_summary(rows)
    assert summary["ranks_agree"], rows
    assert "peak_reserved_mib" not in summary  # no device memory on CPU ranks
    assert all(g > 0 for g in summary["graph_s"])
    eager = multirank.memory_summary(world("eager").run(multirank.memory_rank, cfg, "eager", size=2, timeout=60.0))
    assert eager["params"] == summary["params"]


def test_step_time_end_to_end_on_cpu_ranks(tmp_path: Path) -> None:
    out = tmp_path / "multirank.json"
    argv = ["--cpu", "--ranks", "2", "--modes", "zero", "--phases", "time", *SMALL, "--json", str(out)]
    assert multirank.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["arms"] == ["eager", "gograph", "gograph-chain"] and res["skipped"] == {"torch": "needs CUDA"}
    assert res["ref"] == "eager" and list(res["cells"]) == ["2/zero"]
    cell = res["cells"]["2/zero"]
    assert cell["config"]["set_to_none"] is False and cell["memory"] == {}
    for arm, t in cell["time"].items():
        assert len(t["rounds_ms"]) == 2 and t["median_ms"] > 0 and t["ratio_to_eager"] > 0, (arm, t)
        assert t["ranks_agree"], arm
    assert len({t["params"] for t in cell["time"].values()}) == 1, cell["time"]
    assert cell["time"]["eager"]["ratio_to_eager"] == 1.0
