"""Benchmark: where the time of one ``make_graphed_callables`` call goes, on bench/pipeline.py's
pipeline rank (Megatron-LM's interleaved 1F1B order, rank 0 of 4 stages, 4 chunks x 2 layers).

For each mode and microbatch count, in one process: a primer graphing (the first in a process
pays for cuBLAS handles and workspaces), one timed call without a profiler, then the same call
under ``cProfile``. It reports the call's wall time split into warmup, captures and the rest (the
build's own ``build_stats``), the functions with the most time of their own, and how often the
calls that wait for the device or walk the heap ran (``synchronize``, ``gc.collect``,
``empty_cache``, ``memory_stats``, ``memory_snapshot``).

  python bench/capture_profile.py [--modes reuse,reuse+chain] [--microbatches 8,16] [--json out.json]
  python bench/capture_profile.py --cpu-smoke      # tiny sizes, eager engine
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import re
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline

import gograph

#: Calls whose count tells where a host-side build waits or walks memory.
WATCHED = ("synchronize", "collect", "empty_cache", "memory_stats", "memory_snapshot", "_record_memory_history")


def _build(cfg: pipeline.Config, mode: str) -> tuple[list[Any], float]:
    torch.manual_seed(0)
    layers = [pipeline.Layer(cfg.hidden, cfg.ffn).to(cfg.device, cfg.dtype) for _ in range(cfg.chunks * cfg.layers)]
    samples = [
        (torch.randn(cfg.rows, cfg.hidden, device=cfg.device, dtype=cfg.dtype, requires_grad=True),)
        for _ in range(cfg.passes)
    ]
    pipeline._sync(cfg)
    t0 = time.perf_counter()
    graphed = pipeline.graph_rank(cfg, layers, samples, mode)
    pipeline._sync(cfg)
    return list(graphed), time.perf_counter() - t0


def _release(graphed: list[Any], cfg: pipeline.Config) -> None:
    for g in graphed:
        g.reset()
    graphed.clear()
    pipeline._collect(cfg)


def _split(graphed: list[Any], call_s: float) -> dict[str, float]:
    build = graphed[0].build_stats
    capture = sum(r.seconds for r in build.captures)
    return {
        "call_seconds": call_s,
        "warmup_seconds": build.warmup_seconds,
        "capture_seconds": capture,
        "rest_seconds": call_s - build.warmup_seconds - capture,
    }


def _top(stats: pstats.Stats, key: str, n: int) -> list[dict[str, Any]]:
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {"function": f"{os.path.basename(file)}:{line}({name})", "calls": ncalls, "own": tottime, "cum": cumtime}
        )
    rows.sort(key=lambda r: -r[key])
    return rows[:n]


def _watched(stats: pstats.Stats) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (_, _, name), (_, ncalls, _, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        for w in WATCHED:
            if re.search(rf"\b{w}\b", name):
                e = out.setdefault(name, {"calls": 0, "seconds": 0.0})
                e["calls"] += ncalls
                e["seconds"] += cumtime
    return out


def profile_mode(cfg: pipeline.Config, mode: str, top: int) -> dict[str, Any]:
    """One timed call, then one profiled call, of ``mode`` at ``cfg``'s microbatch count."""
    graphed, call_s = _build(cfg, mode)
    plain = _split(graphed, call_s)
    _release(graphed, cfg)
    prof = cProfile.Profile()
    prof.enable()
    graphed, call_s = _build(cfg, mode)
    prof.disable()
    profiled = _split(graphed, call_s)
    _release(graphed, cfg)
    stats = pstats.Stats(prof)
    return {
        "mode": mode,
        "microbatches": cfg.micro,
        "plain": plain,
        "profiled": profiled,
        "top_own": _top(stats, "own", top),
        "top_cum": _top(stats, "cum", top),
        "watched": _watched(stats),
    }


def _print(r: dict[str, Any]) -> None:
    p, q = r["plain"], r["profiled"]
    print(
        f"[{r['mode']} x{r['microbatches']}] call {p['call_seconds']:.3f} s: warmup {p['warmup_seconds']:.3f}, "
        f"captures {p['capture_seconds']:.3f}, rest {p['rest_seconds']:.3f} (profiled: {q['call_seconds']:.3f} s)"
    )
    for name, w in sorted(r["watched"].items()):
        print(f"    {name}: {w['calls']} calls, {w['seconds']:.3f} s")
    s = io.StringIO()
    for row in r["top_own"]:
        s.write(f"    own {row['own']:.3f} cum {row['cum']:.3f} x{row['calls']} {row['function']}\n")
    print(s.getvalue(), end="")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the eager engine (CPU)")
    ap.add_argument("--modes", default="reuse,reuse+chain")
    ap.add_argument("--microbatches", default="8,16")
    ap.add_argument("--warmup-iters", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not (torch.cuda.is_available() and gograph.cuda_available()):
        print(
            f"needs a GPU and the CUDA flavor ({gograph.cuda_unavailable_reason()}); use --cpu-smoke", file=sys.stderr
        )
        return 2
    results = []
    for micro in (int(m) for m in args.microbatches.split(",")):
        ns = argparse.Namespace(
            cpu_smoke=args.cpu_smoke,
            microbatches=micro,
            hidden=1024,
            rows=4096,
            iters=1,
            warmup_iters=args.warmup_iters,
        )
        cfg = pipeline.Config(ns)
        if not cfg.smoke:
            primer = torch.nn.Linear(cfg.hidden, cfg.hidden).to(cfg.device, cfg.dtype)
            gograph.make_graphed_callables(
                primer, (torch.randn(8, cfg.hidden, device=cfg.device, dtype=cfg.dtype),)
            ).reset()
            del primer
        for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
            r = profile_mode(cfg, mode, args.top)
            _print(r)
            results.append(r)
            gc.collect()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
