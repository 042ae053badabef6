"""Memory of graphed training against eager training of the same model (issue: the eager floor).

Every cell -- a workload (bench/workloads.py: chain, blocks, pipeline), an arm (eager, torch's
``torch.cuda.make_graphed_callables``, gograph, or gograph with extra arguments) and a
``zero_grad(set_to_none=...)`` mode -- runs in a fresh process: model init, then (graphed arms)
``make_graphed_callables`` and ``--steps`` SGD training steps. Reported, relative to just after
model init: the peak of ``torch.cuda.max_memory_reserved()`` (what the user's GPU must hold),
the peak allocated, the peak during ``make_graphed_callables`` alone, and a digest of the
parameters after training (equal digests: bitwise-equal training). Graph pools make
``memory_allocated`` blind to what replays write into pool blocks, so reserved is the number that
counts. gograph arms also report where the reserved memory sits (graph pool segments vs the rest)
and the memory report's static bytes.

  python bench/footprint.py                                # all cells, table, GPU
  python bench/footprint.py --workloads chain --json out.json
  python bench/footprint.py --arms eager,gograph,gograph:chain_buffers=true+shared_samples=true --jobs 4
  python bench/footprint.py --cell chain gograph none      # one cell, in this process (JSON line)

Bench options in an arm (not gograph's): ``shared_samples`` (``=all``: layer 0's too, see
bench/workloads.py), ``loss_in_graph`` (see graph());
``copies`` (eager: the copies any graph needs); ``pools`` (eager: the batch and the loss in a
pool of their own, the layers' memory in the default pool: the two pools graphed training has,
bench/workloads.py's CallerPool; with ``copies`` the floor of graphed training with the loss
outside the graphs); for the pipeline ``recv`` (every chunk input is
received at its forward and dropped after its backward, as on a pipeline rank, instead of made
up front) and ``recv_into_static`` (gograph: received straight into the graph's static input,
Megatron-LM's pattern, so the replay copies nothing in). Compare ``recv`` arms with ``recv`` arms:

  python bench/footprint.py --workloads pipeline --arms eager:recv=1,eager:recv=1+copies=1,\
      gograph:_reuse_graph_input_output_buffers=true+chain_buffers=true+shared_samples=true+recv_into_static=1
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

from workloads import WORKLOADS, CallerPool, WithLoss, param_digest, workload

MiB = 2**20
MODES = {"none": True, "zero": False}  # zero_grad(set_to_none=...)


def parse_arm(arm: str) -> tuple[str, dict[str, Any]]:
    """``gograph:chain_buffers=true+x=2`` -> ("gograph", {"chain_buffers": 1, "x": 2})."""
    maker, _, rest = arm.partition(":")
    kwargs: dict[str, Any] = {}
    for kv in filter(None, rest.split("+")):
        k, _, v = kv.partition("=")
        kwargs[k] = _value(v) if v else True
    return maker, kwargs


def _value(v: str) -> Any:
    """An option's value: JSON (true, 2, "x"), else the bare word (shared_samples=all)."""
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def graph(
    maker: str, kwargs: dict[str, Any], wl: Any, layers: list[torch.nn.Module], device: torch.device
) -> tuple[list[Any], Any]:
    """The per-pass callables of a graphed arm (and gograph's result, for its report). The
    pseudo-option ``shared_samples`` (the bench's, not gograph's) shares the chained positions'
    sample tensor (bench/workloads.py)."""
    kwargs = dict(kwargs)
    share = kwargs.pop("shared_samples", False)
    samples = wl.sample_args(device, share_chained=share if share == "all" else bool(share))
    if kwargs.pop("loss_in_graph", False):  # the bench's option: the last callable computes the loss
        layers = [*layers[:-1], WithLoss(layers[-1])]
    if maker == "torch":
        if wl.order is not None:
            raise SystemExit("torch.cuda.make_graphed_callables has no _order: no torch arm for " + wl.name)
        out = torch.cuda.make_graphed_callables(tuple(layers), samples)
        return list(out), None
    out = gograph.make_graphed_callables(tuple(layers), samples, **wl.graph_kwargs(), **kwargs)
    return list(out), out


def pool_split() -> dict[str, int]:
    """Reserved bytes of graph-pool segments vs all other segments (torch's allocator snapshot)."""
    pools = other = 0
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        if pid != (0, 0):
            pools += int(seg["total_size"])
        else:
            other += int(seg["total_size"])
    return {"pool_reserved_bytes": pools, "other_reserved_bytes": other}


class Trace:
    """Where reserved memory sits at each point of the first steps (``--trace``): after each
    pass's forward, when each pass's output grad arrives in backward, after backward and after
    the optimizer. Reads the allocator snapshot, so it is slow; nothing timed runs with it."""

    def __init__(self, steps: int) -> None:
        self.steps, self.step, self.points = steps, 0, []  # type: ignore[var-annotated]

    def mark(self, what: str) -> None:
        if self.step < self.steps:
            split = pool_split()
            self.points.append(
                {
                    "step": self.step,
                    "at": what,
                    "allocated": torch.cuda.memory_allocated(),
                    "max_reserved": torch.cuda.max_memory_reserved(),
                    **split,
                }
            )

    def wrap(self, calls: list[Any]) -> list[Any]:
        def traced(i: int, call: Any) -> Any:
            def run(*args: Any) -> Any:
                out = call(*args)
                self.mark(f"fwd {i}")
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g: self.mark(f"bwd {i} grad-out") or None)
                return out

            return run

        return [traced(i, c) for i, c in enumerate(calls)]


def run_cell(
    name: str, arm: str, mode: str, steps: int, small: bool, detail: bool = False, trace: int = 0
) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    if name == "blocks":  # SDPA's backward is deterministic only in deterministic mode (every arm alike)
        torch.use_deterministic_algorithms(True, warn_only=True)
    wl = workload(name, small)
    maker, kwargs = parse_arm(arm)
    # The bench's pipeline options: chunk inputs received at their forward (recv), into the
    # graphs' static inputs (recv_into_static, gograph arms).
    recv, into_static = bool(kwargs.pop("recv", False)), bool(kwargs.pop("recv_into_static", False))
    layers = wl.build(device)
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=1e-3)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base_res, base_alloc = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    result: dict[str, Any] = {"workload": name, "arm": arm, "mode": mode}
    graphed = None
    caller_pool = CallerPool(device) if maker == "eager" and kwargs.get("pools") else None
    if maker == "eager":
        calls: list[Any] = wl.eager_calls(layers)
        if kwargs.get("copies"):
            calls = wl.static_copies(calls)
        if kwargs.get("loss_in_graph"):
            calls = [*calls[:-1], WithLoss(layers[-1])]
    else:
        calls, graphed = graph(maker, kwargs, wl, layers, device)
        torch.cuda.synchronize()
        result["build_peak_reserved"] = torch.cuda.max_memory_reserved() - base_res
        result["build_peak_allocated"] = torch.cuda.max_memory_allocated() - base_alloc
        if detail:
            result["after_build"] = {**pool_split(), "allocated": torch.cuda.memory_allocated() - base_alloc}
    gen = torch.Generator(device=device).manual_seed(1)
    into = wl.static_inputs(calls) if into_static else {}
    tr = Trace(trace)
    if trace:
        tr.mark("before steps")
        calls = tr.wrap(calls)
    for s in range(steps):
        tr.step = s
        with CallerPool.routing(caller_pool):
            batch = wl.batch(gen, device, recv=recv or into_static)
        batch.into, batch.pool = into, caller_pool
        wl.step(calls, batch)
        del batch
        tr.mark("after backward")
        opt.step()
        tr.mark("after optimizer")
        opt.zero_grad(set_to_none=MODES[mode])
    torch.cuda.synchronize()
    result["peak_reserved"] = torch.cuda.max_memory_reserved() - base_res
    result["peak_allocated"] = torch.cuda.max_memory_allocated() - base_alloc
    result["digest"] = param_digest(layers)
    result.update(pool_split())
    if trace:
        result["trace"] = tr.points
    if graphed is not None:
        totals = gograph.memory_report(graphed).totals
        result["report_static_bytes"] = totals.static_bytes
        result["report_pool_reserved_bytes"] = totals.pool_reserved_bytes
        if detail:
            print(gograph.memory_report(graphed), file=sys.stderr)
    return result


def run_fresh(name: str, arm: str, mode: str, steps: int, small: bool) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", name, arm, mode, "--steps", str(steps)]
    if small:
        cmd.append("--small")
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")  # deterministic cuBLAS (blocks' mode)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"workload": name, "arm": arm, "mode": mode, "error": " | ".join(tail)}
    return dict(json.loads(lines[-1]))


def eager_arm(arm: str) -> str:
    """The eager arm an arm compares with: a ``recv`` arm (chunk inputs received at their forward)
    with ``eager:recv=1``, every other arm with ``eager``."""
    opts = parse_arm(arm)[1]
    return "eager:recv=1" if opts.get("recv") or opts.get("recv_into_static") else "eager"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per cell, MiB and ratios to the eager and torch arms of the same workload/mode."""
    ref = {(r["workload"], r["mode"], r["arm"]): r for r in rows}
    out = [
        "| workload | zero_grad | arm | peak reserved MiB | x eager | x torch | peak allocated MiB | "
        "build peak reserved MiB | bitwise = eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['workload']} | {r['mode']} | {r['arm']} | error: {r['error']} | | | | | |")
            continue
        e = ref.get((r["workload"], r["mode"], eager_arm(r["arm"])))
        t = ref.get((r["workload"], r["mode"], "torch"))
        ratio = lambda o, r=r: f"{r['peak_reserved'] / o['peak_reserved']:.3f}" if o and "peak_reserved" in o else "-"
        build = r.get("build_peak_reserved")
        same = "-" if r["arm"] == eager_arm(r["arm"]) or not e else str(e.get("digest") == r["digest"])
        mode = "set_to_none=True" if r["mode"] == "none" else "set_to_none=False"
        out.append(
            f"| {r['workload']} | {mode} | {r['arm']} | {r['peak_reserved'] / MiB:.0f} | {ratio(e)} | "
            f"{ratio(t)} | {r['peak_allocated'] / MiB:.0f} | "
            f"{'-' if build is None else f'{build / MiB:.0f}'} | {same} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="chain,blocks,pipeline")
    ap.add_argument("--arms", default="eager,torch,gograph")
    ap.add_argument("--modes", default="none,zero", help="none: zero_grad(set_to_none=True); zero: False")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--jobs", type=int, default=1, help="cells run at once (fresh processes each)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--detail", action="store_true", help="with --cell: memory report and pool split")
    ap.add_argument("--trace", type=int, default=0, metavar="N", help="with --cell: memory by pool during N steps")
    ap.add_argument("--cell", nargs=3, metavar=("WORKLOAD", "ARM", "MODE"), help="run one cell here")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and gograph.cuda_available()):
        print(
            f"bench/footprint.py needs a GPU and the CUDA core ({gograph.cuda_unavailable_reason()})", file=sys.stderr
        )
        return 2
    if args.cell:
        print(
            json.dumps(run_cell(*args.cell, steps=args.steps, small=args.small, detail=args.detail, trace=args.trace))
        )
        return 0
    cells = []
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name}")
        for mode in args.modes.split(","):
            for arm in args.arms.split(","):
                if arm == "torch" and workload(name).order is not None:
                    continue
                cells.append((name, arm, mode))
    # Each cell is its own process with its own allocator, so cells may share the GPU (--jobs):
    # memory peaks are per process; only timings would interfere, and none are reported here.
    run_cells(lambda c: run_fresh(*c, args.steps, args.small), cells, args.jobs, table, args.json)
    return 0


def run_cells(run: Any, cells: list[Any], jobs: int, tabulate: Any, json_path: str | None) -> None:
    """Runs ``cells`` (``jobs`` at once), prints each row as JSON and then ``tabulate(rows)``,
    and writes the rows to ``json_path`` when given."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        rows = list(pool.map(run, cells))
    for r in rows:
        print(json.dumps(r), flush=True)
    print(tabulate(rows))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
