"""What each graph writes and reads in its pool, for the core's shared-pool checker (debug mode
on CUDA; ``internal/recarve``).

While the captures run, the caching allocator's history is recorded per capture op and every
forward's saved tensors are noted (``saved_tensors_hooks`` that return the tensor itself). A
graph writes every block its capture allocated; it reads the blocks, live when its capture
began, that hold what it was captured reading: a forward its chained inputs (the previous
layer's output, which a replay never copies in), a backward (and a weight-gradient pass) the
tensors its forward saved, a weight-gradient pass also the incoming grads its backward
stashed. Each read names the graph whose capture allocated that block, its producer. Copies
into static buffers happen outside the graphs and are not tracked. A graph also hands the
caller its pool-planned buffers (a released output, a released input grad): the core says which
replays overwrite them (``_handouts``). The core then checks every replay against those sets
instead of the capture order. Nothing here decides.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..build._exec import Executor, ProgramKind
from ..build._state import PassState
from ..core import _core
from ..core._wire import Op
from ..replay._handouts import WATCH
from ..runtime._poolmodel import PoolModel
from ..runtime.engines import CudaEngine, EagerEngine
from ..support import _torch
from ._probe import AllocationTrace, RecordingHooks, op_spans

__all__ = ["CaptureRecorder", "DebugRecorder", "send", "specs"]

log = logging.getLogger("gograph")

Graph = tuple[int, int]  # (pass id, kind)
Spec = dict[str, Any]  # name, writes [(start, end)], reads [(start, end, producer, what)], handouts
#                        [(start, end, index, what)]


class CaptureRecorder(AllocationTrace):
    """The allocation trace of the capture ops, and the storages each forward saved."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.saved: dict[int, list[tuple[int, int]]] = {}  # pass index -> (address, bytes)

    @contextlib.contextmanager
    def saving(self, st: PassState) -> Iterator[None]:
        """Notes the storages the forward captured inside saves for its backward."""
        noted = self.saved.setdefault(st.index, [])

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            noted.append((int(s.data_ptr()), int(s.nbytes())))
            # Detached: the op's own output returned as itself would hold its grad_fn, a
            # reference cycle through autograd's C++ nodes that no collector frees (and that
            # would keep pool blocks the plan hands back).
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


class DebugRecorder(RecordingHooks[CaptureRecorder]):
    """The build hook of debug mode on CUDA: records the captures (:class:`CaptureRecorder`) and,
    once the passes are sealed and guarded, hands the core every graph's spec. Records nothing
    without debug mode, on the eager engine, or when the process records allocator history
    already (then the capture-order guard checks the replays)."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded: CaptureRecorder | None = None
        self.modelled: PoolModel | None = None  # the eager engine's pool model, in debug mode

    @contextlib.contextmanager
    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> Iterator[None]:
        engine = build.engine
        if kind is ProgramKind.CAPTURE and build.debug and isinstance(engine, EagerEngine):
            self.modelled = engine.pool_model  # its blocks are the model's: nothing to record
            yield
            return
        if kind is not ProgramKind.CAPTURE or not build.debug or not isinstance(engine, CudaEngine):
            yield
            return
        if _torch.allocator_history_enabled():
            log.info("allocator history is already recorded; debug replays are checked in capture order")
            yield
            return
        with self._recording(CaptureRecorder(engine.device)) as rec:
            yield
        self.recorded = rec

    def capturing_forward(self, st: PassState) -> contextlib.AbstractContextManager[Any]:
        return self.recorder.saving(st) if self.recorder is not None else contextlib.nullcontext()

    def finished(self, build: Executor, failed: bool) -> None:
        rec, self.recorded = self.recorded, None
        model, self.modelled = self.modelled, None
        if rec is not None and not failed and build.program is not None:
            send(specs(rec, build.program.ops, build.states))
        elif model is not None and not failed:
            send(model_specs(model, build.states))


def specs(rec: CaptureRecorder, ops: Sequence[Op], states: Sequence[PassState]) -> dict[Graph, Spec]:
    """Per captured graph, what it writes and reads (see the module docstring)."""
    out: dict[Graph, Spec] = {}
    live: dict[int, tuple[int, Graph]] = {}  # block address -> (size, the graph whose capture allocated it)
    # per pass, the blocks its forward saved as they were when the forward was captured: a backward
    # frees what autograd saved, and a later allocation at that address is another block
    saved: dict[int, dict[int, tuple[int, Graph]]] = {}
    for i, span in op_spans(rec.entries, rec.marks, len(ops)):
        g: Graph | None = None
        kind = ops[i].kind.graph if i >= 0 else None  # type: ignore[union-attr]
        st = states[ops[i].pass_index] if kind is not None else None
        if kind is not None and st is not None and st.seq[kind]:  # (0: not captured, as a backward no output needs)
            g = (st.pass_id, int(kind))
            out[g] = {"name": f'pass {st.pass_id} ("{st.spec.label}") {kind.noun}', "writes": [],
                      "reads": _reads(rec, st, g[1], live, saved.get(st.index, {})), "handouts": []}  # fmt: skip
        for e in span:
            action, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
            if action == "alloc" and g is not None:
                live[addr] = (size, g)
                if not e.get("held"):  # a block held from an allocation: no kernel writes it
                    out[g]["writes"].append((addr, addr + max(size, 1)))
            elif action == "free_completed":
                live.pop(addr, None)
        if g is not None and st is not None and g[1] == 0:
            saved[st.index] = {a: live[a] for a, _ in rec.saved.get(st.index, []) if a in live}
    for st in states:  # what was released is known once every capture ran
        for g, handouts in _handouts(st):
            if g in out:
                out[g]["handouts"] = handouts
    return out


def _handouts(st: PassState, where: Callable[[torch.Tensor], tuple[int, int] | None] | None = None) -> list[Any]:
    """The pool-planned buffers the pass's forward and backward hand the caller; ``where`` says
    where a buffer lies (default: its storage's device addresses)."""
    locate = where if where is not None else _span
    outs, grads = [], []
    for role, i in sorted(st.released):
        if role == "o" and i < len(st.static_outputs):
            r = locate(st.static_outputs[i])
            if r is not None:
                outs.append((r[0], r[1], i, f"output {i}"))
        elif role == "d" and i < len(st.static_grad_inputs) and (grad := st.static_grad_inputs[i]) is not None:
            r = locate(grad)
            if r is not None:
                grads.append((r[0], r[1], i, f"the grad of input {i}"))
    return [((st.pass_id, 0), outs), ((st.pass_id, 1), grads)]


def _span(t: torch.Tensor) -> tuple[int, int]:
    a, n = _storage(t)
    return a, a + max(n, 1)


def _reads(
    rec: CaptureRecorder,
    st: PassState,
    kind: int,
    live: dict[int, tuple[int, Graph]],
    saved: dict[int, tuple[int, Graph]],
) -> list[Any]:
    """The pool blocks, live now, that the graph about to be captured reads, with their producers.
    What the forward saved counts while its block lives (``saved``: the blocks as the forward left
    them): the backward frees autograd's saved tensors, so a weight-gradient graph reads only
    those its work kept."""
    wanted: list[tuple[int, int, str]] = []
    if kind == 0:
        wanted += [(*_storage(st.flat_args[j]), f"its chained input {j}") for j in sorted(st.chained_inputs)]
    else:  # (a chained grad output is no read: a replay copies the incoming grad in unless it is that buffer)
        wanted += [
            (a, n, f"what pass {st.pass_id}'s forward saved")
            for a, n in rec.saved.get(st.index, [])
            if a not in live or live[a] is saved.get(a)
        ]
    if kind == 2:  # the weight-gradient work its backward stashed: the incoming grads it was given
        wanted += [  # (a chained one is copied in by its own backward when its producer did not run)
            (*_storage(g), f"the incoming grad of output {k} (its backward's)")
            for k, g in enumerate(st.static_grad_outputs)
            if g is not None and k not in st.chained_grad_outputs
        ]
    reads, seen = [], set()
    for addr, nbytes, what in wanted:
        if addr in live and addr not in seen:
            seen.add(addr)
            reads.append((addr, addr + max(nbytes, 1), live[addr][1], what))
    return reads


def model_specs(model: PoolModel, states: Sequence[PassState]) -> dict[Graph, Spec]:
    """Per captured graph, what it writes and reads in the eager engine's model of its pool: the
    same specs :func:`specs` reads from CUDA's allocator, in model addresses."""
    out: dict[Graph, Spec] = {}
    for st in states:
        for kind, noun in ((0, "forward"), (1, "backward"), (2, "weight gradient")):
            g = (st.pass_id, kind)
            if not st.seq[kind] or g in out:
                continue
            out[g] = {
                "name": f'pass {st.pass_id} ("{st.spec.label}") {noun}',
                "writes": [b.range for b in model.writes.get(g, ())],
                "reads": _model_reads(model, st, kind),
                "handouts": [],
            }
    for st in states:
        for g, handouts in _handouts(st, model.range_of):
            if g in out:
                out[g]["handouts"] = handouts
    return out


def _model_reads(model: PoolModel, st: PassState, kind: int) -> list[Any]:
    """The modelled blocks a graph reads that another capture produced (see :func:`_reads`)."""
    reads: list[Any] = []
    if kind == 0:
        for j in sorted(st.chained_inputs):
            b = model.block(st.flat_args[j])
            if b is not None and b.graph is not None:
                reads.append((*b.range, b.graph, f"its chained input {j}"))
        return reads
    for b in model.saved_blocks(st.pass_id, (st.pass_id, kind)):
        if b.graph is not None:
            reads.append((*b.range, b.graph, f"what pass {st.pass_id}'s forward saved"))
    if kind == 2:  # (a chained incoming grad is copied in by its own backward when its producer did not run)
        for k, t in enumerate(st.static_grad_outputs):
            b = model.block(t) if t is not None and k not in st.chained_grad_outputs else None
            if b is not None and b.graph is not None:
                reads.append((*b.range, b.graph, f"the incoming grad of output {k} (its backward's)"))
    return reads


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return int(s.data_ptr()), int(s.nbytes())


def send(graph_specs: dict[Graph, Spec]) -> None:
    """Hands every graph's spec to the core (its guard must be on)."""
    for (pass_id, kind), s in graph_specs.items():
        lines = [f"name {s['name']}"]
        lines += [f"w {a} {b}" for a, b in s["writes"]]
        lines += [f"r {a} {b} {p[0]} {p[1]} {what}" for a, b, p, what in s["reads"]]
        lines += [f"h {a} {b} {i} {what}" for a, b, i, what in s.get("handouts", ())]
        _core.set_replay_recarve_spec(pass_id, kind, "\n".join(lines) + "\n")
        WATCH.register((pass_id, kind), [i for _, _, i, _ in s.get("handouts", ())])
