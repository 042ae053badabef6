"""Benchmarks: gograph vs torch.cuda.make_graphed_callables on the same work, one process.

Workloads (the torch-parity pair of docs/benchmarks-history.md, "Torch parity: W1 and W2"):
  W1  8 per-layer callables of Linear(4096,4096) -> GELU -> Linear(4096,4096), bf16, input 8192x4096
  W2  32 per-layer callables of Linear(256,256) + ReLU, fp32, input 64x256

For each maker it reports capture time, peak memory during the call and memory retained after it
(both counted from just before the call, samples already allocated), memory left after
reset + delete + empty_cache, and graphed step time (forward through all layers + backward), with
eager step time for reference. Ratios are gograph / torch. Needs a GPU and the CUDA flavor.

  python bench/run.py [--only W1,W2] [--steps 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass

import torch

import gograph

MiB = 2**20


@dataclass
class Workload:
    name: str
    layers: int
    width: int
    rows: int
    dtype: torch.dtype
    block: str  # "mlp" (Linear-GELU-Linear) or "linear_relu"


WORKLOADS = {
    "W1": Workload("W1", 8, 4096, 8192, torch.bfloat16, "mlp"),
    "W2": Workload("W2", 32, 256, 64, torch.float32, "linear_relu"),
}


def make_layers(w: Workload) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    if w.block == "mlp":
        mk = lambda: torch.nn.Sequential(
            torch.nn.Linear(w.width, w.width), torch.nn.GELU(), torch.nn.Linear(w.width, w.width)
        )
    else:
        mk = lambda: torch.nn.Sequential(torch.nn.Linear(w.width, w.width), torch.nn.ReLU())
    return [mk().to(device="cuda", dtype=w.dtype) for _ in range(w.layers)]


def make_samples(w: Workload) -> tuple[tuple[torch.Tensor], ...]:
    # Layer 0 sees data (no grad); every later layer sees an activation that requires grad.
    return tuple(
        (torch.randn(w.rows, w.width, device="cuda", dtype=w.dtype).requires_grad_(i > 0),) for i in range(w.layers)
    )


def step(layers, x) -> None:
    for layer in layers:
        x = layer(x)
    x.float().square().mean().backward()


def time_steps(layers, x, steps: int, rounds: int = 5) -> float:
    """Best of `rounds` timings of `steps` steps: launch-bound steps are CPU-bound, and the
    minimum is the least disturbed by the host."""
    for _ in range(3):
        step(layers, x)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step(layers, x)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def ungraph(maker: str, layers, graphed) -> None:
    """Back to the ungraphed modules: torch keeps its graphs in closures on each layer's forward
    attribute, gograph in the GraphedCallable there (reset first: its memory goes back at once);
    deleting the attributes drops them."""
    if maker == "gograph":
        for g in graphed:
            g.reset()
    for layer in layers:
        del layer.forward
        layer.__dict__.pop("reset", None)
        layer.__dict__.pop("backward_dw", None)


def measure(w: Workload, maker: str, steps: int) -> dict:
    layers = make_layers(w)
    x = torch.randn(w.rows, w.width, device="cuda", dtype=w.dtype)
    step(layers, x)  # cuBLAS handles/workspaces exist before anything is measured
    for p in (q for l in layers for q in l.parameters()):
        p.grad = None
    samples = make_samples(w)
    sample_bytes = sum(t.numel() * t.element_size() for (t,) in samples)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    make = gograph.make_graphed_callables if maker == "gograph" else torch.cuda.make_graphed_callables
    t0 = time.perf_counter()
    graphed = make(tuple(layers), samples)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    retained = torch.cuda.memory_allocated() - base
    graphed_step = time_steps(graphed, x, steps)
    for p in (q for l in layers for q in l.parameters()):
        p.grad = None
    ungraph(maker, layers, graphed)
    del graphed, samples
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated() - (base - sample_bytes)  # the samples are gone too
    # Eager reference on fresh layers (the graphed ones had forward replaced).
    eager_layers = make_layers(w)
    eager_step = time_steps(eager_layers, x, steps)
    del eager_layers, layers, x
    gc.collect()
    torch.cuda.empty_cache()
    return dict(
        workload=w.name,
        maker=maker,
        capture_s=capture_s,
        peak_mib=peak / MiB,
        retained_mib=retained / MiB,
        after_reset_mib=after / MiB,
        graphed_step_ms=graphed_step * 1e3,
        eager_step_ms=eager_step * 1e3,
    )


def compare_steps(w: Workload, steps: int, rounds: int) -> dict:
    """Graphed step time of torch and gograph (and eager) on the same workload, all three alive
    in one process and timed in alternating rounds, so that host noise (these steps are
    CPU-bound) hits each maker alike. Returns the best round of each and the median of the
    per-round gograph/torch ratios."""
    x = torch.randn(w.rows, w.width, device="cuda", dtype=w.dtype)
    models = {}
    for maker in ("torch", "gograph", "eager"):
        layers = make_layers(w)
        step(layers, x)  # cuBLAS workspaces before graphing
        for p in (q for l in layers for q in l.parameters()):
            p.grad = None
        if maker == "eager":
            models[maker] = (layers, layers)
            continue
        make = gograph.make_graphed_callables if maker == "gograph" else torch.cuda.make_graphed_callables
        models[maker] = (make(tuple(layers), make_samples(w)), layers)
    for mods, _ in models.values():
        for _ in range(3):
            step(mods, x)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {m: [] for m in models}
    names = list(models)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            mods = models[name][0]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(mods, x)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    ratios = sorted(g / t for g, t in zip(times["gograph"], times["torch"]))
    for name in ("torch", "gograph"):
        ungraph(name, models[name][1], models[name][0])
    del models
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "workload": w.name,
        "rounds": rounds,
        "steps_per_round": steps,
        "best_ms": {m: min(v) for m, v in times.items()},
        "median_ms": {m: sorted(v)[len(v) // 2] for m, v in times.items()},
        "median_round_ratio": ratios[len(ratios) // 2],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="W1,W2")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", default="")
    p.add_argument("--rounds", type=int, default=15, help="alternating rounds of the step comparison")
    args = p.parse_args()
    if not (torch.cuda.is_available() and gograph.cuda_available()):
        raise SystemExit(f"bench needs a GPU and gograph's CUDA flavor: {gograph.cuda_unavailable_reason()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for name in args.only.split(","):
        w = WORKLOADS[name]
        for maker in ("torch", "gograph", "torch", "gograph"):  # twice each: the first pair warms up
            r = measure(w, maker, args.steps)
            rows.append(r)
    final = {}
    for r in rows:  # keep the second measurement of each (workload, maker)
        final[(r["workload"], r["maker"])] = r
    print(
        f"{'load':4} {'maker':8} {'capture s':>9} {'peak MiB':>9} {'kept MiB':>9} {'after MiB':>9} "
        f"{'step ms':>8} {'eager ms':>8}"
    )
    for (wl, mk), r in sorted(final.items()):
        print(
            f"{wl:4} {mk:8} {r['capture_s']:9.3f} {r['peak_mib']:9.1f} {r['retained_mib']:9.1f} "
            f"{r['after_reset_mib']:9.2f} {r['graphed_step_ms']:8.3f} {r['eager_step_ms']:8.3f}"
        )
    # What "after" holds: torch keeps a cuBLAS workspace for every stream that ran a matmul until
    # the process ends. torch's maker warms up on a new side stream per call; gograph's engine
    # keeps one side stream per device. Clearing them all shows how much that is by now.
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    cublas_mib = (held - torch.cuda.memory_allocated()) / MiB
    print(f"cuBLAS workspaces held after {len(rows)} graphings ({len(rows) // 2} per maker): {cublas_mib:.1f} MiB")
    ratios = {}
    for wl in sorted({k[0] for k in final}):
        t, g = final[(wl, "torch")], final[(wl, "gograph")]
        ratios[wl] = {
            k: (g[k] / t[k] if t[k] else float("nan"))
            for k in ("capture_s", "peak_mib", "retained_mib", "graphed_step_ms")
        }
        print(f"{wl} gograph/torch: " + ", ".join(f"{k} x{v:.3f}" for k, v in ratios[wl].items()))
    steps_cmp = {}
    for name in args.only.split(","):
        w = WORKLOADS[name]
        c = compare_steps(w, max(5, args.steps // (5 if w.name == "W1" else 1)), args.rounds)
        steps_cmp[name] = c
        b, m = c["best_ms"], c["median_ms"]
        print(
            f"{name} interleaved steps ({c['rounds']} rounds x {c['steps_per_round']}): best ms torch {b['torch']:.3f} "
            f"gograph {b['gograph']:.3f} eager {b['eager']:.3f}; median ms torch {m['torch']:.3f} gograph "
            f"{m['gograph']:.3f}; gograph/torch best x{b['gograph'] / b['torch']:.3f}, median per-round "
            f"x{c['median_round_ratio']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "ratios": ratios,
                    "interleaved_steps": steps_cmp,
                    "cublas_workspaces_mib": cublas_mib,
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
