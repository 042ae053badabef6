#!/usr/bin/env python3
"""Multi-process checks of gograph with NCCL collectives inside graphed layers (run by torchrun).

    torchrun --standalone --nproc-per-node 2 tests/multigpu/run_multigpu.py [--cpu-smoke] [--out-dir DIR]

(``scripts/multigpu-run.sh`` sets the environment and bounds the run.) Every rank runs the same
tests, in this order:

``tp_mlp``          a tensor-parallel MLP model (column- then row-parallel linear per block, all-reduce
                    forward and backward), each block graphed with gograph: 10 SGD steps bitwise equal
                    to the same model run eagerly on the same ranks; the eager tensor-parallel math
                    is also checked against the dense (unsplit) model.
``tp_mlp_dropout``  the same with dropout inside the tensor-parallel region, drawn from a per-rank
                    ``torch.Generator`` registered with the engine
                    (``gograph.CudaEngine(device, generators=[gen])``) so graph replays advance it: losses
                    bitwise equal to eager and the generator ends in the eager run's state.
``ddp``             ``DistributedDataParallel`` over a model whose inner blocks are graphed
                    (``num_warmup_iters=11``, warmup and capture on the engine's side stream); DDP
                    reduces the gradients the graphed backward returns: parameters bitwise equal to the
                    eager DDP model after 10 steps and equal on every rank.
``dp_ingraph``      data-parallel gradient averaging captured *inside* the backward graphs (an
                    all-reduce per parameter gradient): bitwise equal to eager, replicas in sync.
``teardown``        every graphed callable is reset (live graphs back to the baseline), then
                    ``destroy_process_group()`` must return within ``--destroy-timeout`` seconds (it
                    runs in a thread; a hang is a failure, not a stuck job).

With ``--cpu-smoke`` the same code runs on CPU with the gloo backend and gograph's eager engine.
Rank 0 prints one PASS/FAIL line per test with the step time (eager vs graphed) and per-rank
memory, and writes ``multigpu-summary.json`` into ``--out-dir``. The exit status is non-zero when
anything failed.
"""

from __future__ import annotations

import os

# Multicast (NVLS) stays off on the shared multi-GPU hosts, whatever the caller's environment.
for _key, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_key] = _value
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # bitwise-reproducible matmuls across streams

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
try:
    import gograph
except ImportError:  # a source checkout without PYTHONPATH=python
    sys.path.insert(0, os.path.join(_ROOT, "python"))
    import gograph

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from parallel_layers import (  # noqa: E402
    DenseMLPBlock,
    DPLinearBlock,
    MLPBlock,
    TPMLPBlock,
    dense_linear_weights,
)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402, N817

TESTS = ("tp_mlp", "tp_mlp_dropout", "ddp", "dp_ingraph")
MiB = 1024.0 * 1024.0


# ---------------------------------------------------------------------------------------------
# Context and small helpers
# ---------------------------------------------------------------------------------------------
@dataclass
class Sizes:
    batch: int
    d_in: int
    d: int
    f: int
    d_out: int
    layers: int


@dataclass
class Ctx:
    mode: str  # "cuda" or "cpu"
    rank: int
    world: int
    local_rank: int
    device: torch.device
    steps: int
    timed_steps: int
    sizes: Sizes
    lr: float = 0.05
    dropout: float = 0.1
    keep: list[torch.nn.Module] = field(default_factory=list)  # graphed modules, reset at teardown
    others: list[Any] = field(default_factory=list)  # DDP wrappers etc., dropped at teardown
    graph_baseline: int = 0

    @property
    def cuda(self) -> bool:
        return self.mode == "cuda"


def log0(ctx: Ctx, *args: Any) -> None:
    if ctx.rank == 0:
        print(*args, flush=True)


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def engine_for(ctx: Ctx, generators: Sequence[torch.Generator] = ()) -> Any:
    """The engine a user would pass: a CudaEngine carrying the extra generators on GPU (replays
    advance them), the eager reference engine on CPU (re-running the body consumes them as
    eager code does)."""
    if ctx.cuda:
        return gograph.CudaEngine(ctx.device, generators=list(generators)) if generators else None
    return "eager"


def tp_seed(rank: int) -> int:
    return 4242 + 1000 * rank


def batches(ctx: Ctx, n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=g).to(ctx.device) for _ in range(n)]


def mem_now(ctx: Ctx) -> dict[str, float]:
    if ctx.cuda:
        return {
            "allocated_mib": torch.cuda.memory_allocated(ctx.device) / MiB,
            "reserved_mib": torch.cuda.memory_reserved(ctx.device) / MiB,
            "peak_allocated_mib": torch.cuda.max_memory_allocated(ctx.device) / MiB,
        }
    return {"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def allocated(ctx: Ctx) -> float:
    return torch.cuda.memory_allocated(ctx.device) / MiB if ctx.cuda else 0.0


def train(
    ctx: Ctx,
    model: Callable[[torch.Tensor], torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[float]]:
    """SGD steps; returns the losses (clones) and the wall time of each step in ms."""
    opt = torch.optim.SGD(params, lr=ctx.lr)
    losses, times = [], []
    for x, y in zip(xs, ys):
        sync(ctx)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sync(ctx)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.detach().clone())
    return losses, times


def bitwise_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def replicas_in_sync(ctx: Ctx, params: Sequence[torch.Tensor]) -> bool:
    """Whether this rank holds rank 0's values (each rank reports its own answer)."""
    ok = True
    for p in params:
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        ok = ok and torch.equal(ref, p.detach())
    return ok


def ms(times: Sequence[float]) -> float:
    return float(statistics.median(times)) if times else float("nan")


def timed(
    ctx: Ctx,
    model: Callable[[torch.Tensor], torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
) -> float:
    """Median step time (ms) over ``ctx.timed_steps`` more steps (after the checked ones)."""
    n = ctx.timed_steps
    if n <= 0:
        return float("nan")
    reps_x = [xs[i % len(xs)] for i in range(n)]
    reps_y = [ys[i % len(ys)] for i in range(n)]
    _, times = train(ctx, model, params, reps_x, reps_y)
    return ms(times)


class Result(dict):
    """One test's result on one rank (a JSON-able dict)."""

    def check(self, name: str, ok: bool) -> bool:
        self.setdefault("checks", {})[name] = bool(ok)
        return bool(ok)


def graph(
    ctx: Ctx, res: Result, modules: Sequence[torch.nn.Module], samples: Sequence[torch.Tensor], **kwargs: Any
) -> None:
    """make_graphed_callables on ``modules`` (one callable per layer, one shared pool), recording
    the time it took and the memory it kept."""
    sync(ctx)
    before, graphs_before = allocated(ctx), gograph.live_graphs()
    t0 = time.perf_counter()
    gograph.make_graphed_callables(tuple(modules), tuple((s,) for s in samples), **kwargs)
    sync(ctx)
    res["graph_s"] = time.perf_counter() - t0
    res["graph_kept_mib"] = allocated(ctx) - before
    ctx.keep.extend(modules)
    res["graphed_callables"] = len(modules)
    res["graphs_captured"] = gograph.live_graphs() - graphs_before
    engines = {m.forward.engine.name for m in modules if isinstance(m.forward, gograph.GraphedCallable)}
    res.check(
        "graphed_on_" + ("cuda" if ctx.cuda else "eager") + "_engine", engines == {"cuda" if ctx.cuda else "eager"}
    )
    if ctx.cuda:  # a forward and a backward graph per layer, captured by the Go core
        res.check("graphs_captured", res["graphs_captured"] == 2 * len(modules))


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def tp_model(ctx: Ctx, dropout: float, tp_gen: torch.Generator | None) -> torch.nn.Sequential:
    """embed (replicated) -> ``layers`` tensor-parallel MLP blocks -> head (replicated)."""
    s = ctx.sizes
    gen = torch.Generator(device="cpu").manual_seed(1234)
    embed = torch.nn.Linear(s.d_in, s.d)
    head = torch.nn.Linear(s.d, s.d_out)
    with torch.no_grad():
        w, b = dense_linear_weights(s.d_in, s.d, gen)
        embed.weight.copy_(w)
        embed.bias.copy_(b)
    blocks = [TPMLPBlock(s.d, s.f, gen, dropout=dropout, generator=tp_gen) for _ in range(s.layers)]
    with torch.no_grad():
        w, b = dense_linear_weights(s.d, s.d_out, gen)
        head.weight.copy_(w)
        head.bias.copy_(b)
    return torch.nn.Sequential(embed, *blocks, head).to(ctx.device)


def dense_twin(ctx: Ctx, model: torch.nn.Sequential) -> torch.nn.Sequential:
    """The unsplit model of a (dropout-free) tensor-parallel model."""
    mods: list[torch.nn.Module] = []
    for m in model:
        if isinstance(m, TPMLPBlock):
            mods.append(DenseMLPBlock(*m.dense))
        else:
            lin = torch.nn.Linear(m.in_features, m.out_features)
            with torch.no_grad():
                lin.weight.copy_(m.weight)
                lin.bias.copy_(m.bias)
            mods.append(lin)
    return torch.nn.Sequential(*mods).to(ctx.device)


def dp_model(ctx: Ctx, block: type) -> torch.nn.Sequential:
    s = ctx.sizes
    gen = torch.Generator(device="cpu").manual_seed(4321)
    mods: list[torch.nn.Module] = []
    if block is MLPBlock:
        embed = torch.nn.Linear(s.d_in, s.d)
        with torch.no_grad():
            w, b = dense_linear_weights(s.d_in, s.d, gen)
            embed.weight.copy_(w)
            embed.bias.copy_(b)
        mods.append(embed)
    mods += [block(s.d, s.f, gen) for _ in range(s.layers)]
    return torch.nn.Sequential(*mods).to(ctx.device)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
def test_tp(ctx: Ctx, res: Result, dropout: float) -> bool:
    s = ctx.sizes
    tp_gen = torch.Generator(device=ctx.device) if dropout else None
    xs = batches(ctx, ctx.steps, (s.batch, s.d_in), seed=7)  # tensor parallel: same data on all ranks
    ys = batches(ctx, ctx.steps, (s.batch, s.d_out), seed=8)

    eager = tp_model(ctx, dropout, tp_gen)
    graphed = tp_model(ctx, dropout, tp_gen)
    res.check("same_init", bitwise_equal(list(eager.parameters()), list(graphed.parameters())))

    if not dropout:
        # The tensor-parallel math (split matmuls, forward and backward all-reduces) against the
        # dense model: outputs and the replicated embedding's gradient (it passes every backward
        # all-reduce) agree to float tolerance.
        tp_ref = tp_model(ctx, 0.0, None)
        dense = dense_twin(ctx, tp_ref)
        out_tp, out_dense = tp_ref(xs[0]), dense(xs[0])
        out_tp.square().mean().backward()
        out_dense.square().mean().backward()
        res["tp_vs_dense_rel_err"] = [rel_err(out_tp, out_dense), rel_err(tp_ref[0].weight.grad, dense[0].weight.grad)]
        res.check("tp_matches_dense_forward", res["tp_vs_dense_rel_err"][0] < 1e-4)
        res.check("tp_matches_dense_backward", res["tp_vs_dense_rel_err"][1] < 1e-3)
        del tp_ref, dense, out_tp, out_dense

    blocks = list(graphed)[1 : 1 + s.layers]
    g = torch.Generator(device="cpu").manual_seed(9)
    samples = [torch.randn(s.batch, s.d, generator=g).to(ctx.device).requires_grad_(True) for _ in blocks]
    if tp_gen is not None:
        tp_gen.manual_seed(tp_seed(ctx.rank))
    graph(ctx, res, blocks, samples, num_warmup_iters=3, engine=engine_for(ctx, [tp_gen] if tp_gen is not None else ()))
    if ctx.cuda and tp_gen is not None:
        res.check("tp_generator_registered", tp_gen in blocks[0].forward.engine.generators)

    torch.manual_seed(17)
    if tp_gen is not None:
        tp_gen.manual_seed(tp_seed(ctx.rank))
    losses_e, times_e = train(ctx, eager, list(eager.parameters()), xs, ys)
    gen_state_e = tp_gen.get_state() if tp_gen is not None else None

    torch.manual_seed(17)
    if tp_gen is not None:
        tp_gen.manual_seed(tp_seed(ctx.rank))
    losses_g, times_g = train(ctx, graphed, list(graphed.parameters()), xs, ys)
    gen_state_g = tp_gen.get_state() if tp_gen is not None else None

    res.check("losses_bitwise_equal", bitwise_equal(losses_e, losses_g))
    res.check("params_bitwise_equal", bitwise_equal(list(eager.parameters()), list(graphed.parameters())))
    if tp_gen is not None:
        res.check("tp_generator_advanced_like_eager", torch.equal(gen_state_e, gen_state_g))
        res.check("losses_change", not torch.equal(losses_g[0], losses_g[-1]))
    # Replicated parameters (embed, row-parallel biases, head) stay equal on every rank.
    replicated = [eager[0].weight, eager[0].bias, eager[-1].weight, eager[-1].bias]
    replicated += [b.fc2.bias for b in list(eager)[1 : 1 + s.layers]]
    replicated_g = [graphed[0].weight, graphed[0].bias, graphed[-1].weight, graphed[-1].bias]
    replicated_g += [b.fc2.bias for b in blocks]
    res.check("replicated_params_in_sync", replicas_in_sync(ctx, replicated + replicated_g))

    res["steps"] = len(losses_g)
    res["loss_first_last"] = [float(losses_g[0]), float(losses_g[-1])]
    res["eager_ms"] = timed(ctx, eager, list(eager.parameters()), xs, ys)
    res["graphed_ms"] = timed(ctx, graphed, list(graphed.parameters()), xs, ys)
    res["eager_checked_ms"], res["graphed_checked_ms"] = ms(times_e[1:]), ms(times_g[1:])
    return True


def test_ddp(ctx: Ctx, res: Result) -> bool:
    s = ctx.sizes
    # data parallel: every rank its own data
    xs = batches(ctx, ctx.steps, (s.batch, s.d_in), seed=100 + ctx.rank)
    ys = batches(ctx, ctx.steps, (s.batch, s.d), seed=200 + ctx.rank)
    ddp_kw: dict[str, Any] = {"device_ids": [ctx.local_rank]} if ctx.cuda else {}
    eager = DDP(dp_model(ctx, MLPBlock), **ddp_kw)
    # DDP keeps references to its gradient accumulators, which record the stream they were
    # created on: construct the graphed model's DDP under the side stream gograph will capture
    # on (torch's documented recipe), so the backward capture never syncs with another stream.
    side = torch.cuda.Stream(ctx.device) if ctx.cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(ctx.device))
        with torch.cuda.stream(side):
            graphed = DDP(dp_model(ctx, MLPBlock), **ddp_kw)
        torch.cuda.current_stream(ctx.device).wait_stream(side)
    else:
        graphed = DDP(dp_model(ctx, MLPBlock), **ddp_kw)
    ctx.others += [eager, graphed]
    res.check("same_init", bitwise_equal(list(eager.parameters()), list(graphed.parameters())))

    # Graph the DDP-wrapped module's inner blocks. DDP itself stays eager: its reducer hooks fire
    # when autograd accumulates the gradients the graphed backward returns, and reduce them.
    blocks = list(graphed.module)[1:]
    g = torch.Generator(device="cpu").manual_seed(9)
    samples = [torch.randn(s.batch, s.d, generator=g).to(ctx.device).requires_grad_(True) for _ in blocks]
    engine = gograph.CudaEngine(ctx.device, stream=side) if side is not None else engine_for(ctx)
    graph(ctx, res, blocks, samples, num_warmup_iters=11, engine=engine)

    losses_e, times_e = train(ctx, eager, list(eager.parameters()), xs, ys)
    losses_g, times_g = train(ctx, graphed, list(graphed.parameters()), xs, ys)
    res.check("losses_bitwise_equal", bitwise_equal(losses_e, losses_g))
    res.check("params_bitwise_equal", bitwise_equal(list(eager.parameters()), list(graphed.parameters())))
    res.check("replicas_in_sync", replicas_in_sync(ctx, list(graphed.parameters())))
    res.check("params_moved", not bitwise_equal(list(graphed.parameters()), list(dp_model(ctx, MLPBlock).parameters())))
    res["steps"] = len(losses_g)
    res["loss_first_last"] = [float(losses_g[0]), float(losses_g[-1])]
    res["eager_ms"] = timed(ctx, eager, list(eager.parameters()), xs, ys)
    res["graphed_ms"] = timed(ctx, graphed, list(graphed.parameters()), xs, ys)
    res["eager_checked_ms"], res["graphed_checked_ms"] = ms(times_e[1:]), ms(times_g[1:])
    return True


def test_dp_ingraph(ctx: Ctx, res: Result) -> bool:
    s = ctx.sizes
    xs = batches(ctx, ctx.steps, (s.batch, s.d), seed=300 + ctx.rank)
    ys = batches(ctx, ctx.steps, (s.batch, s.d), seed=400 + ctx.rank)
    eager = dp_model(ctx, DPLinearBlock)
    graphed = dp_model(ctx, DPLinearBlock)
    res.check("same_init", bitwise_equal(list(eager.parameters()), list(graphed.parameters())))
    blocks = list(graphed)
    g = torch.Generator(device="cpu").manual_seed(9)
    samples = [torch.randn(s.batch, s.d, generator=g).to(ctx.device).requires_grad_(i > 0) for i in range(len(blocks))]
    engine = engine_for(ctx)
    graph(ctx, res, blocks, samples, num_warmup_iters=11, engine=engine)

    losses_e, times_e = train(ctx, eager, list(eager.parameters()), xs, ys)
    losses_g, times_g = train(ctx, graphed, list(graphed.parameters()), xs, ys)
    res.check("losses_bitwise_equal", bitwise_equal(losses_e, losses_g))
    res.check("params_bitwise_equal", bitwise_equal(list(eager.parameters()), list(graphed.parameters())))
    res.check("replicas_in_sync", replicas_in_sync(ctx, list(graphed.parameters())))
    res["steps"] = len(losses_g)
    res["loss_first_last"] = [float(losses_g[0]), float(losses_g[-1])]
    res["eager_ms"] = timed(ctx, eager, list(eager.parameters()), xs, ys)
    res["graphed_ms"] = timed(ctx, graphed, list(graphed.parameters()), xs, ys)
    res["eager_checked_ms"], res["graphed_checked_ms"] = ms(times_e[1:]), ms(times_g[1:])
    return True


def run_test(ctx: Ctx, name: str) -> Result:
    res = Result(name=name, rank=ctx.rank)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    try:
        if name == "tp_mlp":
            test_tp(ctx, res, dropout=0.0)
        elif name == "tp_mlp_dropout":
            test_tp(ctx, res, dropout=ctx.dropout)
        elif name == "ddp":
            test_ddp(ctx, res)
        elif name == "dp_ingraph":
            test_dp_ingraph(ctx, res)
        else:
            raise ValueError(f"unknown test {name!r} (known: {', '.join(TESTS)})")
        res["error"] = None
    except Exception as e:  # reported, and the run goes on with the next test
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(f"[rank {ctx.rank}] {name} raised:\n{res['traceback']}", file=sys.stderr, flush=True)
    sync(ctx)
    res["seconds"] = time.perf_counter() - t0
    res["mem"] = mem_now(ctx)
    res["passed"] = res["error"] is None and bool(res.get("checks")) and all(res["checks"].values())
    failed = [k for k, v in res.get("checks", {}).items() if not v]
    # progress as it happens (the combined table comes at the end, after a gather)
    print(
        f"[rank {ctx.rank}] {name}: {'ok' if res['passed'] else 'FAILED'} in {res['seconds']:.1f} s"
        + (f"; failed checks: {', '.join(failed)}" if failed else "")
        + (f"; error: {res['error']}" if res["error"] else ""),
        file=sys.stderr,
        flush=True,
    )
    gc.collect()
    return res


# ---------------------------------------------------------------------------------------------
# Teardown
# ---------------------------------------------------------------------------------------------
def reset_all(ctx: Ctx) -> dict[str, Any]:
    """Resets every graphed callable, drops the models, and checks the core's graphs are gone."""
    out: dict[str, Any] = {"rank": ctx.rank, "reset": len(ctx.keep)}
    t0 = time.perf_counter()
    try:
        for m in ctx.keep:
            m.reset()  # type: ignore[operator]
        out["reset_error"] = None
    except Exception as e:
        out["reset_error"] = f"{type(e).__name__}: {e}"
    ctx.keep.clear()
    ctx.others.clear()
    gc.collect()
    sync(ctx)
    out["live_graphs_left"] = gograph.live_graphs() - ctx.graph_baseline
    out["reset_s"] = time.perf_counter() - t0
    out["passed"] = out["reset_error"] is None and out["live_graphs_left"] <= 0
    return out


def destroy_bounded(timeout: float) -> dict[str, Any]:
    """destroy_process_group() in a daemon thread; a failure when it does not return in time."""
    box: dict[str, Any] = {"error": None}
    done = threading.Event()

    def _destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as e:  # reported, not raised in the thread
            box["error"] = f"{type(e).__name__}: {e}"
        finally:
            done.set()

    t0 = time.perf_counter()
    th = threading.Thread(target=_destroy, name="destroy_process_group", daemon=True)
    th.start()
    returned = done.wait(timeout)
    return {
        "destroy_returned": returned,
        "destroy_s": time.perf_counter() - t0,
        "destroy_timeout_s": timeout,
        "destroy_error": box["error"],
        "passed": returned and box["error"] is None,
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def fmt_mem(ctx_mode: str, m: dict[str, float]) -> str:
    if ctx_mode == "cuda":
        return f"alloc {m['allocated_mib']:.1f} peak {m['peak_allocated_mib']:.1f} reserved {m['reserved_mib']:.1f} MiB"
    return f"maxrss {m['max_rss_mib']:.0f} MiB"


def report(mode: str, per_test: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0: one line per test, the combined view across ranks."""
    summary = []
    for ranks in per_test:
        name = ranks[0]["name"]
        passed = all(r["passed"] for r in ranks)
        eager = statistics.fmean(r.get("eager_ms", float("nan")) for r in ranks)
        graphed = statistics.fmean(r.get("graphed_ms", float("nan")) for r in ranks)
        speed = eager / graphed if graphed and graphed == graphed and graphed > 0 else float("nan")
        print(
            f"{'PASS' if passed else 'FAIL'} {name:<15} eager {eager:8.3f} ms/step  graphed {graphed:8.3f} ms/step  "
            f"speedup {speed:5.2f}x",
            flush=True,
        )
        for r in ranks:
            kept = r.get("graph_kept_mib")
            kept_s = f" graph+static kept {kept:.1f} MiB," if kept is not None and mode == "cuda" else ""
            graph_s = r.get("graph_s", float("nan"))
            print(f"     rank {r['rank']}:{kept_s} {fmt_mem(mode, r['mem'])}; graphing {graph_s:.2f} s", flush=True)
            failed = [k for k, v in r.get("checks", {}).items() if not v]
            if failed:
                print(f"     rank {r['rank']} failed checks: {', '.join(failed)}", flush=True)
            if r.get("error"):
                print(f"     rank {r['rank']} error: {r['error']}", flush=True)
        summary.append(
            {"name": name, "passed": passed, "eager_ms": eager, "graphed_ms": graphed, "speedup": speed, "ranks": ranks}
        )
    return summary


def wait_for_rank_files(out_dir: str, world: int, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    found: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline and len(found) < world:
        for r in range(world):
            path = os.path.join(out_dir, f"teardown-rank{r}.json")
            if r not in found and os.path.exists(path):
                try:
                    with open(path) as fh:
                        found[r] = json.load(fh)
                except (OSError, ValueError):
                    pass  # being written: next round
        if len(found) < world:
            time.sleep(0.2)
    return [
        found.get(r, {"rank": r, "passed": False, "error": "no teardown report from this rank"}) for r in range(world)
    ]


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="gloo backend, CPU tensors, gograph's eager engine")
    p.add_argument("--tests", default=",".join(TESTS), help=f"comma-separated subset of {', '.join(TESTS)}")
    p.add_argument("--steps", type=int, default=10, help="checked training steps per test (default 10)")
    p.add_argument("--timed-steps", type=int, default=None, help="extra timed steps per model (default 30, cpu 2)")
    p.add_argument("--destroy-timeout", type=float, default=60.0, help="seconds destroy_process_group may take")
    p.add_argument("--pg-timeout", type=float, default=180.0, help="process-group collective timeout, seconds")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "/tmp/gograph-multigpu")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> Ctx:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    if args.cpu_smoke:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        sizes = Sizes(batch=8, d_in=16, d=32, f=64, d_out=16, layers=2)
        mode = "cpu"
        timed_steps = 2 if args.timed_steps is None else args.timed_steps
    else:
        if not torch.cuda.is_available():
            raise SystemExit("run_multigpu: torch sees no GPU (use --cpu-smoke for the CPU path)")
        if torch.cuda.device_count() <= local_rank:
            raise SystemExit(f"run_multigpu: local rank {local_rank} but only {torch.cuda.device_count()} GPU(s)")
        if not gograph.cuda_available():
            raise SystemExit(f"run_multigpu: gograph's cuda core is not loaded: {gograph.cuda_unavailable_reason()}")
        # Each rank owns one GPU, set before anything touches CUDA or graphs.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
        sizes = Sizes(batch=128, d_in=1024, d=1024, f=4096, d_out=1024, layers=4)
        mode = "cuda"
        timed_steps = 30 if args.timed_steps is None else args.timed_steps
    return Ctx(
        mode=mode,
        rank=rank,
        world=world,
        local_rank=local_rank,
        device=device,
        steps=args.steps,
        timed_steps=timed_steps,
        sizes=sizes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time() - 1.0
    ctx = setup(args)
    os.makedirs(args.out_dir, exist_ok=True)
    if ctx.rank == 0:  # stale results of an earlier run (the others only read them at the end)
        for r in range(ctx.world):
            for stale in (f"teardown-rank{r}.json", "multigpu-summary.json"):
                try:
                    os.remove(os.path.join(args.out_dir, stale))
                except FileNotFoundError:
                    pass
    names = [n.strip() for n in args.tests.split(",") if n.strip()]
    gc.collect()
    ctx.graph_baseline = gograph.live_graphs()

    env = {
        "mode": ctx.mode,
        "world_size": ctx.world,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gograph": gograph.__version__,
        "core_flavor": gograph.core_flavor(),
        "backend": dist.get_backend(),
        "sizes": ctx.sizes.__dict__,
        "steps": ctx.steps,
        "timed_steps": ctx.timed_steps,
        "nccl_env": {
            k: os.environ.get(k)
            for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
        },
    }
    if ctx.cuda:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["device"] = torch.cuda.get_device_name(ctx.device)
    log0(ctx, "multigpu:", json.dumps(env))

    results = [run_test(ctx, n) for n in names]
    gathered: list[list[dict[str, Any]]] = [[] for _ in range(ctx.world)]
    dist.all_gather_object(gathered, results)
    per_test = [[gathered[r][i] for r in range(ctx.world)] for i in range(len(names))]
    summary = report(ctx.mode, per_test) if ctx.rank == 0 else []
    tests_ok = all(all(r["passed"] for r in ranks) for ranks in per_test)

    # Teardown: reset every graphed callable (on every rank), then destroy the process group.
    reset = reset_all(ctx)
    resets: list[dict[str, Any]] = [{} for _ in range(ctx.world)]
    dist.all_gather_object(resets, reset)
    destroy = destroy_bounded(args.destroy_timeout)
    mine = {**reset, **destroy, "passed": reset["passed"] and destroy["passed"]}
    tmp = os.path.join(args.out_dir, f".teardown-rank{ctx.rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(mine, fh)
    os.replace(tmp, os.path.join(args.out_dir, f"teardown-rank{ctx.rank}.json"))
    if not destroy["passed"]:
        why = (
            f"raised {destroy['destroy_error']}"
            if destroy["destroy_returned"]
            else f"did not return within {args.destroy_timeout:.0f} s"
        )
        print(f"[rank {ctx.rank}] teardown: destroy_process_group {why}", file=sys.stderr, flush=True)

    ok = tests_ok and mine["passed"]
    summary_path = os.path.join(args.out_dir, "multigpu-summary.json")
    if ctx.rank != 0:
        # torchrun stops the other workers as soon as one exits non-zero: wait (bounded) until
        # rank 0 has written the summary, then leave with this rank's own status.
        deadline = time.monotonic() + args.destroy_timeout + 60
        while time.monotonic() < deadline and not (
            os.path.exists(summary_path) and os.path.getmtime(summary_path) >= started
        ):
            time.sleep(0.2)
    if ctx.rank == 0:
        teardown = wait_for_rank_files(args.out_dir, ctx.world, timeout=args.destroy_timeout + 30)
        td_ok = all(t.get("passed") for t in teardown)
        print(
            f"{'PASS' if td_ok else 'FAIL'} {'teardown':<15} reset {[t.get('reset') for t in teardown]} graphed "
            f"callables per rank, live graphs left {[t.get('live_graphs_left') for t in teardown]}, "
            f"destroy_process_group {[round(t.get('destroy_s', -1), 2) for t in teardown]} s "
            f"(limit {args.destroy_timeout:.0f} s)",
            flush=True,
        )
        ok = tests_ok and td_ok
        n_pass = sum(1 for s in summary if s["passed"]) + (1 if td_ok else 0)
        n_fail = len(summary) + 1 - n_pass
        doc = {
            "env": env,
            "tests": summary,
            "teardown": {"name": "teardown", "passed": td_ok, "ranks": teardown},
            "passed": ok,
            "n_passed": n_pass,
            "n_failed": n_fail,
        }
        path = summary_path
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh, indent=2, default=str)
        os.replace(tmp, path)
        print(f"multigpu ({ctx.mode}, {ctx.world} ranks): {n_pass} passed, {n_fail} failed; summary {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: a destroy thread that never returned must not hang exit.
    os._exit(code)
