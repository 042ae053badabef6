"""Spawned ranks that run one scenario at a time, for the multi-rank tests.

``RankWorld(layout)`` spawns ``layout.procs`` processes (``torch.multiprocessing``, spawn) that
connect to a ``TCPStore`` the test process hosts on 127.0.0.1 (a free port the OS picks: nothing
listens beyond loopback) and wait for work on a pipe each. ``world.run(fn, *args, size=n)``
makes ranks ``0..n-1`` call ``fn(ctx, *args)`` (``ctx`` a :class:`RankContext`) inside a fresh
process group of ``n`` ranks (the layout's backend, its rendezvous under a prefix of the store
that no other run uses), destroys that group afterwards and returns each rank's result. So one
set of processes serves the 2-rank and the 4-rank runs of a whole session.

Every run is bounded. A rank that raises, dies or does not answer within ``timeout`` seconds
makes ``run`` raise :class:`RanksFailed`, which names every failed rank with its error and
traceback (``outcomes`` returns them instead, for scenarios where a rank is meant to fail). A
rank that did not answer is killed; a dead rank is spawned again before the next run, so one
hung or crashed scenario costs its own test, not the suite.

Rank functions must be importable by name (module-level functions in modules on ``sys.path``,
which a spawned process inherits) and take and return picklable values.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import itertools
import logging
import math
import multiprocessing.connection
import os
import resource
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

log = logging.getLogger("gograph.tests.ranks")

HOST = "127.0.0.1"
SPAWN_TIMEOUT_S = 180.0  # importing torch and gograph in 4 processes on 2 busy cores
GROUP_TIMEOUT_S = 20.0  # each run's process group: a collective that waits longer raises
# CUDA ranks: a fixed cuBLAS workspace keeps matmuls bitwise reproducible across streams (graphed
# against eager); NCCL's NVLink multicast (NVLS) stays off; a blocking wait would synchronize the
# host inside a capture.
CUDA_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a world's processes are placed.

    ``engine``: ``"eager"`` (CPU tensors, gograph's eager engine) or ``"cuda"`` (CUDA tensors,
    the CUDA engine). ``gpu_per_rank``: rank r on ``cuda:r`` (NCCL needs a GPU per rank);
    otherwise every CUDA rank shares ``cuda:0``."""

    procs: int = 4
    engine: str = "eager"
    backend: str = "gloo"
    gpu_per_rank: bool = False

    def device(self, rank: int) -> torch.device:
        if self.engine == "eager":
            return torch.device("cpu")
        return torch.device("cuda", rank if self.gpu_per_rank else 0)

    def __str__(self) -> str:
        where = "cpu" if self.engine == "eager" else ("a GPU per rank" if self.gpu_per_rank else "one shared GPU")
        return f"{self.procs} processes, {self.engine} engine, {self.backend}, {where}"


@dataclasses.dataclass
class RankContext:
    """What a rank function gets: its rank, the run's group size, the layout, its device."""

    rank: int
    size: int
    layout: Layout
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Waits for this rank's device work (a no-op on CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


@dataclasses.dataclass
class RankOutcome:
    """One rank's answer to one run: its value, or its error and traceback."""

    rank: int
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    seconds: float = math.nan

    @property
    def ok(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        head = f"--- rank {self.rank}: {self.error}"
        if not math.isnan(self.seconds):
            head += f" (after {self.seconds:.2f} s)"
        return head + (f"\n{self.traceback.rstrip()}" if self.traceback else "")


class RanksFailed(AssertionError):
    """Some ranks of a run failed; the message has every failed rank's error and traceback."""

    def __init__(self, what: str, outcomes: list[RankOutcome]) -> None:
        self.outcomes = outcomes
        failed = [o for o in outcomes if not o.ok]
        lines = [f"{len(failed)} of {len(outcomes)} ranks failed running {what}:"]
        lines += [o.describe() for o in failed]
        super().__init__("\n".join(lines))


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order: equal digests are bitwise-equal tensors, and a
    digest is what a rank sends back instead of its tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gloo_skip_reason() -> str | None:
    """Why gloo worlds cannot run here, or None."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend"
    return None


# ---------------------------------------------------------------------------------------------
# A rank process
# ---------------------------------------------------------------------------------------------
def _rank_main(rank: int, layout: Layout, port: int, conn: Any) -> None:
    """A rank process: connects to the store, then runs commands until it gets None."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback, like the store
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a rank that aborts leaves no core file
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    device = layout.device(rank)
    if device.type == "cuda":
        for key, value in CUDA_ENV.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # bitwise comparisons against eager
        torch.backends.cudnn.allow_tf32 = False
    store = dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=SPAWN_TIMEOUT_S))
    _settle()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):  # the test process is gone
            break
        if command is None:
            break
        run_id, size, fn, args, group_timeout = command
        ctx = RankContext(rank, size, layout, device)
        conn.send(("done", run_id, *_run_one(ctx, store, run_id, fn, args, group_timeout)))
    conn.close()
    os._exit(0)  # no interpreter teardown: nothing of a run is left to flush


def _settle() -> None:
    """Collects what a run (or the imports) left, then moves everything still alive out of the
    collector's way: the leak checks' ``gc.collect()`` then walks only what the next run makes
    (with torch and torch._dynamo imported, a full collection takes 0.15 s; after this, ms)."""
    gc.collect()
    gc.freeze()


def _run_one(
    ctx: RankContext,
    store: dist.Store,
    run_id: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    group_timeout: float | None,
) -> tuple[Any, str | None, str | None, float]:
    """Runs ``fn(ctx, *args)`` in a fresh process group (none when ``group_timeout`` is None):
    (value, error, traceback, seconds)."""
    t0 = time.monotonic()
    try:
        if group_timeout is not None:
            _join_group(ctx, dist.PrefixStore(f"run{run_id}", store), group_timeout)
        try:
            value = fn(ctx, *args)
            ctx.sync()
        finally:
            # A rank that leaves its group closes its connections: peers still waiting on it in
            # a collective fail at once instead of at the group's timeout.
            if dist.is_initialized():
                dist.destroy_process_group()
        result = (value, None, None, time.monotonic() - t0)
    except BaseException as e:  # reported to the test process with the traceback
        result = (None, f"{type(e).__name__}: {e}", traceback.format_exc(), time.monotonic() - t0)
    _settle()  # once the traceback is gone, so nothing a failed run held is frozen
    return result


def _join_group(ctx: RankContext, store: dist.Store, timeout: float) -> None:
    kwargs: dict[str, Any] = {"device_id": ctx.device} if ctx.layout.backend == "nccl" else {}
    dist.init_process_group(
        ctx.layout.backend,
        store=store,
        rank=ctx.rank,
        world_size=ctx.size,
        timeout=datetime.timedelta(seconds=timeout),
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# The test process's side
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Proc:
    process: Any
    conn: Any


class RankWorld:
    """``layout.procs`` spawned ranks serving runs; see the module docstring."""

    _ids = itertools.count(1)

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.closed = False
        self._mp = mp.get_context("spawn")
        self._store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
        self._procs: list[_Proc | None] = [None] * layout.procs  # spawned by the first run that needs them

    def _revive(self, size: int | None = None) -> None:
        """Spawns every rank below ``size`` (all by default) that is not running, and waits
        until they are up."""
        t0 = time.monotonic()
        started = []
        for r, proc in enumerate(self._procs[:size]):
            if proc is None or not proc.process.is_alive():
                ours, theirs = self._mp.Pipe()
                p = self._mp.Process(
                    target=_rank_main, args=(r, self.layout, self._store.port, theirs), name=f"rank{r}", daemon=True
                )
                p.start()
                theirs.close()
                self._procs[r] = _Proc(p, ours)
                started.append(r)
        for r in started:
            self._await_ready(r, t0 + SPAWN_TIMEOUT_S)
        if started:
            log.info("spawned ranks %s of %s in %.1f s", started, self.layout, time.monotonic() - t0)

    def _await_ready(self, rank: int, deadline: float) -> None:
        proc = self._procs[rank]
        assert proc is not None
        try:
            if proc.conn.poll(max(0.0, deadline - time.monotonic())) and proc.conn.recv()[0] == "ready":
                return
            why = f"not up after {SPAWN_TIMEOUT_S:.0f} s"
        except (EOFError, OSError):
            proc.process.join(5.0)
            why = _exit_status(proc.process.exitcode)
        self.close()
        raise RuntimeError(f"could not start rank {rank} of {self.layout}: {why}")

    def run(self, fn: Callable[..., Any], *args: Any, size: int, timeout: float = 60.0, **kw: Any) -> list[Any]:
        """Ranks ``0..size-1``'s ``fn(ctx, *args)``, in rank order; RanksFailed when any failed."""
        outcomes = self.outcomes(fn, *args, size=size, timeout=timeout, **kw)
        if not all(o.ok for o in outcomes):
            raise RanksFailed(f"{_name(fn)} on {size} ranks", outcomes)
        return [o.value for o in outcomes]

    def outcomes(
        self,
        fn: Callable[..., Any],
        *args: Any,
        size: int,
        timeout: float = 60.0,
        group_timeout: float | None = GROUP_TIMEOUT_S,
    ) -> list[RankOutcome]:
        """Every rank's outcome of ``fn(ctx, *args)`` on ranks ``0..size-1``, within ``timeout``
        seconds; the run's process group waits ``group_timeout`` seconds in a collective before
        it raises (None: no process group, for runs that test the world itself)."""
        if self.closed:
            raise RuntimeError(f"this world ({self.layout}) was shut down")
        if not 1 <= size <= self.layout.procs:
            raise ValueError(f"a run of {size} ranks in a world of {self.layout.procs} processes")
        self._revive(size)
        run_id = next(self._ids)
        procs = [p for p in self._procs[:size] if p is not None]
        for p in procs:
            p.conn.send((run_id, size, fn, args, group_timeout))
        got = self._collect(run_id, procs, time.monotonic() + timeout)
        for r in range(size):
            if r not in got:  # stuck: killed, and spawned again before the next run
                procs[r].process.kill()
                procs[r].process.join(5.0)
                got[r] = RankOutcome(r, error=f"no answer within {timeout:.0f} s: killed (hung?)", seconds=timeout)
        return [got[r] for r in range(size)]

    def _collect(self, run_id: int, procs: list[_Proc], deadline: float) -> dict[int, RankOutcome]:
        got: dict[int, RankOutcome] = {}
        waiting = {p.conn: r for r, p in enumerate(procs)}
        while waiting and time.monotonic() < deadline:
            for conn in multiprocessing.connection.wait(list(waiting), timeout=deadline - time.monotonic()):
                r = waiting.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the process died
                    procs[r].process.join(5.0)
                    got[r] = RankOutcome(r, error=f"the rank's process died: {_exit_status(procs[r].process.exitcode)}")
                    continue
                if msg[0] == "done" and msg[1] == run_id:
                    got[r] = RankOutcome(r, *msg[2:])
                else:  # not this run's answer
                    waiting[conn] = r
        return got

    def close(self) -> None:
        """Stops the ranks (asks, then kills what did not stop)."""
        if self.closed:
            return
        self.closed = True
        live = [p for p in self._procs if p is not None]
        for p in live:
            try:
                p.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for p in live:
            p.process.join(max(0.0, deadline - time.monotonic()))
            if p.process.is_alive():
                p.process.kill()
                p.process.join(5.0)
            p.conn.close()


class WorldCache:
    """One world per layout, spawned on first use; closed together."""

    def __init__(self) -> None:
        self._worlds: dict[Layout, RankWorld] = {}

    def get(self, layout: Layout) -> RankWorld:
        world = self._worlds.get(layout)
        if world is None or world.closed:
            world = self._worlds[layout] = RankWorld(layout)
        return world

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
