"""scripts/gpu_verify.py, the one-call GPU run: its parts fit one call of ten minutes, a part over
its limit is stopped and reported while the others run, and the CPU smoke run of every part that
has one ends green with a line per part and one JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_verify  # noqa: E402

#: What one call may take (the device's limit is ten minutes; the rest is setup and copying).
CALL_BUDGET_S = 540


def _worst_case_seconds(parts: list[gpu_verify.Part]) -> int:
    """The run's length if every part used its whole limit: a group's parts run side by side."""
    total, groups = 0, {}
    for p in parts:
        if p.group:
            groups[p.group] = max(groups.get(p.group, 0), p.limit_s)
        else:
            total += p.limit_s
    return total + sum(groups.values())


def test_the_parts_fit_one_call(tmp_path: Path) -> None:
    parts = gpu_verify.parts(tmp_path, seed=1, cases=600)
    names = [p.name for p in parts]
    for needed in ("suite", "upstream", "fuzzer", "pipeline", "pipeline32", "pipeline64", "megatron", "multirank"):
        assert needed in names
    assert {"capture", "steptime"} <= set(names)
    assert _worst_case_seconds(parts) <= CALL_BUDGET_S, _worst_case_seconds(parts)


def test_a_part_over_its_limit_is_stopped_and_the_next_still_runs(tmp_path: Path) -> None:
    slow = gpu_verify.Part("slow", [sys.executable, "-c", "import time; time.sleep(30)"], None, 1)
    quick = gpu_verify.Part("quick", [sys.executable, "-c", "print('done')"], None, 30)
    results = gpu_verify.run([slow, quick], tmp_path, cpu=False)
    assert results["slow"]["status"] == "timeout" and results["slow"]["seconds"] < 15
    assert results["quick"]["status"] == "ok" and results["quick"]["tail"] == ["done"]


@pytest.mark.one_python  # about a minute: the smoke paths of the benches and a few fuzz cases
def test_the_cpu_smoke_run_is_green(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_verify.py"), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "verify.json").read_text())
    parts = summary["parts"]
    assert set(parts) == {p.name for p in gpu_verify.parts(tmp_path, 1, 5)}
    assert {n for n, r in parts.items() if r["status"] == "ok"} == {
        "suite",
        "fuzzer",
        "pipeline",
        "megatron",
        "multirank",
    }
    assert all(
        r["status"] == "skipped"
        for n, r in parts.items()
        if n not in ("suite", "fuzzer", "pipeline", "megatron", "multirank")
    )
    assert parts["fuzzer"]["cases"] == 5 and parts["fuzzer"]["failing_cases"] == 0
    for name in parts:
        assert f"verify {name}: " in done.stdout
