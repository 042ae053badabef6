"""How close ``gograph.plan_memory`` comes to what the real build then holds (issue: a memory
plan before capture).

Every cell (a workload of bench/workloads.py and a gograph arm, as in bench/footprint.py) runs in
a fresh process: model init, ``plan_memory`` (checked to leave nothing behind: allocated
memory, generator state, live passes and plans), then ``make_graphed_callables`` with the same
arguments and a few training steps. Compared, prediction against measurement:

* static bytes and pool-planned bytes: the plan's totals against ``memory_report``'s;
* the graph pool's reserved bytes: against ``memory_report``'s pool reserved after the build;
* the build's peak: against ``max_memory_reserved()`` over ``make_graphed_callables``, relative
  to before it;
* what the graphs hold through a training step: against the pool's reserved bytes plus the
  buffers the build allocated outside it, read after the steps.

  python bench/plan_accuracy.py                      # all cells, table
  python bench/plan_accuracy.py --cell chain gograph:chain_buffers=true+shared_samples=true
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph

from footprint import parse_arm, run_cells
from workloads import workload

MiB = 2**20
CHAIN = "gograph:chain_buffers=true+shared_samples=true"
PIPE = "gograph:_reuse_graph_input_output_buffers=true+chain_buffers=true+shared_samples=true"
CELLS = [("chain", "gograph"), ("chain", CHAIN), ("blocks", "gograph"), ("blocks", CHAIN), ("pipeline", PIPE)]


def run_cell(name: str, arm: str, steps: int, small: bool, detail: bool = False) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    wl = workload(name, small)
    _, kwargs = parse_arm(arm)
    shared = bool(kwargs.pop("shared_samples", False))
    layers = wl.build(device)
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=1e-3)
    samples = wl.sample_args(device, share_chained=shared)
    kw = {**wl.graph_kwargs(), **kwargs}
    gc.collect()
    torch.cuda.synchronize()
    before = (torch.cuda.memory_allocated(), torch.cuda.get_rng_state(), gograph.live_passes(), gograph.live_plans())
    plan = gograph.plan_memory(tuple(layers), samples, **kw)
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), torch.cuda.get_rng_state(), gograph.live_passes(), gograph.live_plans())
    trace_left = {
        "allocated_bytes": after[0] - before[0],
        "rng_equal": bool(torch.equal(before[1], after[1])),
        "passes": after[2] - before[2],
        "plans": after[3] - before[3],
    }
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    after_ops = _record_captures() if detail else None
    graphed = gograph.make_graphed_callables(tuple(layers), samples, **kw)
    torch.cuda.synchronize()
    build_peak = torch.cuda.max_memory_reserved() - base
    calls = list(graphed)
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(steps):
        wl.step(calls, wl.batch(gen, device))
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t, rt = plan.totals, gograph.memory_report(graphed).totals
    return {
        "workload": name,
        "arm": arm,
        "left_behind": trace_left,
        "static": [t.static_bytes, rt.static_bytes],
        "pool_planned": [t.pool_planned_bytes, rt.pool_planned_bytes],
        "pool_reserved": [t.pool_reserved_bytes, rt.pool_reserved_bytes],
        "build_peak": [t.build_peak_bytes, build_peak],
        "step_graph": [t.step_graph_bytes, (rt.pool_reserved_bytes or 0) + t.new_buffer_bytes],
        "pool_peak_allocated": t.pool_peak_allocated_bytes,
        "warmup_reserved": t.warmup_peak_reserved_bytes,
        "outside_pool": t.outside_pool_bytes,
        **(
            {}
            if after_ops is None
            else {
                "segments": [plan.pool_segment_bytes, _pool_segments()],
                "after_ops": [[(op, r, a) for op, r, a in plan.pool_after_ops if op[0] in "FB"], after_ops],
            }
        ),
    }


def _pool_segments() -> list[int]:
    segs = torch.cuda.memory_snapshot()
    return [int(s["total_size"]) for s in segs if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]


def _record_captures() -> list[tuple[str, int, int]]:
    """Pool reserved and allocated after each real capture (``--detail``: wraps the engine's
    capture; compared with the plan's ``pool_after_ops``)."""
    from gograph.engines import CudaEngine

    seen: list[tuple[str, int, int]] = []
    capture = CudaEngine.capture

    def recorded(self: Any, pass_id: int, kind: int, *args: Any, **kwargs: Any) -> Any:
        out = capture(self, pass_id, kind, *args, **kwargs)
        segs = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
        used = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
        seen.append((f"{'FB'[kind] if kind < 2 else 'W'} {pass_id}", sum(s["total_size"] for s in segs), used))
        return out

    CudaEngine.capture = recorded  # type: ignore[method-assign]
    return seen


def run_fresh(name: str, arm: str, steps: int, small: bool) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", name, arm, "--steps", str(steps)]
    if small:
        cmd.append("--small")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"workload": name, "arm": arm, "error": " | ".join(tail)}
    return dict(json.loads(lines[-1]))


def table(rows: list[dict[str, Any]]) -> str:
    cols = ("static", "pool_planned", "pool_reserved", "build_peak", "step_graph")
    head = " | ".join(f"{c} MiB (predicted / measured, ratio)" for c in cols)
    out = [f"| workload | arm | {head} | left behind |", "|---|---|" + "---|" * len(cols) + "---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['workload']} | {r['arm']} | error: {r['error']} |")
            continue
        cells = []
        for c in cols:
            p, m = r[c]
            ratio = "-" if not p or not m else f"{p / m:.3f}"
            cells.append(f"{(p or 0) / MiB:.0f} / {(m or 0) / MiB:.0f} ({ratio})")
        lb = r["left_behind"]
        left = "nothing" if lb == {"allocated_bytes": 0, "rng_equal": True, "passes": 0, "plans": 0} else json.dumps(lb)
        out.append(f"| {r['workload']} | {r['arm']} | " + " | ".join(cells) + f" | {left} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--cell", nargs=2, metavar=("WORKLOAD", "ARM"))
    ap.add_argument("--detail", action="store_true", help="with --cell: segments and the pool after each capture")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and gograph.cuda_available()):
        print(f"bench/plan_accuracy.py needs a GPU ({gograph.cuda_unavailable_reason()})", file=sys.stderr)
        return 2
    if args.cell:
        print(json.dumps(run_cell(*args.cell, steps=args.steps, small=args.small, detail=args.detail)))
        return 0
    run_cells(lambda c: run_fresh(*c, args.steps, args.small), CELLS, args.jobs, table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
