"""Benchmark: one pipeline rank of Megatron-LM's interleaved 1F1B schedule, graphed by gograph.

Rank 0 of 4 pipeline stages, 4 virtual chunks x 2 layers, 8 microbatches: Megatron's interleaved
order for that rank (``gograph.gograph.megatron_order``: 18 warmup forwards, 1F1B, 18 cooldown
backwards), 64 forward passes, each a graphed callable (TransformerEngine's ``_order``
indexing). Each layer is ``x + fc2(gelu(fc1(layernorm(x))))``, hidden 1024 (fc1 to 4x), 4096
rows, bf16; every sample input requires grad. A chunk's two layers are chained; each chunk's
input is a fresh tensor (what the rank receives) and its backward takes a fresh output grad.

For ``_reuse_graph_input_output_buffers`` False and True, and ``share_microbatch_graphs`` (mode
``share``: a layer's microbatches never in flight together replay one set of graphs), at each
microbatch count of ``--microbatches``, it reports

* peak memory during ``make_graphed_callables`` and memory retained after it, both counted from
  before the sample args were allocated (the samples are dropped after the call, as Megatron
  does), and memory left after ``reset()`` of every callable + delete;
* slots the static input / grad-output buffers needed vs TransformerEngine's FIFO count;
* the call's time and its capture time (sum over captures);
* the time of one schedule iteration (64 forwards, 64 backwards in ``_order``) graphed vs eager.

  python bench/pipeline.py [--json out.json] [--iters 10]      # GPU, CUDA flavor
  python bench/pipeline.py --cpu-smoke                         # tiny sizes, eager engine (checks)
  python bench/pipeline.py --modes no-reuse,share --microbatches 8,16,32,64   # captures per microbatch count
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph

MiB = 2**20


class Layer(torch.nn.Module):
    """x + fc2(gelu(fc1(layernorm(x))))."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Config:
    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke = args.cpu_smoke
        self.stages, self.rank, self.chunks, self.layers, self.micro = 4, 0, 4, 2, args.microbatches
        if self.smoke:
            self.hidden, self.ffn, self.rows = 32, 128, 16
            self.dtype, self.device = torch.float32, torch.device("cpu")
            self.iters, self.warmup_iters = 2, 1
        else:
            self.hidden, self.ffn, self.rows = args.hidden, 4 * args.hidden, args.rows
            self.dtype, self.device = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
            self.iters, self.warmup_iters = args.iters, args.warmup_iters
        self.order = gograph.megatron_order(self.stages, self.rank, self.chunks, self.micro)
        self.passes = self.chunks * self.layers * self.micro

    def as_dict(self) -> dict[str, Any]:
        return {
            "pipeline_stages": self.stages,
            "rank": self.rank,
            "virtual_chunks": self.chunks,
            "layers_per_chunk": self.layers,
            "microbatches": self.micro,
            "forward_passes": self.passes,
            "hidden": self.hidden,
            "ffn": self.ffn,
            "rows": self.rows,
            "dtype": str(self.dtype),
            "device": str(self.device),
            "order": self.order,
            "num_warmup_iters": self.warmup_iters,
        }


def _sync(cfg: Config) -> None:
    if cfg.device.type == "cuda":
        torch.cuda.synchronize(cfg.device)


def _allocated(cfg: Config) -> int | None:
    return torch.cuda.memory_allocated(cfg.device) if cfg.device.type == "cuda" else None


def _collect(cfg: Config) -> None:
    gc.collect()
    _sync(cfg)


def run_schedule(
    cfg: Config, call: Callable[[int, torch.Tensor], torch.Tensor], inputs: list[torch.Tensor], dys: list[torch.Tensor]
) -> torch.Tensor:
    """One iteration of the order: chunk c's forward of microbatch m runs its layers (passes
    prefix*M + m*L + l), its backward calls backward on the chunk output."""
    fwd = [0] * cfg.chunks
    bwd = [0] * cfg.chunks
    outs: dict[tuple[int, int], torch.Tensor] = {}
    last = None
    last_forward = max(i for i, e in enumerate(cfg.order) if e > 0)
    for i, e in enumerate(cfg.order):
        c = abs(e) - 1
        if e > 0:
            m = fwd[c]
            fwd[c] += 1
            x = inputs[c * cfg.micro + m]
            for li in range(cfg.layers):
                x = call(c * cfg.layers * cfg.micro + m * cfg.layers + li, x)
            outs[(c, m)] = x
            if i == last_forward:
                # copied now: a graphed output is a static buffer that later replays (and, with
                # buffer reuse, later passes once its backward ran) overwrite
                last = x.detach().float().clone()
        else:
            m = bwd[c]
            bwd[c] += 1
            outs.pop((c, m)).backward(dys[c * cfg.micro + m])
    assert last is not None
    return last


def _timed_schedule(
    cfg: Config, call: Callable[[int, torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter]
) -> tuple[float, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(7)
    shape = (cfg.rows, cfg.hidden)
    inputs = [
        torch.randn(shape, generator=g).to(cfg.device, cfg.dtype).requires_grad_()
        for _ in range(cfg.chunks * cfg.micro)
    ]
    dys = [torch.randn(shape, generator=g).to(cfg.device, cfg.dtype) for _ in range(cfg.chunks * cfg.micro)]
    times = []
    out = None
    for i in range(cfg.iters + 1):
        for p in params:
            p.grad = None
        for x in inputs:
            x.grad = None
        _sync(cfg)
        t0 = time.perf_counter()
        out = run_schedule(cfg, call, inputs, dys)
        _sync(cfg)
        if i > 0:  # the first iteration warms allocators and caches
            times.append(time.perf_counter() - t0)
    assert out is not None
    return statistics.median(times), out


def eager_floor(cfg: Config) -> dict[str, int | None]:
    """What the schedule itself needs, eagerly: one run of the order with each chunk's input a
    fresh tensor that requires grad (what the rank receives) and each backward a fresh output
    grad, peak memory counted from before the inputs were allocated: ``peak_bytes`` with every
    pass fed a sample of its own (as warmup and capture feed them), ``chained_peak_bytes`` with a
    chunk's later layers fed the previous layer's output (as the model runs). Any graphing that
    keeps every pass's activations until its backward (as replay in the schedule's order
    requires) cannot peak below these: the first for separate static inputs, the second for
    layers reading their neighbour's output in place (``chain_buffers``)."""
    if cfg.device.type != "cuda":
        return {"peak_bytes": None, "chained_peak_bytes": None}
    torch.manual_seed(0)
    layers = [Layer(cfg.hidden, cfg.ffn).to(cfg.device, cfg.dtype) for _ in range(cfg.chunks * cfg.layers)]
    out = {}
    for key, chained in (("peak_bytes", False), ("chained_peak_bytes", True)):
        for _ in range(2):  # the second run is measured: the first creates cuBLAS workspaces
            out[key] = _eager_run(cfg, layers, chained)
    return out


def _eager_run(cfg: Config, layers: list[Layer], chained: bool) -> int:
    _collect(cfg)
    base = torch.cuda.memory_allocated(cfg.device)
    torch.cuda.reset_peak_memory_stats(cfg.device)
    per_chunk = 1 if chained else cfg.layers
    samples = [
        torch.randn(cfg.rows, cfg.hidden, device=cfg.device, dtype=cfg.dtype, requires_grad=True)
        for _ in range(cfg.chunks * cfg.micro * per_chunk)
    ]
    fwd, bwd = [0] * cfg.chunks, [0] * cfg.chunks
    live: dict[tuple[int, int], list[torch.Tensor]] = {}
    for e in cfg.order:
        c = abs(e) - 1
        if e > 0:
            m = fwd[c]
            fwd[c] += 1
            first = (c * cfg.micro + m) * per_chunk
            outs = [layers[c * cfg.layers](samples[first])]
            for li in range(1, cfg.layers):
                outs.append(layers[c * cfg.layers + li](outs[-1] if chained else samples[first + li]))
            live[(c, m)] = outs[-1:] if chained else outs
        else:
            m = bwd[c]
            bwd[c] += 1
            for o in reversed(live.pop((c, m))):
                o.backward(torch.ones_like(o))
    _sync(cfg)
    peak = torch.cuda.max_memory_allocated(cfg.device) - base
    del samples, live
    for p in (q for layer in layers for q in layer.parameters()):
        p.grad = None
    return peak


MODE_OPTIONS = {
    "reuse": "_reuse_graph_input_output_buffers",
    "share": "share_microbatch_graphs",
    "chain": "chain_buffers",
}


def mode_options(mode: str) -> dict[str, bool]:
    """A mode's options: ``no-reuse`` none, else ``+``-joined names of MODE_OPTIONS."""
    names = [] if mode == "no-reuse" else mode.split("+")
    unknown = [n for n in names if n not in MODE_OPTIONS]
    if unknown:
        raise ValueError(f"unknown mode part(s) {unknown}: no-reuse, or '+'-joined {', '.join(MODE_OPTIONS)}")
    return {MODE_OPTIONS[n]: True for n in names}


def graph_rank(cfg: Config, layers: list[Layer], samples: list[tuple[torch.Tensor]], mode: str) -> Any:
    """The rank's layers graphed over ``cfg.order`` in ``mode`` (``mode_options``), one sample
    tuple per pass (a list, as Megatron-LM and TransformerEngine's callers pass it)."""
    return gograph.make_graphed_callables(
        tuple(layers),
        samples,
        num_warmup_iters=cfg.warmup_iters,
        _order=cfg.order,
        _num_layers_per_chunk=cfg.layers,
        engine="eager" if cfg.smoke else None,
        **mode_options(mode),  # type: ignore[arg-type]
    )


def bench_mode(cfg: Config, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    layers = [Layer(cfg.hidden, cfg.ffn).to(cfg.device, cfg.dtype) for _ in range(cfg.chunks * cfg.layers)]
    params = [p for m in layers for p in m.parameters()]
    _collect(cfg)
    base = _allocated(cfg)
    if cfg.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(cfg.device)
    # As Megatron-LM and TransformerEngine's callers pass them: a list, one tuple per pass.
    samples = [
        (torch.randn(cfg.rows, cfg.hidden, device=cfg.device, dtype=cfg.dtype, requires_grad=True),)
        for _ in range(cfg.passes)
    ]
    t0 = time.perf_counter()
    try:
        graphed = graph_rank(cfg, layers, samples, mode)
    except (ValueError, NotImplementedError) as e:
        return {"mode": mode, "microbatches": cfg.micro, "refused": str(e)}
    _sync(cfg)
    call_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(cfg.device) - base if base is not None else None
    del samples  # Megatron keeps no reference to its sample args
    _collect(cfg)
    retained = _allocated(cfg) - base if base is not None else None
    build = graphed[0].build_stats
    warm = build.warmup if build is not None else None
    capture_s = sum(r.seconds for r in build.captures) if build is not None else None
    stats = graphed[0].buffer_reuse
    sample_buffers = cfg.passes * 2  # per pass: its input and its output's grad buffer
    result: dict[str, Any] = {
        "mode": mode,
        "microbatches": cfg.micro,
        "graph_sets": len({g.pass_id for g in graphed}),
        "engine": graphed[0].engine.name,
        "call_seconds": call_s,
        "capture_seconds": capture_s,
        "captures": len(build.captures) if build is not None else None,
        "peak_bytes_during_call": peak,
        "warmup_peak_bytes": (warm.peak_bytes - base) if warm is not None and base is not None else None,
        "warmup_peak_exact": warm.exact if warm is not None else None,
        "capture_memory_deltas": [r.memory_delta_bytes for r in build.captures] if build is not None else None,
        "retained_bytes_after_call": retained,
        "slots": stats.slots if stats is not None else sample_buffers,
        "te_fifo_slots": stats.te_fifo if stats is not None else sample_buffers,
        "buffers_without_reuse": stats.buffers if stats is not None else sample_buffers,
        "slots_by_signature": stats.signatures if stats is not None else None,
        "pool_buffers_released": stats.released if stats is not None else 0,
    }
    graphed_s, graphed_out = _timed_schedule(cfg, lambda p, x: graphed[p](x), params)
    eager_s, eager_out = _timed_schedule(
        cfg, lambda p, x: layers[(p // (cfg.layers * cfg.micro)) * cfg.layers + p % cfg.layers](x), params
    )
    result.update(
        graphed_schedule_seconds=graphed_s,
        eager_schedule_seconds=eager_s,
        speedup=eager_s / graphed_s if graphed_s > 0 else None,
        max_abs_diff_vs_eager=float((graphed_out - eager_out).abs().max()),
    )
    for g in graphed:
        g.reset()
    # The schedule's last outputs and the parameters' accumulated grads belong to the training
    # loop, not to the graphing: drop them so that what is left is what graphing kept.
    for p in params:
        p.grad = None
    graphed = build = stats = graphed_out = eager_out = None  # type: ignore[assignment]
    _collect(cfg)
    # what is left of the graphing (the model itself was allocated before `base`)
    result["bytes_after_reset_and_delete"] = _allocated(cfg) - base if base is not None else None
    layers = params = []
    return result


def _fmt(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the eager engine (CPU)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--iters", type=int, default=10, help="timed schedule iterations (median)")
    ap.add_argument("--warmup-iters", type=int, default=3, help="num_warmup_iters of make_graphed_callables")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument(
        "--modes", default="no-reuse,reuse", help="comma-separated: no-reuse, or '+'-joined reuse, share, chain"
    )
    ap.add_argument("--microbatches", default="8", help="comma-separated microbatch counts (multiples of 4)")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not (torch.cuda.is_available() and gograph.cuda_available()):
        print(
            f"bench/pipeline.py needs a GPU and the CUDA flavor of the core ({gograph.cuda_unavailable_reason()}); "
            "use --cpu-smoke for the eager engine",
            file=sys.stderr,
        )
        return 2
    counts = [int(m) for m in str(args.microbatches).split(",")]
    args.microbatches = counts[0]
    cfg = Config(args)
    results: dict[str, Any] = {"config": cfg.as_dict(), "results": {}}
    if cfg.device.type == "cuda":
        # One-time, per process: the CUDA engine's side streams. torch gives every stream that
        # runs a matmul its own cuBLAS workspace and keeps it until the process ends (or
        # torch._C._cuda_clearCublasWorkspaces()), so the first graphing in a process leaves
        # that much allocated; measured here on a throwaway layer so that the modes below show
        # what graphing itself leaves.
        _collect(cfg)
        before = _allocated(cfg)
        primer = torch.nn.Linear(cfg.hidden, cfg.hidden).to(cfg.device, cfg.dtype)
        g = gograph.make_graphed_callables(primer, (torch.randn(8, cfg.hidden, device=cfg.device, dtype=cfg.dtype),))
        g.reset()
        del g, primer
        _collect(cfg)
        results["engine_stream_workspaces_bytes"] = _allocated(cfg) - before  # type: ignore[operator]
        print(
            f"one-time per process (cuBLAS workspaces of the engine's side streams): "
            f"{_fmt(results['engine_stream_workspaces_bytes'])}"
        )
    floor = eager_floor(cfg)
    results["eager_schedule_floor"] = floor
    print(
        f"eager run of the order: peak {_fmt(floor['peak_bytes'])} with a sample per pass, "
        f"{_fmt(floor['chained_peak_bytes'])} with a chunk's layers chained (the floors for any graphing "
        "that keeps each pass's activations until its backward)"
    )
    runs = [(m, mode.strip()) for m in counts for mode in args.modes.split(",") if mode.strip()]
    for micro, mode in runs:
        try:
            mode_options(mode)
        except ValueError as e:
            ap.error(str(e))
        args.microbatches = micro
        cfg = Config(args)
        key = mode if len(counts) == 1 else f"{mode} x{micro}"
        r = bench_mode(cfg, mode)
        results["results"][key] = r
        if "refused" in r:
            print(f"[{key}] refused: {r['refused']}")
            continue
        print(
            f"[{key}] engine={r['engine']} call {r['call_seconds']:.2f} s (captures {r['captures']}, "
            f"{r['graph_sets']} sets of graphs for {cfg.passes} passes, {(r['capture_seconds'] or 0):.2f} s)"
        )
        deltas = [d for d in (r["capture_memory_deltas"] or []) if d is not None]
        running, top = 0, 0
        for d in deltas:
            running += d
            top = max(top, running)
        print(
            f"    warmup peak {_fmt(r['warmup_peak_bytes'])} (exact: {r['warmup_peak_exact']}); captures' "
            f"allocated memory rises to {_fmt(top)} above where capture started, ends at {_fmt(running)}"
        )
        print(
            f"    peak during call {_fmt(r['peak_bytes_during_call'])}, "
            f"retained after {_fmt(r['retained_bytes_after_call'])}, "
            f"after reset+delete {_fmt(r['bytes_after_reset_and_delete'])}"
        )
        print(
            f"    slots {r['slots']} (TransformerEngine FIFO {r['te_fifo_slots']}, without reuse "
            f"{r['buffers_without_reuse']}), pool buffers released early {r['pool_buffers_released']}"
        )
        print(
            f"    schedule iteration: graphed {r['graphed_schedule_seconds'] * 1e3:.2f} ms, eager "
            f"{r['eager_schedule_seconds'] * 1e3:.2f} ms (x{r['speedup']:.2f}), max |graphed - eager| "
            f"{r['max_abs_diff_vs_eager']:.3g}"
        )
    if "reuse" in results["results"] and "no-reuse" in results["results"]:
        a, b = results["results"]["no-reuse"], results["results"]["reuse"]
        if a["retained_bytes_after_call"] is not None:
            results["reuse_saves_bytes_retained"] = a["retained_bytes_after_call"] - b["retained_bytes_after_call"]
            results["reuse_saves_bytes_peak"] = a["peak_bytes_during_call"] - b["peak_bytes_during_call"]
            print(
                f"reuse saves {_fmt(results['reuse_saves_bytes_retained'])} retained, "
                f"{_fmt(results['reuse_saves_bytes_peak'])} peak"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
