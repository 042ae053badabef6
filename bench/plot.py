"""Draws docs/BENCHMARKS.md's summary from bench/results.json: two PNG plots (peak memory x
eager per workload, step time x torch) and the summary's markdown tables.

    python bench/plot.py                      # docs/img/benchmark-memory.png, docs/img/benchmark-steptime.png
    python bench/plot.py --tables             # the summary's tables, as docs/BENCHMARKS.md has them
    python bench/plot.py --results R --out DIR

The plots need matplotlib (`pip install matplotlib`); the tables need nothing. After a new
measurement, edit bench/results.json, then run both and paste the tables into docs/BENCHMARKS.md
(tests/tooling/test_bench_plot.py checks that the doc and the file agree).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results.json"
OUT = ROOT / "docs" / "img"
MODES = ("set_to_none=True", "set_to_none=False")


def load(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text())


def _pair(value: Any) -> tuple[float | None, float | None]:
    """A cell as (set_to_none=True, set_to_none=False); one number holds for both."""
    if isinstance(value, list):
        return value[0], value[1]
    return value, value


def _cell(value: Any, note: str = "") -> str:
    """``a / b`` for the two zero_grad modes, one number when they agree, "-" where not measured;
    a note in brackets."""
    lo, hi = _pair(value)
    if lo is None and hi is None:
        text = "-" if note else "not measured"
    elif lo == hi:
        text = f"{lo:.3f}"
    else:
        text = " / ".join("-" if v is None else f"{v:.3f}" for v in (lo, hi))
    return f"{text} ({note})" if note else text


def memory_table(results: dict[str, Any]) -> str:
    mem = results["memory"]
    head = ["workload", "eager (MiB)", *mem["arms"]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wl in mem["workloads"]:
        notes = wl.get("notes") or [""] * len(mem["arms"])
        lo, hi = wl["eager_mib"]
        eager = f"{lo}" if lo == hi else f"{lo} / {hi}"
        cells = [_cell(v, n) for v, n in zip(wl["values"], notes)]
        rows.append("| " + " | ".join([f"{wl['name']}: {wl['label']}", eager, *cells]) + " |")
    return "\n".join(rows)


def step_table(results: dict[str, Any]) -> str:
    st = results["step_time"]
    head = ["workload", *st["arms"], "measured on"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wl in st["workloads"]:
        when = f"{wl['commit']}, {wl['date']}" if wl["commit"] else "-"
        cells = [_cell(v) for v in wl["values"]]
        rows.append("| " + " | ".join([f"{wl['name']}: {wl['label']}", *cells, when]) + " |")
    return "\n".join(rows)


def _bars(ax: Any, groups: list[str], arms: list[str], values: list[list[Any]], ref: str) -> None:
    """Grouped bars: the set_to_none=True value, a tick at set_to_none=False, a note where not measured."""
    width = 0.8 / len(arms)
    for j in range(len(arms)):
        xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(groups))]
        for x, row in zip(xs, values):
            lo, hi = _pair(row[j])
            if lo is None:
                na = ax.get_xaxis_transform()  # x in data, y in axes coordinates
                ax.text(x, 0.02, "not measured", ha="center", va="bottom", fontsize=6, rotation=90, transform=na)
                continue
            ax.bar(x, lo, width * 0.9, color=f"C{j}")
            if hi is not None and hi != lo:
                ax.plot([x - width * 0.4, x + width * 0.4], [hi, hi], color="black", linewidth=1.5)
    for j, arm in enumerate(arms):
        ax.bar(0, 0, 0, color=f"C{j}", label=arm)  # one legend entry per arm
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_ylabel(ref)


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """Writes the two PNGs into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, name, ref in (
        ("memory", "benchmark-memory.png", "peak reserved memory x eager"),
        ("step_time", "benchmark-steptime.png", "step time x torch"),
    ):
        part = results[key]
        fig, ax = plt.subplots(figsize=(9, 4.6), dpi=110)
        _bars(ax, [w["name"] for w in part["workloads"]], part["arms"], [w["values"] for w in part["workloads"]], ref)
        modes = "bars: zero_grad(set_to_none=True); black tick: set_to_none=False where it differs"
        ax.set_title(f"{part['title']}\n{results['machine']}\n{modes}", fontsize=8)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--tables", action="store_true", help="print the summary's markdown tables instead")
    args = ap.parse_args(argv)
    results = load(args.results)
    if args.tables:
        print(memory_table(results), step_table(results), sep="\n\n")
        return 0
    try:
        paths = plot(results, args.out)
    except ImportError:
        print("bench/plot.py draws with matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
