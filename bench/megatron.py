"""Megatron-Core's GPT training with each way a Megatron user can graph its layers, side by side.

Arms (bench/megatron_train.py builds and trains them as ``megatron.training`` does):

* ``eager``: ``cuda_graph_impl="none"``;
* ``local``: ``cuda_graph_impl="local"``, Megatron's own ``CudaGraphManager`` (no TransformerEngine);
* ``te``: ``cuda_graph_impl="transformer_engine"`` with TransformerEngine's
  ``make_graphed_callables`` (only where ``transformer_engine`` is importable);
* ``gograph``: the same path after ``gograph.integrations.megatron.use_gograph()``.

For every arm: whether its training is bitwise equal to eager's (every microbatch loss, every
step's main grads, the final parameters), the peak ``torch.cuda.max_memory_reserved()`` over its
training relative to its model (graph pools included: they are reserved memory), each measured
in a fresh process; then the step time of all arms in one process, in alternating rounds of
``--steps`` training steps each (the order rotated every round) as the median ms per step and the
median per-round ratio to eager. Arms that cannot run here are listed with the reason.

  python bench/megatron.py                              # GPU: every arm that can run here
  python bench/megatron.py --arms eager,gograph --json out.json
  python bench/megatron.py --cpu-smoke                  # tiny, on the CPU (eager engine): eager, gograph

On the CPU (``--cpu-smoke``) the same runs on tiny sizes, without memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

# Megatron-Core's ``megatron`` is a namespace package, which any ``megatron.py`` on sys.path
# shadows -- bench/megatron.py included: import it with bench/ off the path, then add bench/.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _BENCH]
sys.path.insert(0, os.path.join(os.path.dirname(_BENCH), "python"))
try:
    import megatron.core  # noqa: F401
except ImportError as e:
    raise SystemExit(
        f"{os.path.basename(__file__)} needs Megatron-Core (pip install megatron-core==0.19.2): {e}"
    ) from e
sys.path.append(_BENCH)
from megatron_train import ARMS, Run, RunConfig, batches, differences, on_device, prepare

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 2**20
GPU_SIZES = {"layers": 8, "hidden": 1024, "heads": 16, "vocab": 32768, "seq": 1024, "micro_batch": 2, "microbatches": 4}
SMOKE_SIZES = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq": 16, "micro_batch": 2, "microbatches": 2}


def unavailable(arm: str, device: str) -> str | None:
    """Why an arm cannot run here, or None."""
    if arm not in ARMS:
        return f"unknown arm (one of {', '.join(ARMS)})"
    if arm == "local" and device != "cuda":
        return "Megatron's CudaGraphManager needs CUDA"
    if arm == "te":
        from megatron_te_surface import real_transformer_engine

        if not real_transformer_engine():
            return "transformer_engine is not importable (pip install transformer-engine[pytorch])"
    return None


def fresh_trace(cfg: RunConfig, arm: str, workdir: str) -> dict[str, Any]:
    """One arm trained in a process of its own (memory from a clean allocator)."""
    out = os.path.join(workdir, f"{arm}.pt")
    cmd = [sys.executable, os.path.join(HERE, "megatron_train.py"), "--arms", arm, "--out", out]
    for f in dataclasses.fields(RunConfig):
        cmd += [f"--{f.name.replace('_', '-')}", str(getattr(cfg, f.name))] if getattr(cfg, f.name) is not None else []
    # this process's rendezvous is listening on its MASTER_PORT: the arm picks a port of its own
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench/megatron.py: the {arm} arm failed:\n{proc.stderr[-4000:]}")
    return torch.load(out)[0]  # type: ignore[no-any-return]


def step_times(cfg: RunConfig, arms: list[str], rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each arm, per round, all arms in this process (graphs made first)."""
    data = batches(cfg)
    runs = {arm: Run(cfg, arm) for arm in arms}
    for run in runs.values():  # past graph creation (iteration cuda_graph_warmup_steps) and a replay
        for step in data[: cfg.warmup_steps + 2]:
            run.step(step)
    timed: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            _sync(cfg)
            t0 = time.perf_counter()
            for step in data:
                runs[arm].step(step)
            _sync(cfg)
            timed[arm].append((time.perf_counter() - t0) / len(data))
    for run in runs.values():
        if run.helper is not None and run.helper.graphs_created():
            run.helper.delete_cuda_graphs()
    return timed


def _sync(cfg: RunConfig) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def measure(cfg: RunConfig, arms: list[str], rounds: int) -> dict[str, Any]:
    # each arm in a process of its own, the smoke run too: it runs what the GPU run runs
    with tempfile.TemporaryDirectory() as workdir:
        traces = {arm: fresh_trace(cfg, arm, workdir) for arm in arms}
    timed = step_times(dataclasses.replace(cfg, steps=max(cfg.steps, cfg.warmup_steps + 2)), arms, rounds)
    result: dict[str, Any] = {}
    for arm in arms:
        diffs = differences(traces["eager"], traces[arm]) if "eager" in traces else ["no eager arm"]
        ratios = [a / b for a, b in zip(timed[arm], timed.get("eager", timed[arm]))]
        peak = traces[arm]["peak_reserved"]
        result[arm] = {
            "bitwise_equal_to_eager": not diffs,
            "differences": diffs[:6],
            "median_ms": statistics.median(timed[arm]) * 1e3,
            "best_ms": min(timed[arm]) * 1e3,
            "median_ratio_to_eager": statistics.median(ratios),
            "peak_reserved_mib": None if peak is None else peak / MiB,
            "graphs": traces[arm]["graphs"],
        }
    return result


def table(result: dict[str, Any], skipped: dict[str, str]) -> str:
    lines = [
        "| arm | bitwise = eager | median ms/step | x eager (median per round) | peak reserved MiB |",
        "|---|---|---|---|---|",
    ]
    for arm, row in result.items():
        peak = "-" if row["peak_reserved_mib"] is None else f"{row['peak_reserved_mib']:.1f}"
        same = "yes" if row["bitwise_equal_to_eager"] else "NO: " + "; ".join(row["differences"][:2])
        lines.append(f"| {arm} | {same} | {row['median_ms']:.2f} | {row['median_ratio_to_eager']:.3f} | {peak} |")
    lines += [f"| {arm} | not run: {why} | | | |" for arm, why in skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds (default 9; --cpu-smoke 2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per round and traced run (10; smoke 3)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, gograph's eager engine")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/megatron.py: torch sees no GPU; use --cpu-smoke for the CPU run")
    sizes = SMOKE_SIZES if args.cpu_smoke else GPU_SIZES
    rounds = args.rounds or (2 if args.cpu_smoke else 9)
    cfg = RunConfig(device=device, steps=args.steps or (3 if args.cpu_smoke else 10), **sizes)
    wanted = args.arms.split(",")
    skipped = {arm: why for arm in wanted if (why := unavailable(arm, device)) is not None}
    arms = [arm for arm in wanted if arm not in skipped]
    if "eager" not in arms:
        arms.insert(0, "eager")  # the reference of every check and ratio
    with on_device(cfg):
        prepare(cfg, arms)
        result = measure(cfg, arms, rounds)
    torch.distributed.destroy_process_group()
    print(f"Megatron-Core GPT {sizes}, {rounds} rounds x {cfg.steps} steps, {device}")
    print(table(result, skipped))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "sizes": sizes, "arms": result, "skipped": skipped}, f, indent=2)
    return 0 if all(row["bitwise_equal_to_eager"] for row in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
