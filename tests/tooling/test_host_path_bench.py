"""bench/host_path.py runs its four arms on the CPU and reports each against the bare node."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_path.py"


def test_host_path_bench_runs_every_arm(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("host_path_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "host.json"
    assert bench.main(["--layers", "3", "--rounds", "2", "--steps", "3", "--json", str(out)]) == 0
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bare", "bare-module", "torch-shaped", "gograph", "gograph-chain"}
    assert rows["bare"]["x_bare"] == 1.0
    assert all(r["us_per_layer_step"] > 0 for r in rows.values())
