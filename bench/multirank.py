"""Data-parallel training over per-layer graphed blocks, 2 and 4 ranks sharing one GPU (gloo):
peak reserved memory per rank and step time, gograph against torch's make_graphed_callables.

Every rank holds the same ``--layers`` blocks ``x + fc2(gelu(fc1(x)))`` (fp32, TF32 off), graphs
each block as its own callable, wraps the model in DistributedDataParallel (graph, then wrap) and
trains with SGD on its own data. Arms: ``eager`` (no graphs), ``torch``
(``torch.cuda.make_graphed_callables``), ``gograph`` (``gograph.make_graphed_callables``, the
drop-in call) and ``gograph-chain`` (``chain_buffers=True``).

* Memory: every (ranks, arm, ``zero_grad`` mode) cell runs in fresh processes: model init, then
  graphing, DDP and ``--steps`` steps. Per rank: the peak of ``torch.cuda.max_memory_reserved()``
  relative to just after model init, the peak allocated, and a digest of the parameters after
  training (equal digests across ranks: the replicas stayed in sync).
* Step time: one set of processes per (ranks, mode) holds every arm's model side by side; the
  arms run in alternating rounds of ``--steps`` steps each, their order rotated every round, all
  ranks starting each round together. A round's step time is the slowest rank's (DDP waits for
  it); reported per arm: the median round (ms per step), and the median of its per-round ratio
  to the reference arm (``--ref``, default torch).

Ranks rendezvous through a TCPStore on 127.0.0.1 (a free port) and share ``cuda:0``. With
``--cpu`` the same runs go on CPU ranks with gograph's eager engine (no torch arm, no device
memory: a smoke run; its numbers mean nothing).

  python bench/multirank.py                                  # 2 and 4 ranks, both modes, GPU
  python bench/multirank.py --ranks 2 --modes none --json out.json
  python bench/multirank.py --cpu --ranks 2 --layers 2 --width 16 --hidden 32 --rows 8 --steps 2 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import json
import logging
import multiprocessing.connection
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph

log = logging.getLogger("bench.multirank")
MiB = 2**20
ARMS = ("eager", "torch", "gograph", "gograph-chain")
MODES = {"none": True, "zero": False}  # zero_grad(set_to_none=...)


@dataclasses.dataclass(frozen=True)
class Config:
    """One cell's model and run. ``cpu``: CPU ranks on the eager engine."""

    layers: int = 8
    width: int = 1024
    hidden: int = 4096
    rows: int = 1024
    steps: int = 20
    rounds: int = 7
    set_to_none: bool = True
    cpu: bool = False


@dataclasses.dataclass
class Rank:
    """What a rank function gets (``tests/distributed``'s RankContext has the same fields)."""

    rank: int
    size: int
    device: torch.device


class Block(torch.nn.Module):
    def __init__(self, cfg: Config, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(cfg.width, cfg.hidden)
        self.fc2 = torch.nn.Linear(cfg.hidden, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


# ---------------------------------------------------------------------------------------------
# One arm on one rank
# ---------------------------------------------------------------------------------------------
class Arm:
    """An arm's model on this rank: its blocks (graphed as the arm says), DDP, SGD, data."""

    def __init__(self, name: str, cfg: Config, ctx: Any) -> None:
        """The model (the same initialisation in every arm) and this rank's data; ``build()``
        graphs and wraps it."""
        self.name, self.cfg, self.ctx = name, cfg, ctx
        self.layers = [Block(cfg, seed).to(ctx.device) for seed in range(cfg.layers)]
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        shape = (cfg.rows, cfg.width)
        data = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(4)]
        self.data = [(x.to(ctx.device), y.to(ctx.device)) for x, y in data]
        self.graph_s = 0.0

    def build(self) -> Arm:
        """Graphs the blocks as the arm says, then wraps the model in DDP (graph, then wrap)."""
        self.graph_s = self._graph()
        kwargs: dict[str, Any] = {} if self.cfg.cpu else {"device_ids": [self.ctx.device.index]}
        self.ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*self.layers), **kwargs)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-3)
        return self

    def _graph(self) -> float:
        if self.name == "eager":
            return 0.0
        gen = torch.Generator().manual_seed(7)
        samples = tuple(
            (torch.randn(self.cfg.rows, self.cfg.width, generator=gen).to(self.ctx.device).requires_grad_(i > 0),)
            for i in range(self.cfg.layers)
        )
        t0 = time.perf_counter()
        if self.name == "torch":
            torch.cuda.make_graphed_callables(tuple(self.layers), samples)
        else:
            gograph.make_graphed_callables(tuple(self.layers), samples, chain_buffers=self.name == "gograph-chain")
        _sync(self.ctx)
        return time.perf_counter() - t0

    def steps(self, n: int) -> None:
        for i in range(n):
            x, y = self.data[i % len(self.data)]
            F.mse_loss(self.ddp(x), y).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=self.cfg.set_to_none)

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.ddp.parameters():
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def release(self) -> None:
        for m in self.layers:
            if isinstance(m.forward, gograph.GraphedCallable):
                m.forward.reset()
        self.layers.clear()


def _sync(ctx: Any) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def memory_rank(ctx: Any, cfg: Config, arm: str) -> dict[str, Any]:
    """A memory cell on this rank (fresh processes): peaks relative to just after model init."""
    cuda = ctx.device.type == "cuda"
    run = Arm(arm, cfg, ctx)
    if cuda:
        torch.cuda.synchronize(ctx.device)
        base = torch.cuda.memory_reserved(ctx.device)
        base_alloc = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    run.build().steps(cfg.steps)
    _sync(ctx)
    out: dict[str, Any] = {"rank": ctx.rank, "arm": arm, "graph_s": run.graph_s, "params": run.digest()}
    if cuda:
        out["peak_reserved_mib"] = (torch.cuda.max_memory_reserved(ctx.device) - base) / MiB
        out["peak_allocated_mib"] = (torch.cuda.max_memory_allocated(ctx.device) - base_alloc) / MiB
    run.release()
    return out


def time_rank(ctx: Any, cfg: Config, arms: Sequence[str]) -> dict[str, Any]:
    """Every arm's model side by side on this rank; ``cfg.rounds`` rounds of ``cfg.steps``
    steps per arm, in rotated order, each arm's round started by all ranks together."""
    runs = [Arm(a, cfg, ctx).build() for a in arms]
    for run in runs:
        run.steps(2)
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(cfg.rounds):
        for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
            _sync(ctx)
            dist.barrier()
            t0 = time.perf_counter()
            run.steps(cfg.steps)
            _sync(ctx)
            times[run.name].append((time.perf_counter() - t0) * 1e3 / cfg.steps)
    out = {"rank": ctx.rank, "ms": times, "params": {run.name: run.digest() for run in runs}}
    for run in runs:
        run.release()
    return out


# ---------------------------------------------------------------------------------------------
# Launching ranks
# ---------------------------------------------------------------------------------------------
def _rank_entry(rank: int, size: int, port: int, cpu: bool, conn: Any, fn: Callable[..., Any], args: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1 if cpu else 4)
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
        conn.send(("ok", fn(Rank(rank, size, device), *args)))
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    conn.close()


def run_ranks(fn: Callable[..., Any], args: tuple[Any, ...], size: int, cpu: bool, timeout: float) -> list[Any]:
    """``fn(rank, *args)`` on ``size`` fresh spawned ranks; every rank's result, in rank order.
    Raises with every failed rank's traceback, or when they did not finish in ``timeout`` s."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pipes = [ctx.Pipe() for _ in range(size)]
    procs = [
        ctx.Process(target=_rank_entry, args=(r, size, store.port, cpu, pipes[r][1], fn, args), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    waiting = {pipes[r][0]: r for r in range(size)}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for conn in multiprocessing.connection.wait(list(waiting), timeout=deadline - time.monotonic()):
            r = waiting.pop(conn)
            try:
                got[r] = conn.recv()
            except EOFError:
                got[r] = ("error", f"the process died (exit code {procs[r].exitcode})")
    for p in procs:
        p.join(5.0 if len(got) == size else 0.0)
        if p.is_alive():
            p.kill()
    failed = [r for r in range(size) if got.get(r, ("error", None))[0] != "ok"]
    if failed:
        why = [f"rank {r}: {got[r][1] if r in got else f'no answer within {timeout:.0f} s'}" for r in failed]
        raise RuntimeError(f"{fn.__name__} on {size} ranks failed:\n" + "\n".join(why))
    return [got[r][1] for r in range(size)]


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------
def time_summary(per_rank: list[dict[str, Any]], arms: Sequence[str], ref: str) -> dict[str, Any]:
    """Per arm: the median round (the slowest rank's ms per step each round) and the median of
    its per-round ratio to ``ref``."""
    rounds = {a: [max(r["ms"][a][i] for r in per_rank) for i in range(len(per_rank[0]["ms"][a]))] for a in arms}
    out: dict[str, Any] = {}
    for a in arms:
        out[a] = {"median_ms": statistics.median(rounds[a]), "rounds_ms": rounds[a]}
        if ref in rounds:
            out[a]["ratio_to_" + ref] = statistics.median(x / y for x, y in zip(rounds[a], rounds[ref]))
        out[a]["ranks_agree"] = len({r["params"][a] for r in per_rank}) == 1
        out[a]["params"] = per_rank[0]["params"][a]  # rank 0's digest: equal digests, bitwise-equal training
    return out


def memory_summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks_agree": len({r["params"] for r in per_rank}) == 1, "params": per_rank[0]["params"]}
    for key in ("peak_reserved_mib", "peak_allocated_mib", "graph_s"):
        if key in per_rank[0]:
            out[key] = [r[key] for r in per_rank]
    return out


def table(results: dict[str, Any], ref: str) -> str:
    lines = ["ranks mode  arm            peak reserved MiB per rank     x eager  ms/step  x " + ref]
    for key, cell in results["cells"].items():
        ranks, mode = key.split("/")
        eager = cell["memory"].get("eager", {}).get("peak_reserved_mib")
        for arm, t in cell["time"].items():
            mem = cell["memory"].get(arm, {}).get("peak_reserved_mib")
            rel = f"{max(mem) / max(eager):7.3f}" if mem and eager else "      -"
            mem_s = " / ".join(f"{m:.0f}" for m in mem) if mem else "-"
            ratio = t.get("ratio_to_" + ref)
            lines.append(
                f"{ranks:>5} {mode:<5} {arm:<14} {mem_s:<30} {rel}  {t['median_ms']:7.3f}  "
                + (f"{ratio:5.3f}" if ratio is not None else "  -")
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    ap.add_argument("--modes", default="none,zero", help="zero_grad modes: none (set_to_none=True), zero")
    ap.add_argument("--arms", default="eager,torch,gograph,gograph-chain")
    ap.add_argument("--ref", default="torch", help="the arm ratios are taken against")
    ap.add_argument("--phases", default="memory,time")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks, eager engine: a smoke run")
    for name, default in (("layers", 8), ("width", 1024), ("hidden", 4096), ("rows", 1024), ("steps", 20)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per set of processes")
    ap.add_argument("--json", help="write the results here")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("bench/multirank.py: no GPU (use --cpu for the smoke run)")
    arms = [x for x in a.arms.split(",") if x and not (a.cpu and x == "torch")]
    ref = a.ref if a.ref in arms else arms[0]
    results: dict[str, Any] = {"argv": list(argv or sys.argv[1:]), "arms": arms, "ref": ref, "cells": {}}
    results["skipped"] = {"torch": "needs CUDA"} if a.cpu else {}
    for n in (int(x) for x in a.ranks.split(",")):
        for mode in a.modes.split(","):
            cfg = Config(a.layers, a.width, a.hidden, a.rows, a.steps, a.rounds, MODES[mode], a.cpu)
            cell: dict[str, Any] = {"config": dataclasses.asdict(cfg), "memory": {}, "time": {}}
            if "memory" in a.phases:
                for arm in arms:
                    cell["memory"][arm] = memory_summary(run_ranks(memory_rank, (cfg, arm), n, a.cpu, a.timeout))
            if "time" in a.phases:
                cell["time"] = time_summary(run_ranks(time_rank, (cfg, arms), n, a.cpu, a.timeout), arms, ref)
            results["cells"][f"{n}/{mode}"] = cell
            log.info("%d ranks, zero_grad %s: done", n, mode)
            gc.collect()
    log.info("%s", table(results, ref))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
