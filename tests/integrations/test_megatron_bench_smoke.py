"""bench/megatron.py's CPU smoke run: the arms that run on the CPU (eager, gograph on the eager
engine) train bit for bit alike, the others are listed with why they did not run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_runs import ROOT, _env, needs_megatron

pytestmark = needs_megatron


def test_megatron_bench_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "megatron.json"
    cmd = [sys.executable, str(ROOT / "bench" / "megatron.py"), "--cpu-smoke", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"bench/megatron.py --cpu-smoke exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert sorted(result["arms"]) == ["eager", "gograph"]
    for arm, row in result["arms"].items():
        assert row["bitwise_equal_to_eager"], (arm, row["differences"])
        assert row["median_ms"] > 0 and row["peak_reserved_mib"] is None
    assert result["arms"]["gograph"]["graphs"]["engines"] == ["eager"]
    assert "CudaGraphManager needs CUDA" in result["skipped"]["local"]
    assert "te" in result["skipped"] or "te" in result["arms"]
    assert "| gograph | yes |" in proc.stdout
