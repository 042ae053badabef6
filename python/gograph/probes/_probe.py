"""What a build's warmup shows about its memory: build hooks (:class:`gograph.build._exec.BuildHooks`).

:class:`WarmupSizes` (both engines) keeps, per pass, the storage sizes of its first warmup
forward's outputs and of the grads its first warmup backward returned: what the static buffers
of the real build will hold (:func:`gograph.plan_memory`). :class:`AllocationTrace` (CUDA) adds
the caching allocator's alloc and free events of every warmup op, read from
``torch.cuda.memory``'s history, and writes them as the core's trace (docs/CORE_API.md): a
capture allocates what its eager step allocated, so the core can replay those events through its
allocator model in the capture program's order. :class:`SeedTrace` records a build's own warmup
that way, cheaply, and once the captures are planned asks the core for the pool seed.

Nothing here decides: the core predicts, and the seed is its choice.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from ..build._exec import Executor, Hooks, ProgramKind
from ..build._state import PassState
from ..core import _plan
from ..core._wire import CaptureProgram, Op, Trace
from ..runtime.engines import HELD, CudaEngine, Engine
from ..support import _torch

__all__ = [
    "AllocationTrace",
    "CountedTrace",
    "Probe",
    "SeedTrace",
    "WarmupSizes",
    "first_ops",
    "op_spans",
    "seed_may_matter",
    "sizes_recorder",
    "trace_text",
]

log = logging.getLogger("gograph")

# Allocator history actions the trace does not need (segments are the model's business).
_SKIP = ["segment_alloc", "segment_free", "segment_map", "segment_unmap", "snapshot", "oom", "free_requested"]


# The caching allocator serves requests up to 1 MiB from its small pool (2 MiB segments, kSmallSize).
SMALL_REQUEST = 1 << 20


def seed_may_matter(states: Sequence[PassState]) -> bool:
    """Whether a build's warmup is worth recording for the pool seed: some sample tensor or
    parameter is a large-pool request (over 1 MiB). The seed is one large block the captures
    split, so it can only change where large blocks go; a stack of small layers (every input
    and weight in the small pool, a launch-bound build) would pay the recording -- a third of
    its capture time, measured on 32 Linear(256) layers -- for a seed of 0. A small-input
    callable whose intermediates alone are large plans without a seed (as before the seed)."""
    for st in states:
        for t in (*st.flat_args, *st.params):
            if isinstance(t, Tensor) and t.numel() * t.element_size() > SMALL_REQUEST:
                return True
    return False


class WarmupSizes(Hooks):
    """Sizes of each pass's outputs and grads, from its first warmup forward and backward.

    ``outputs[p][k]``: (storage bytes, dense bytes) of output k -- the static output's storage,
    and what ``empty_like`` of it (a grad-output buffer) takes. ``grads[p][j]``: storage bytes
    of the grad at static-surface index j (user inputs first, then parameters)."""

    def __init__(self) -> None:
        self.outputs: dict[int, list[tuple[int, int]]] = {}
        self.grads: dict[int, dict[int, int]] = {}

    def forward(self, i: int, st: PassState) -> None:
        if st.index in self.outputs or st.warm_outputs is None:
            return
        self.outputs[st.index] = [(_nbytes(o), o.numel() * o.element_size()) for o in st.warm_outputs]

    def backward(self, i: int, st: PassState, incoming: Sequence[Any], grads: Sequence[tuple[Any, Any]]) -> None:
        if st.index in self.grads:
            return
        index = {id(t): j for j, t in enumerate(st.surface)}
        self.grads[st.index] = {index[id(t)]: _nbytes(g) for t, g in grads if isinstance(g, Tensor) and id(t) in index}


def _nbytes(t: Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _addr(t: Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


class AllocationTrace(WarmupSizes):
    """:class:`WarmupSizes`, and the allocator's events per warmup op (a context manager that
    records ``torch.cuda.memory`` history while open, unless the caller already records it)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.marks: list[int] = []
        self.out_addrs: list[tuple[int, int, int, int]] = []  # (op, pass, output, address)
        self.grad_addrs: list[tuple[int, int, int, int]] = []  # (op, pass, surface index, address)
        self.incoming: dict[int, set[int]] = {}  # op -> addresses of the incoming grads it made
        self.entries: list[dict[str, Any]] = []
        self.ops: tuple[Op, ...] = ()  # the warmup program recorded (as a hook)
        self._base = 0

    def __enter__(self) -> AllocationTrace:
        torch.cuda.synchronize(self.device)
        torch.cuda.memory._record_memory_history(
            "all", context=None, stacks="python", device=self.device, clear_history=True, skip_actions=_SKIP
        )
        self._base = len(self._device_entries())
        HELD.position, HELD.spans = self._position, []
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.entries = self._device_entries()[self._base :]
            self.marks = [m - self._base for m in self.marks]
            for start, end in HELD.spans:  # the engine's holds: allocations no kernel writes
                for e in self.entries[max(start - self._base, 0) : max(end - self._base, 0)]:
                    e["held"] = True
        finally:
            HELD.position, HELD.spans = None, []
            torch.cuda.memory._record_memory_history(None, device=self.device)

    def _position(self) -> int:
        return len(self._device_entries())

    @contextlib.contextmanager
    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> Iterator[None]:
        """Records while the warmup program runs."""
        if kind is not ProgramKind.WARMUP:
            yield
            return
        self.ops = tuple(ops)
        with self:
            yield

    def _device_entries(self) -> list[dict[str, Any]]:
        traces = torch.cuda.memory._snapshot(self.device)["device_traces"]
        index = self.device.index or 0
        return list(traces[index]) if index < len(traces) else []

    def op(self, i: int) -> None:
        self.marks.append(len(self._device_entries()))

    @property
    def complete(self) -> bool:
        """Whether ``marks`` cut ``entries`` where the ops began (always, read from snapshots)."""
        return True

    def forward(self, i: int, st: PassState) -> None:
        if st.index not in self.outputs and st.warm_outputs is not None:
            self.out_addrs += [(i, st.index, k, _addr(o)) for k, o in enumerate(st.warm_outputs)]
        super().forward(i, st)

    def backward(self, i: int, st: PassState, incoming: Sequence[Any], grads: Sequence[tuple[Any, Any]]) -> None:
        self.incoming.setdefault(i, set()).update(_addr(g) for g in incoming if isinstance(g, Tensor))
        if st.index not in self.grads:
            index = {id(t): j for j, t in enumerate(st.surface)}
            self.grad_addrs += [
                (i, st.index, index[id(t)], _addr(g)) for t, g in grads if isinstance(g, Tensor) and id(t) in index
            ]
        super().backward(i, st, incoming, grads)

    def text(self, ops: Sequence[Op]) -> Trace:
        """The core's trace of the recorded warmup (``ops``: the warmup program it ran)."""
        return trace_text(ops, self.entries, self.marks, self.incoming, self.out_addrs, self.grad_addrs)


class CountedTrace(AllocationTrace):
    """:class:`AllocationTrace` for a build's warmup, marking ops by the allocator's event
    counters instead of a history snapshot per op (which costs the length of the history each
    time: quadratic over a pipeline's warmup), and only where the core reads them: the captures
    replay what each (kind, pass) allocated the first time (``first_ops``), so the history stops
    after the last first op, and a repeated op's events join the next repeated op's span (the
    core ignores both). The history holds one ``alloc`` per allocation and one ``free_completed``
    per free; a free the allocator defers past a mark (a tensor used on another stream) breaks
    that count, and :attr:`complete` says so -- the trace is then not the warmup's, and a build
    plans without it."""

    def __init__(self, device: torch.device, ops: Sequence[Op] | None = None) -> None:
        super().__init__(device)
        self.exact: set[int] | None = None  # every op's mark is exact without a program
        self.until: int | None = None
        if ops is not None:
            self.exact, self.until = first_ops(ops)
        self._count0 = (0, 0)
        self._counted = (-1, -1)
        self._recording = False

    def __enter__(self) -> CountedTrace:
        super().__enter__()
        self._count0, self._recording = self._events(), True
        return self

    def _events(self) -> tuple[int, int]:
        counts = _torch.memory_stats(self.device.index or 0)["allocation"]["all"]
        return int(counts["allocated"]), int(counts["freed"])

    def op(self, i: int) -> None:
        if not self._recording:
            return
        if self.exact is not None and i not in self.exact and self.marks:
            self.marks.append(self.marks[-1])
            return
        allocs, frees = self._events()
        self.marks.append(self._base + allocs - self._count0[0] + frees - self._count0[1])
        if self.until is not None and i >= self.until:
            self._stop()

    def _stop(self) -> None:
        allocs, frees = self._events()
        self._counted, self._recording = (allocs - self._count0[0], frees - self._count0[1]), False
        super().__exit__()

    def __exit__(self, *exc: object) -> None:
        if self._recording:
            self._stop()

    @property
    def complete(self) -> bool:
        actions = [e.get("action") for e in self.entries]
        return (actions.count("alloc"), actions.count("free_completed")) == self._counted


def first_ops(ops: Sequence[Op]) -> tuple[set[int], int]:
    """Where a warmup program's marks must be exact -- at each first (kind, pass) op and right
    after it -- and the op after the last first one (where the recording may stop)."""
    first: dict[tuple[str, int], int] = {}
    for i, op in enumerate(ops):
        first.setdefault((op.kind, op.pass_index), i)
    firsts = sorted(first.values())
    last = firsts[-1] + 1 if firsts else 0
    return {j for i in firsts for j in (i, i + 1)}, last


def op_spans(
    entries: Sequence[dict[str, Any]], marks: Sequence[int], n_ops: int
) -> Iterator[tuple[int, Sequence[dict[str, Any]]]]:
    """The history ``entries`` cut at ``marks`` (``marks[i]``: where op i began, ``marks[n_ops]``
    the end): (op index, its entries), with -1 for what came before the first op or after the last."""
    bounds = [0, *marks, len(entries)]
    for span in range(len(bounds) - 1):
        yield (span - 1 if 0 < span <= n_ops else -1), entries[bounds[span] : bounds[span + 1]]


def trace_text(
    ops: Sequence[Op],
    entries: Sequence[dict[str, Any]],
    marks: Sequence[int],
    incoming: dict[int, set[int]],
    out_addrs: Sequence[tuple[int, int, int, int]],
    grad_addrs: Sequence[tuple[int, int, int, int]],
) -> Trace:
    """Writes allocator history ``entries`` (dicts with ``action``, ``addr``, ``size``) as the
    core's trace: ``marks[i]`` is the entry index at which op i began (``marks[len(ops)]`` the
    end); allocations of the incoming grads an op made, and those never freed, are between ops
    (the real build allocates grad-output buffers outside the pool, and finds caches made);
    output and grad addresses name the block live at their op's end."""
    lines: list[Any] = [f"step {i} {op.kind.value} {op.pass_index}" for i, op in enumerate(ops)]
    named: dict[int, list[tuple[str, int, int, int]]] = {}  # op -> what names a block at its end
    for kind, addrs in (("out", out_addrs), ("grad", grad_addrs)):
        for o, p, k, a in addrs:
            named.setdefault(o, []).append((kind, p, k, a))
    live: dict[int, int] = {}
    allocs: dict[int, list[Any]] = {}
    for i, span in op_spans(entries, marks, len(ops)):
        for e in span:
            action, addr = e.get("action"), int(e.get("addr", 0))
            if action == "alloc":
                bid = len(allocs) + 1
                live[addr] = bid
                step = -1 if i < 0 or addr in incoming.get(i, ()) else i
                allocs[bid] = ["a", bid, int(e.get("size", 0)), step]
                lines.append(allocs[bid])
            elif action == "free_completed" and addr in live:
                lines.append(f"r {live.pop(addr)} {i}")
        if i >= 0:
            lines += [f"{kind} {p} {k} {live[a]}" for (kind, p, k, a) in named.get(i, ()) if a in live]
    # What warmup allocated and never freed is a cache made on first use (cuBLAS workspaces of
    # gograph's side stream, ...): it adds to the warmup's peak, and a capture finds it made.
    for bid in live.values():
        allocs[bid][3] = -1
    return Trace(tuple(" ".join(map(str, ln)) if isinstance(ln, list) else ln for ln in lines))


@dataclass
class Probe:
    """What a build run until planned learned (:func:`gograph.plan_memory`): the passes (with
    what warmup set on them), the capture program, whether pool buffers are released, the
    sizes, and on CUDA the trace (None elsewhere, or when the caller records allocator history
    already)."""

    states: list[PassState]
    program: CaptureProgram
    release: bool
    sizes: WarmupSizes
    trace: Trace | None


def sizes_recorder(engine: Engine) -> WarmupSizes:
    """The hook ``plan_memory`` records its warmup with: an allocation trace on the CUDA engine,
    unless the process records allocator history already (its ring buffer and settings are the
    caller's: then sizes only)."""
    if not isinstance(engine, CudaEngine):
        return WarmupSizes()
    if _torch.allocator_history_enabled():
        log.warning(
            "plan_memory: torch.cuda.memory history is already being recorded; the pool "
            "predictions need their own recording and are left out (stop recording to get them)"
        )
        return WarmupSizes()
    return AllocationTrace(engine.device)


_R = TypeVar("_R", bound=AllocationTrace)


class RecordingHooks(Hooks, Generic[_R]):
    """Build hooks that watch a program through a recorder, set while the program they record
    runs (:meth:`_recording`): per-op events go to it, and to nothing otherwise."""

    def __init__(self) -> None:
        self.recorder: _R | None = None

    @contextlib.contextmanager
    def _recording(self, rec: _R) -> Iterator[_R]:
        with rec:
            self.recorder = rec
            try:
                yield rec
            finally:
                self.recorder = None

    @property
    def watching(self) -> bool:
        """Whether it records the program underway."""
        return self.recorder is not None

    def op(self, i: int) -> None:
        if self.recorder is not None:
            self.recorder.op(i)


class SeedTrace(RecordingHooks["CountedTrace"]):
    """The pool seed of a build (CUDA, its own pool): records its warmup outside the pool as the
    core's trace (:class:`CountedTrace`: the ops up to the last first one, which the captures
    replay), and once the captures are planned asks the core for the seed, which the build carves
    before its first capture. Nothing is recorded when warmup runs in the pool, when the process
    records allocator history already (its buffer and settings are the caller's), or when every
    sample and parameter is a small-pool request (:func:`seed_may_matter`)."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: Trace | None = None

    @contextlib.contextmanager
    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> Iterator[None]:
        device = build.device
        if (
            kind is not ProgramKind.WARMUP
            or device is None
            or build.warm_pool is not None
            or build.req.pool is not None
            or _torch.allocator_history_enabled()
            or not seed_may_matter(build.states)
        ):
            yield
            return
        with self._recording(CountedTrace(device, ops)) as rec:
            yield
        if rec.complete:
            self.trace = rec.text(ops[: rec.until])
        else:
            log.debug("a free deferred past a warmup op; planning without the pool seed")

    def forward(self, i: int, st: PassState) -> None:
        if self.recorder is not None:
            self.recorder.forward(i, st)

    def backward(self, i: int, st: PassState, incoming: Sequence[Any], grads: Sequence[tuple[Any, Any]]) -> None:
        if self.recorder is not None:
            self.recorder.backward(i, st, incoming, grads)

    def planned(self, build: Executor, program: CaptureProgram) -> None:
        if self.trace is not None:  # the core models the captures it planned over what warmup allocated
            build.seed = _plan.predict(build.schedule, self.trace).seed
