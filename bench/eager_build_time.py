"""How long the eager engine's ``make_graphed_callables`` takes, for two source trees side by side.

The eager engine's build runs the whole executor (schedule, warmup program, planning, capture
program, seal) without a GPU, so the executor's own cost is measurable on any machine. Each
round runs one child process per tree, in alternating order (A B, B A, ...) and with the same
string-hash seed (the round's number: set iteration orders are the same in both); a child graphs the
workload once untimed, then ``--graphings`` times (each after a full garbage collection, so that
a graphing pays for the collections its own allocations trigger), and reports each graphing's
seconds. The medians per tree and the median of the per-round ratios (B / A) are printed.

Workloads: ``W2`` is bench/run.py's (32 per-layer ``Linear(256) + ReLU``, input 64x256, fp32);
``W1s`` is W1's shape scaled for a CPU (8 per-layer ``Linear -> GELU -> Linear`` of width 512,
input 1024x512, fp32; W1 itself is 4096-wide bf16); ``W2t`` is W2 with 16-wide layers and 4 rows,
where the tensors' arithmetic is negligible and the executor's own Python is most of the time.

  python bench/eager_build_time.py --tree A=python --tree B=/path/to/other/checkout/python \
      [--only W2,W1s] [--rounds 7] [--graphings 5] [--json out.json]

Each tree is a folder holding the ``gograph`` package with its core built in place
(``make build`` there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = {"W2": (32, 256, 64, "linear_relu"), "W1s": (8, 512, 1024, "mlp"), "W2t": (32, 16, 4, "linear_relu")}


def child(workload: str, graphings: int) -> None:
    import torch

    import gograph

    torch.set_num_threads(1)
    n, width, rows, block = WORKLOADS[workload]

    def layers() -> tuple[torch.nn.Module, ...]:
        torch.manual_seed(0)
        if block == "mlp":
            mk = lambda: torch.nn.Sequential(
                torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)
            )
        else:
            mk = lambda: torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
        return tuple(mk() for _ in range(n))

    def one() -> float:
        mods = layers()
        samples = tuple((torch.randn(rows, width, requires_grad=i > 0),) for i in range(n))
        gc.collect()  # each graphing pays for its own garbage, not the previous round's
        t0 = time.perf_counter()
        graphed = gograph.make_graphed_callables(mods, samples, engine="eager")
        seconds = time.perf_counter() - t0
        for g in graphed:
            g.reset()
        return seconds

    one()  # imports, first allocations
    print(json.dumps([one() for _ in range(graphings)]))


def run_child(tree: str, workload: str, graphings: int, hash_seed: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "PYTHONHASHSEED": str(hash_seed)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", workload, "--graphings", str(graphings)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a python/ folder (two)")
    p.add_argument("--only", default="W2,W1s")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--graphings", type=int, default=5)
    p.add_argument("--json", default="")
    p.add_argument("--child", default="")
    a = p.parse_args()
    if a.child:
        child(a.child, a.graphings)
        return
    trees = dict(t.split("=", 1) for t in a.tree)
    if len(trees) != 2:
        raise SystemExit("--tree NAME=PATH twice: the reference first, then the tree compared with it")
    (ref, ref_path), (new, new_path) = trees.items()
    results = []
    for workload in a.only.split(","):
        times: dict[str, list[float]] = {ref: [], new: []}
        ratios = []
        for r in range(a.rounds):
            order = [(ref, ref_path), (new, new_path)] if r % 2 == 0 else [(new, new_path), (ref, ref_path)]
            got = {name: statistics.median(run_child(path, workload, a.graphings, r)) for name, path in order}
            for name, s in got.items():
                times[name].append(s)
            ratios.append(got[new] / got[ref])
        row = {
            "workload": workload,
            "rounds": a.rounds,
            "graphings_per_round": a.graphings,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            f"median_round_ratio_{new}_over_{ref}": statistics.median(ratios),
            "ratios": ratios,
        }
        results.append(row)
        print(
            f"{workload}: {ref} median {row['median_s'][ref] * 1e3:.2f} ms, {new} median "
            f"{row['median_s'][new] * 1e3:.2f} ms; median per-round ratio {new}/{ref} "
            f"x{statistics.median(ratios):.3f} (min x{min(ratios):.3f}, max x{max(ratios):.3f})"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "trees": trees}, f, indent=1)


if __name__ == "__main__":
    main()
