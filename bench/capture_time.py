"""How long make_graphed_callables takes, gograph vs torch, and where the time goes.

bench/run.py times one graphing per maker; a W2 graphing takes ~0.05-0.1 s, and one timing is at
the mercy of the host. Here the makers graph the same workload (fresh layers and samples each
time) in rotated rounds (torch, gograph; gograph, torch; ...), and the best and median of each
and the median per-round ratio to torch are reported. ``--makers torch,gograph,gograph-unseeded``
adds gograph with its pool seed switched off (no warmup trace, no memory plan): the seed's cost.
With ``--profile`` one graphing of each is profiled with cProfile (top functions by own time);
with ``--phases`` the time inside gograph's phases (warmup, trace, plan, captures) is split out.

  python bench/capture_time.py [--only W2,W1] [--rounds 9] [--warmup-iters 3] [--phases | --timeline]
                               [--cpu N] [--profile [--dump-dir D]] [--makers torch,gograph[,gograph-unseeded]]
                               [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import time

import torch
from run import WORKLOADS, Workload, make_layers, make_samples, step, ungraph

import gograph


@contextlib.contextmanager
def _no_allocation_trace(self, wanted, ops):
    yield None


def _unseeded(*args, **kwargs):
    """gograph without the pool seed (its warmup unrecorded, no plan_memory): the seed's cost
    measured against the same build in the same process."""
    from gograph.build import _build

    traced = _build.Build._allocation_trace
    _build.Build._allocation_trace = _no_allocation_trace  # type: ignore[method-assign]
    try:
        return gograph.make_graphed_callables(*args, **kwargs)
    finally:
        _build.Build._allocation_trace = traced  # type: ignore[method-assign]


MAKERS = {
    "torch": torch.cuda.make_graphed_callables,
    "gograph": gograph.make_graphed_callables,
    "gograph-unseeded": _unseeded,
}


def prepared(w: Workload):
    """Fresh layers (cuBLAS already initialised by a step) and fresh samples."""
    layers = make_layers(w)
    x = torch.randn(w.rows, w.width, device="cuda", dtype=w.dtype)
    step(layers, x)
    for p in (q for l in layers for q in l.parameters()):
        p.grad = None
    samples = make_samples(w)
    gc.collect()
    torch.cuda.synchronize()
    return layers, samples


def teardown(maker: str, layers, graphed) -> None:
    ungraph(maker, layers, graphed)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def one_graphing(
    w: Workload,
    maker: str,
    warmup_iters: int,
    profiler: cProfile.Profile | None = None,
    clock: PhaseClock | None = None,
):
    layers, samples = prepared(w)
    make = MAKERS[maker]
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    if clock is not None:
        clock.start(t0)
    graphed = make(tuple(layers), samples, num_warmup_iters=warmup_iters)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if clock is not None:
        clock.stop()
    if profiler is not None:
        profiler.disable()
    split = None
    if maker.startswith("gograph"):
        stats = graphed[0].forward.build_stats
        caps = sum(c.seconds for c in stats.captures)
        split = {
            "build_s": stats.seconds,
            "warmup_s": stats.warmup_seconds,
            "captures_s": caps,
            "captures": len(stats.captures),
        }
    teardown(maker, layers, graphed)
    return seconds, split


class PhaseClock:
    """Wall time spent inside chosen functions during graphings (no profiler overhead): each is
    replaced by a wrapper that adds its duration to a total (outermost call only). Nested
    entries count in both their own and their caller's total."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.marks: dict[str, float] = {}
        self._t_start = 0.0
        self._undo: list[tuple[object, str, object]] = []
        self._depth: dict[str, int] = {}
        self._gc_t0 = 0.0
        self.active = False
        gc.callbacks.append(self._gc_event)
        self._undo.append((gc.callbacks, "", self._gc_event))

    def start(self, t0: float) -> None:
        """A graphing starts: totals and marks are counted from here until :meth:`stop`."""
        self.totals.clear()
        self.marks.clear()
        self._t_start = t0
        self.active = True

    def stop(self) -> None:
        self.active = False

    def _gc_event(self, phase: str, info: dict) -> None:
        # Python's cyclic collector runs wherever allocations trigger it: its pauses count here.
        if not self.active:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            name = f"gc collections (generation {info.get('generation')})"
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - self._gc_t0

    def mark(self, owner: object, attr: str, name: str, last_return: bool = False) -> None:
        """Records when ``owner.attr`` is first entered in a graphing (ms from its start), or
        with ``last_return`` when it last returned."""
        orig = getattr(owner, attr)
        clock = self

        def marked(*args, **kwargs):
            if clock.active and not last_return:
                clock.marks.setdefault(name, time.perf_counter() - clock._t_start)
            try:
                return orig(*args, **kwargs)
            finally:
                if clock.active and last_return:
                    clock.marks[name] = time.perf_counter() - clock._t_start

        self._undo.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else orig))
        setattr(owner, attr, marked)

    def wrap(self, owner: object, attr: str, name: str | None = None) -> None:
        name = name or f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"
        orig = getattr(owner, attr)
        is_static = isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod)
        clock = self

        def timed(*args, **kwargs):
            depth = clock._depth.get(name, 0)
            clock._depth[name] = depth + 1
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                clock._depth[name] = depth
                if depth == 0 and clock.active:
                    clock.totals[name] = clock.totals.get(name, 0.0) + time.perf_counter() - t0

        self._undo.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else orig))
        setattr(owner, attr, staticmethod(timed) if is_static else timed)

    def restore(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            if owner is gc.callbacks:
                gc.callbacks.remove(orig)
            else:
                setattr(owner, attr, orig)
        self._undo.clear()


def phases(w: Workload, rounds: int, warmup_iters: int, makers: list[str], detail: bool = True) -> str:
    """Median seconds per graphing spent in the main phases of each maker: with ``detail``,
    inside many functions (which slows the graphings down a little); without, only a timeline
    of phase boundaries and the garbage collector's pauses."""
    from gograph import engines
    from gograph.build import _build, _captures, _warmup
    from gograph.core import _core, _plan
    from gograph.probes import _probe
    from gograph.replay import graphed
    from gograph.request import _args
    from gograph.runtime import _observe
    from gograph.support import _torch

    out = []
    for maker in makers:
        one_graphing(w, maker, warmup_iters)
        clock = PhaseClock()
        if not detail:
            clock.wrap = lambda *a, **k: None  # type: ignore[method-assign]
        clock.wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
        clock.wrap(torch.autograd, "grad", "torch.autograd.grad")
        clock.wrap(torch.cuda, "empty_cache", "torch.cuda.empty_cache")
        if maker == "torch":
            clock.wrap(torch.cuda.graph, "__enter__", "torch.cuda.graph.__enter__")
            clock.wrap(torch.cuda.graph, "__exit__", "torch.cuda.graph.__exit__")
            clock.mark(torch.cuda.graph, "__enter__", "first capture")
            clock.mark(torch.cuda.graph, "__exit__", "last capture ends", last_return=True)
        else:
            for owner, attr in (
                (_build.Build, "_warmup"),
                (_args, "normalize"),
                (_args, "check_for_engine"),
                (_build.Build, "_plan_captures"),
                (_build.Build, "_carve_seed"),
                (_probe.CountedTrace, "__enter__"),
                (_probe.CountedTrace, "__exit__"),
                (_probe.CountedTrace, "op"),
                (_probe.CountedTrace, "_stop"),
                (_probe.AllocationTrace, "text"),
                (_probe.AllocationTrace, "_device_entries"),
                (_torch, "memory_stats"),
                (_captures, "capture_forward"),
                (_captures, "capture_backward"),
                (_warmup, "warm_forward"),
                (_warmup, "warm_backward"),
                (graphed.GraphedCallable, "__init__"),
                (_plan, "plan_schedule"),
                (engines.Engine, "capture"),
                (engines.Engine, "new_pass"),
                (engines.Engine, "seal"),
                (engines.CudaEngine, "_transaction"),
                (engines.CudaEngine, "get_rng_state"),
                (engines.CudaEngine, "set_rng_state"),
                (engines.CudaEngine, "memory_allocated"),
                (_observe.BuildStats, "begin"),
                (_observe.BuildStats, "close"),
                (_observe.CaptureProbe, "finished"),
            ):
                clock.wrap(owner, attr)
            for attr in (
                "begin_pass_capture",
                "end_pass_capture",
                "plan_warmup",
                "plan_capture",
                "plan_memory",
                "new_pass",
            ):
                clock.wrap(_core, attr, f"core.{attr}")
            for attr, name in (
                ("warmup_started", "warmup starts"),
                ("warmup_finished", "warmup ends"),
                ("close", "build closes"),
            ):
                clock.mark(_observe.BuildStats, attr, name)
            clock.mark(engines.Engine, "seal", "first seal")
            clock.mark(engines.Engine, "capture", "first capture")
            clock.mark(engines.Engine, "capture", "last capture ends", last_return=True)
        per: dict[str, list[float]] = {}
        marks: dict[str, list[float]] = {}
        totals = []
        try:
            for _ in range(rounds):
                s, _ = one_graphing(w, maker, warmup_iters, clock=clock)
                totals.append(s)
                for k, v in clock.totals.items():
                    per.setdefault(k, []).append(v)
                for k, v in clock.marks.items():
                    marks.setdefault(k, []).append(v)
        finally:
            clock.restore()
        out.append(
            f"--- {w.name} {maker}: median {statistics.median(totals) * 1e3:.1f} ms per graphing; median ms inside:"
        )
        for k, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
            out.append(f"    {k:42} {statistics.median(v) * 1e3:8.2f}  (x{len(v)}/{rounds} graphings)")
        if marks:
            out.append(
                "    timeline (median ms from the call): "
                + ", ".join(
                    f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in sorted(marks.items(), key=lambda kv: kv[1][0])
                )
            )
    return "\n".join(out)


def compare(w: Workload, rounds: int, warmup_iters: int, makers: list[str]) -> dict:
    """Each maker graphs once untimed, then ``rounds`` rounds in which every maker graphs once,
    the order rotated each round; per-round ratios are to torch's graphing in the same round."""
    for maker in makers:  # first graphing of each in this process is not timed
        one_graphing(w, maker, warmup_iters)
    times: dict[str, list[float]] = {m: [] for m in makers}
    splits: dict[str, list[dict]] = {m: [] for m in makers}
    for r in range(rounds):
        k = r % len(makers)
        for maker in makers[k:] + makers[:k]:
            s, split = one_graphing(w, maker, warmup_iters)
            times[maker].append(s)
            if split is not None:
                splits[maker].append(split)
    ratios = {m: statistics.median(g / t for g, t in zip(times[m], times["torch"])) for m in makers if m != "torch"}
    gog = splits.get("gograph") or next((v for v in splits.values() if v), [])
    return {
        "workload": w.name,
        "rounds": rounds,
        "warmup_iters": warmup_iters,
        "best_s": {m: min(v) for m, v in times.items()},
        "median_s": {m: statistics.median(v) for m, v in times.items()},
        "median_round_ratio": ratios.get("gograph", next(iter(ratios.values()), 1.0)),
        "median_round_ratios": ratios,
        "gograph_captures_s_median": statistics.median(s["captures_s"] for s in gog) if gog else 0.0,
        "gograph_warmup_s_median": statistics.median(s["warmup_s"] for s in gog) if gog else 0.0,
        "captures": gog[0]["captures"] if gog else 0,
    }


def profile(w: Workload, warmup_iters: int, top: int, makers: list[str], dump_dir: str = "") -> str:
    out = io.StringIO()
    for maker in makers:
        pr = cProfile.Profile()
        s, _ = one_graphing(w, maker, warmup_iters, pr)
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            pr.dump_stats(os.path.join(dump_dir, f"capture-{w.name}-{maker}.prof"))
        print(f"--- {w.name} {maker}: {s:.3f} s under cProfile; top {top} by own time", file=out)
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="W2,W1")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup-iters", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--phases", action="store_true", help="time the main phases of each maker")
    p.add_argument("--timeline", action="store_true", help="only the phase boundaries (less perturbation)")
    p.add_argument(
        "--cpu",
        type=int,
        default=-1,
        help="pin the process to this CPU core (less host noise; autograd's device thread shares it)",
    )
    p.add_argument(
        "--makers",
        default="torch,gograph",
        help=f"comma-separated, torch first (the ratios' reference): {', '.join(MAKERS)}",
    )
    p.add_argument("--json", default="")
    p.add_argument("--dump-dir", default="", help="write each cProfile as capture-<load>-<maker>.prof here")
    a = p.parse_args()
    if not (torch.cuda.is_available() and gograph.cuda_available()):
        raise SystemExit(f"bench needs a GPU and gograph's CUDA flavor: {gograph.cuda_unavailable_reason()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    if a.cpu >= 0:
        os.sched_setaffinity(0, {a.cpu})
    makers = a.makers.split(",")
    if makers[0] != "torch" or not set(makers) <= set(MAKERS):
        raise SystemExit(f"--makers: torch first, then any of {', '.join(MAKERS)}; got {a.makers!r}")
    results = []
    for name in a.only.split(","):
        w = WORKLOADS[name]
        rounds = a.rounds if name != "W1" else max(3, a.rounds // 3)
        c = compare(w, rounds, a.warmup_iters, makers)
        results.append(c)
        b, m = c["best_s"], c["median_s"]
        print(
            f"{name} capture time ({c['rounds']} rotated rounds, {a.warmup_iters} warmup iters): "
            + "; ".join(f"{k} best {b[k]:.4f} s median {m[k]:.4f} s" for k in makers)
            + "; median per-round ratio to torch: "
            + ", ".join(f"{k} x{v:.3f}" for k, v in c["median_round_ratios"].items())
            + f"; gograph's warmup takes {c['gograph_warmup_s_median']:.4f} s and its {c['captures']} captures "
            f"{c['gograph_captures_s_median']:.4f} s (medians)"
        )
        if a.phases or a.timeline:
            print(phases(w, rounds, a.warmup_iters, makers, detail=a.phases))
        if a.profile:
            print(profile(w, a.warmup_iters, a.top, makers, a.dump_dir))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"results": results, "device": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=1
            )


if __name__ == "__main__":
    main()
