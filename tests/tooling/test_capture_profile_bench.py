"""bench/capture_profile.py splits a pipeline rank's graphing call into warmup, captures and the
rest, and names the functions that took the time, on the eager engine at toy sizes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "capture_profile.py"


def test_capture_profile_splits_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH.parent))  # it imports bench/pipeline.py
    spec = importlib.util.spec_from_file_location("capture_profile_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "profile.json"
    args = ["--cpu-smoke", "--microbatches", "4", "--modes", "reuse,reuse+chain", "--top", "5", "--json", str(out)]
    assert bench.main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["microbatches"]) for r in rows] == [("reuse", 4), ("reuse+chain", 4)]
    for r in rows:
        for split in (r["plain"], r["profiled"]):
            parts = split["warmup_seconds"] + split["capture_seconds"] + split["rest_seconds"]
            assert split["warmup_seconds"] > 0 and split["capture_seconds"] > 0
            assert parts == pytest.approx(split["call_seconds"])
        assert len(r["top_own"]) == 5 and r["top_own"][0]["own"] >= r["top_own"][-1]["own"]
        # the profiled call itself is among the functions with the most time in all
        assert any("make_graphed_callables" in row["function"] for row in r["top_cum"])
    sys.modules.pop("pipeline", None)
