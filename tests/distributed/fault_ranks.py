"""Rank side of the fault tests: one rank fails while graphing, or the ranks graph different
things, and every rank reports how and when it failed and what it left behind.

Each function returns a report instead of raising (the test process compares the ranks'
reports): the error (type and message) or None, the seconds from the start of graphing to the
error, and the live pass records, graphs and pool references left once the rank released what
it still held.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import gograph

from ddp_ranks import BATCH, Block, D, DDPConfig, wrap
from rank_world import RankContext
from tp_ranks import ROWS, TPBlock, TPGenerator
from tp_ranks import D as TP_D

WARMUP_ITERS = 2


class FaultyBlock(torch.nn.Module):
    """Wraps a layer; its forward raises on call ``fail_at`` (1-based) when ``fail_at`` > 0, so a
    rank can fail in warmup (calls 1..WARMUP_ITERS) or in capture (call WARMUP_ITERS + 1)."""

    def __init__(self, inner: torch.nn.Module, fail_at: int) -> None:
        super().__init__()
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"injected fault in forward call {self.calls}")
        return self.inner(x)


def fail_at(ctx: RankContext, bad_rank: int, phase: str) -> int:
    """The forward call that fails on ``bad_rank`` (0 elsewhere: never)."""
    if ctx.rank != bad_rank:
        return 0
    return 1 if phase == "warmup" else WARMUP_ITERS + 1


def _engine(ctx: RankContext) -> gograph.Engine:
    return gograph.CudaEngine(ctx.device) if ctx.cuda else gograph.EagerEngine()


def _graph(
    ctx: RankContext, layers: list[torch.nn.Module], samples: tuple[tuple[Tensor], ...]
) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """make_graphed_callables on ``layers``: (report so far, what it returned, or () when it
    raised). The report has the error and the seconds until it, and the engine and pool."""
    engine, pool = _engine(ctx), gograph.graph_pool_handle()
    report: dict[str, Any] = {"rank": ctx.rank, "error": None, "engine": engine, "pool": pool}
    t0 = time.monotonic()
    try:
        graphed = gograph.make_graphed_callables(
            tuple(layers), samples, num_warmup_iters=WARMUP_ITERS, engine=engine, pool=pool
        )
    except Exception as e:
        report["error"], report["seconds"] = f"{type(e).__name__}: {e}", time.monotonic() - t0
        return report, ()
    report["seconds"] = time.monotonic() - t0
    return report, tuple(graphed)


def _finish(report: dict[str, Any], base: tuple[int, int]) -> dict[str, Any]:
    """Drops the engine and pool from the report and adds what is left above ``base``."""
    engine, pool = report.pop("engine"), report.pop("pool")
    report["pool_refs_left"] = engine.pool_refs(pool)
    gc.collect()
    report["passes_left"] = gograph.live_passes() - base[0]
    report["graphs_left"] = gograph.live_graphs() - base[1]
    return report


def _reset_all(graphed: tuple[Any, ...]) -> None:
    for g in graphed:  # a loop variable in the caller would keep the last one alive
        g.reset()


def tp_fault(ctx: RankContext, bad_rank: int, phase: str) -> dict[str, Any]:
    """Tensor-parallel blocks whose all-reduces run inside the graphed callables (gloo, eager
    engine): ``bad_rank`` raises in its second block's forward during ``phase``; the others
    wait for it inside their own build until it leaves the group."""
    gc.collect()
    base = (gograph.live_passes(), gograph.live_graphs())
    tp_gen = TPGenerator(ctx.device)
    faulty = FaultyBlock(TPBlock(1, tp_gen, p=0.0), fail_at(ctx, bad_rank, phase))
    layers = [m.to(ctx.device) for m in (TPBlock(0, tp_gen, p=0.0), faulty)]
    samples = tuple((torch.randn(ROWS, TP_D).to(ctx.device).requires_grad_(i > 0),) for i in range(2))
    report, graphed = _graph(ctx, layers, samples)
    _reset_all(graphed)
    del graphed, layers, faulty
    return _finish(report, base)


def ddp_fault(ctx: RankContext, bad_rank: int, phase: str) -> dict[str, Any]:
    """Per-layer graphed blocks then DDP around them (both engines; the graphs hold no
    collective): ``bad_rank`` raises in its second block's forward during ``phase``; the others
    graph, then wait for it in DDP's construction, or in the first step's gradient all-reduce,
    until it leaves the group. Every rank then resets what it graphed."""
    gc.collect()
    base = (gograph.live_passes(), gograph.live_graphs())
    layers: list[torch.nn.Module] = [Block(0), FaultyBlock(Block(1), fail_at(ctx, bad_rank, phase))]
    layers = [m.to(ctx.device) for m in layers]
    samples = tuple((torch.randn(BATCH, D).to(ctx.device).requires_grad_(i > 0),) for i in range(2))
    report, graphed = _graph(ctx, layers, samples)
    if report["error"] is None:
        t0 = time.monotonic()
        try:
            ddp = wrap(ctx, torch.nn.Sequential(*layers), DDPConfig(), None)
            F.mse_loss(ddp(torch.randn(BATCH, D).to(ctx.device)), torch.zeros(BATCH, D, device=ctx.device)).backward()
            ctx.sync()
            report["error"] = None
        except Exception as e:
            report["error"] = f"{type(e).__name__}: {e}"
        report["seconds"] += time.monotonic() - t0
        report["graphed"] = True
    _reset_all(graphed)
    del graphed, layers
    return _finish(report, base)


def mismatched_samples(ctx: RankContext, odd_rank: int) -> dict[str, Any]:
    """Tensor-parallel blocks (all-reduces inside the graphed callables, gloo, eager engine)
    graphed with samples of ``ROWS`` rows, but ``ROWS + 2`` on ``odd_rank``: the ranks capture
    different graphs, and their collectives disagree on sizes."""
    gc.collect()
    base = (gograph.live_passes(), gograph.live_graphs())
    tp_gen = TPGenerator(ctx.device)
    layers: list[torch.nn.Module] = [TPBlock(i, tp_gen, p=0.0).to(ctx.device) for i in range(2)]
    rows = ROWS + 2 if ctx.rank == odd_rank else ROWS
    samples = tuple((torch.randn(rows, TP_D).to(ctx.device).requires_grad_(i > 0),) for i in range(2))
    report, graphed = _graph(ctx, layers, samples)
    _reset_all(graphed)
    del graphed, layers
    return _finish(report, base)


def misbehave(ctx: RankContext, plan: dict[int, str]) -> int:
    """For the harness's own tests: this rank does what ``plan`` says (default ``"ok"``): return
    its rank, ``"raise"`` a ValueError naming it, ``"exit"`` its process with status 7, or
    ``"hang"`` (sleep far past any test's timeout)."""
    action = plan.get(ctx.rank, "ok")
    if action == "raise":
        raise ValueError(f"rank {ctx.rank} was told to raise")
    if action == "exit":
        os._exit(7)
    if action == "hang":
        time.sleep(3600)
    return ctx.rank
