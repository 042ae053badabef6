"""bench/plot.py and bench/results.json: the summary of docs/BENCHMARKS.md is drawn from the
recorded figures, and the page shows the same tables the file renders (so the two cannot drift).
The plots need matplotlib; without it that test is skipped and the tables are still checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import plot  # noqa: E402


@pytest.fixture(scope="module")
def results() -> dict:
    return plot.load()


def test_the_page_shows_the_recorded_figures(results: dict) -> None:
    page = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    for table in (plot.memory_table(results), plot.step_table(results)):
        assert table in page, f"docs/BENCHMARKS.md lacks the table bench/plot.py --tables prints:\n{table}"


def test_every_workload_has_a_value_or_says_not_measured(results: dict) -> None:
    for part in ("memory", "step_time"):
        arms = results[part]["arms"]
        for wl in results[part]["workloads"]:
            assert len(wl["values"]) == len(arms), wl["name"]
    table = plot.memory_table(results)
    assert "not measured" in table  # TransformerEngine's column: no invented numbers
    row = next(line for line in table.splitlines() if line.startswith("| chain"))
    assert "| 1.535 / 1.265 | 1.295 / 1.243 |" in row


def test_the_plots_are_drawn(results: dict, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="bench/plot.py draws with matplotlib (pip install matplotlib)")
    paths = plot.plot(results, tmp_path)
    assert [p.name for p in paths] == ["benchmark-memory.png", "benchmark-steptime.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_the_committed_plots_exist() -> None:
    for name in ("benchmark-memory.png", "benchmark-steptime.png"):
        assert (ROOT / "docs" / "img" / name).read_bytes()[:4] == b"\x89PNG"
        assert f"img/{name}" in (ROOT / "docs" / "BENCHMARKS.md").read_text()
