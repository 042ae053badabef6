"""``gograph.plan_memory``: the memory of graphing, known before anything is captured.

Takes exactly :func:`gograph.make_graphed_callables`'s arguments and runs one eager warmup
iteration per pass (whatever ``num_warmup_iters`` says) to learn what each pass's outputs and
grads take; the Go core plans the captures as the real call would (same schedule, same
``chain_buffers`` / ``_reuse_graph_input_output_buffers`` decisions, same release points) and,
on CUDA, replays the allocations the warmup made through its model of PyTorch's caching
allocator in the capture program's order::

    plan = gograph.plan_memory(layers, samples, chain_buffers=True)
    print(plan)                       # the table
    plan.totals.pool_reserved_bytes   # what the graph pool will reserve
    plan.to_dict(); plan.to_json()

Per pass it gives what :func:`gograph.memory_report` will show after the real call (same field
names): static input, output, grad-output and grad-input bytes, the pool-planned part. On CUDA it
predicts the graph pool's reserved bytes (its segments), the most its blocks hold at once, the
warmup's own peak, the peak during ``make_graphed_callables`` and what the graphs hold through a
training step. It leaves no trace: no pass, graph or plan stays, the generator state and module
buffers are as before, ``.grad`` is untouched, and what warmup allocated is freed.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .build._build import Build, prepared
from .build._exec import Phase
from .build._warmup import module_buffers_restored
from .core import _core, _plan
from .core._wire import Prediction, Trace
from .graphs import _refuse_nested_build
from .probes import _probe, _static_bytes
from .request import _args, _te
from .runtime._observe import fmt_bytes, json_text
from .runtime.engines import CudaEngine
from .support import _torch

if sys.version_info >= (3, 11):  # pragma: no cover - version dependent
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Hashable, Mapping, Sequence

    from .request._args import GraphOptions

__all__ = ["MemoryPlan", "PassPlan", "PlanTotals", "plan_memory"]


@dataclass
class PassPlan:
    """One pass as the real call will build it (the fields of :class:`gograph.PassMemory`)."""

    index: int
    label: str
    static_input_bytes: int
    output_bytes: int
    grad_output_bytes: int
    grad_input_bytes: int
    """Grads of the inputs and parameters that require grad."""
    param_grad_bytes: int
    pool_planned_bytes: int
    """Static buffers handed back to the graph pool once dead (included above)."""
    chained_slots: list[str]
    lent_param_grads: int

    @property
    def static_bytes(self) -> int:
        return self.static_input_bytes + self.output_bytes + self.grad_output_bytes + self.grad_input_bytes


@dataclass
class PlanTotals:
    """Sums (each storage once) and the predictions; the pool predictions are None on the eager
    engine (no device pool) and when torch's allocator history is already being recorded."""

    passes: int
    static_bytes: int
    pool_planned_bytes: int
    new_buffer_bytes: int
    """What the build allocates outside the pool: grad-output buffers that are not another
    pass's buffer, and clones of samples that share memory with another input leaf or a
    parameter (other sample args are the caller's)."""
    pool_reserved_bytes: int | None
    """The graph pool's segments after every capture (``memory_report``'s pool reserved)."""
    pool_peak_allocated_bytes: int | None
    pool_live_bytes: int | None
    """What the pool's blocks hold once built: static outputs, grads, what graphs keep."""
    pool_segments: int | None
    pool_seed_bytes: int | None
    """The segment the build carves in its own pool before the first capture (0: none makes the
    modelled pool smaller): the captures split their blocks out of it, so freed neighbours merge."""
    warmup_peak_reserved_bytes: int | None
    """What one warmup iteration reserves from nothing (cached free blocks may serve part)."""
    outside_pool_bytes: int | None
    """The segments beside the pool through the captures: what warmup makes on first use and the
    process keeps (the captures' stream's cuBLAS workspaces, one per handle: the forward's thread
    and autograd's; none when they exist already) and the new buffers (an 8 MiB buffer takes a
    20 MiB segment)."""
    build_peak_bytes: int | None
    """The most ``make_graphed_callables`` adds to reserved memory: warmup, or the pool and the
    segments beside it."""
    step_graph_bytes: int | None
    """What the graphs hold through a training step (pool + new buffers); a step's peak is this
    plus what the caller's own code allocates (batch, loss, optimizer, ``.grad``)."""


@dataclass
class MemoryPlan:
    """See the module docstring; ``str(plan)`` is a table, ``to_dict``/``to_json`` serialize.
    ``pool_after_ops``: (capture op, pool reserved, pool allocated) after each op."""

    engine: str
    passes: list[PassPlan]
    totals: PlanTotals
    pool_after_ops: list[tuple[str, int, int]] = field(default_factory=list)
    pool_segment_bytes: list[int] = field(default_factory=list)
    """The predicted pool's segment sizes, in the order the model allocated them."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for p, pd in zip(self.passes, d["passes"]):
            pd["static_bytes"] = p.static_bytes
        return d

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), **kwargs)`` (``indent=2`` unless given)."""
        return json_text(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return _format(self)


def plan_memory(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Hashable | None = None,
    **options: Unpack[GraphOptions],
) -> MemoryPlan:
    """Predicts what :func:`gograph.make_graphed_callables` with the same arguments will hold,
    without capturing (see the module docstring). Raises what ``make_graphed_callables`` raises
    for the same bad arguments, and what a callable raises in its warmup (nothing is left then).
    With ``pool=`` shared with earlier builds the pool predictions are for a new pool (an upper
    bound: the shared pool's free blocks may serve part)."""
    _refuse_nested_build()
    with _te.graph_capturing():  # the warmup as the build runs it
        req = _args.normalize(callables, sample_args, num_warmup_iters, allow_unused_input, pool, options)
        if req.share:
            raise ValueError(
                "gograph.plan_memory: share_microbatch_graphs is not modelled (its shared graphs capture in pools "
                "of their own); plan without it, or measure the build (gograph.memory_report)"
            )
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
        # held by nothing here once planned, as in make_graphed_callables: the planned request
        # replaces it (a buffer-reuse build frees the samples only the first one listed)
        one_warmup = [dataclasses.replace(req, num_warmup_iters=1, progress=False)]
        del req
        with prepared(one_warmup.pop()) as build:
            found, prediction = _planned(build)
    engine = build.engine
    if isinstance(engine, CudaEngine):
        _leave_allocator_as_found(engine, allocated)
    return _assemble(engine.name, found, prediction)


def _planned(build: Build) -> tuple[_probe.Probe, Prediction | None]:
    """Runs ``build`` until its captures are planned (one warmup iteration, recorded), asks the
    core what the planned captures will take, and rolls the build back: passes dropped,
    generator state and module buffers restored. Captures nothing."""
    sizes = _probe.sizes_recorder(build.engine)
    try:
        with module_buffers_restored(build.req.callables):
            program = build.run(until=Phase.PLANNED, hooks=[sizes])
            release = isinstance(build.engine, CudaEngine)
            trace = sizes.text(sizes.ops) if isinstance(sizes, _probe.AllocationTrace) else None
            found = _probe.Probe(list(build.states), program, release, sizes, trace)
            if trace is None:
                return found, None
            # the buffers outside the pool share its segments with warmup's caches; a build that
            # would not record its warmup carves no seed: nor does its plan
            more = [f"new {n}" for n in _static_bytes.new_sizes(_static_bytes.count(found))]
            if not _probe.seed_may_matter(build.states):
                more.append("noseed")
            return found, _plan.predict(build.schedule, trace.with_lines(more))
    finally:
        build.rollback()


def _leave_allocator_as_found(engine: CudaEngine, allocated: int) -> None:
    """Warmup's first matmuls on gograph's side stream made cuBLAS workspaces (torch caches one
    per handle and stream): a build keeps them for its captures; a plan gives them back when no
    CUDA graph can be using a workspace (torch clears every stream's at once). What the warmup
    cached goes back to the device, as a build's first capture does."""
    engine.synchronize()
    _torch.empty_cache()  # first, so pools no graph holds any more give their segments back
    grown = torch.cuda.memory_allocated(engine.device) > allocated
    if grown and _workspaces_unused_by_graphs(int(_core.live_graphs()), torch.cuda.memory_snapshot()):
        _torch.clear_cublas_workspaces()
        _torch.empty_cache()


def _workspaces_unused_by_graphs(live_graphs: int, segments: Sequence[Mapping[str, Any]]) -> bool:
    """Whether freeing the cuBLAS workspaces is safe: a captured GEMM keeps its workspace's
    address, and a freed workspace's memory goes to the next tensor allocated, which that graph's
    replay would then overwrite. Safe when the core holds no graph and no allocator segment
    belongs to a private pool (torch's graphs, gograph's and its RNG companions, and
    ``torch.cuda.MemPool`` allocate in one). A graph that allocated nothing is not seen."""
    return live_graphs == 0 and all(tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) for seg in segments)


def _assemble(engine: str, found: _probe.Probe, prediction: Prediction | None) -> MemoryPlan:
    pred = prediction if prediction is not None and prediction.pool else None
    counted = _static_bytes.count(found, _places(found.trace, pred.places if pred is not None else {}))
    passes = [
        PassPlan(
            index=st.index,
            label=st.spec.label,
            static_input_bytes=pb.total("input"),
            output_bytes=pb.total("output"),
            grad_output_bytes=pb.total("grad_output"),
            grad_input_bytes=pb.total("grad_input"),
            param_grad_bytes=sum(pb.param_grads.values()),
            pool_planned_bytes=sum(pb.planned.values()),
            chained_slots=pb.chained,
            lent_param_grads=pb.lent,
        )
        for st, pb in zip(found.states, counted)
    ]
    new = _static_bytes.distinct(counted, "new")
    pool: tuple[int | None, ...] = pred.pool if pred is not None else (None,) * 4
    warmup: tuple[int | None, ...] = pred.warmup if pred is not None else (None,) * 3
    totals = PlanTotals(
        passes=len(passes),
        static_bytes=_static_bytes.distinct(counted),
        pool_planned_bytes=_static_bytes.distinct(counted, "planned"),
        new_buffer_bytes=new,
        pool_reserved_bytes=pool[0],
        pool_peak_allocated_bytes=pool[1],
        pool_live_bytes=pool[2],
        pool_segments=pool[3],
        pool_seed_bytes=pred.seed if pred is not None else None,
        warmup_peak_reserved_bytes=warmup[0],
        outside_pool_bytes=warmup[2],
        build_peak_bytes=None if pred is None else build_peak(pred),
        step_graph_bytes=None if pred is None else pred.pool[0] + new,
    )
    return MemoryPlan(
        engine=engine,
        passes=passes,
        totals=totals,
        pool_after_ops=list(pred.ops) if pred is not None else [],
        pool_segment_bytes=list(pred.segments) if pred is not None else [],
    )


def build_peak(pred: Prediction) -> int:
    """The most a build adds to reserved memory: warmup's own high-water, or -- once its cache is
    emptied for the first capture -- the pool and the segments beside it (what warmup kept, such
    as cuBLAS workspaces, and the new buffers)."""
    return max(pred.warmup[0], pred.warmup[2] + pred.pool[0])


def _places(trace: Trace | None, places: dict[int, tuple[int, int]]) -> dict[tuple[str, int, int], tuple[int, int]]:
    """Where the core's model put each output ("out", pass, k) and grad ("grad", pass, j): buffers
    at one place are one storage (a released buffer's memory re-carved for a later one)."""
    out: dict[tuple[str, int, int], tuple[int, int]] = {}
    for line in trace.lines if trace is not None else ():
        f = line.split()
        if f and f[0] in ("out", "grad") and int(f[3]) in places:
            out[(f[0], int(f[1]), int(f[2]))] = places[int(f[3])]
    return out


_HEADER = ["#", "label", "inputs", "outputs", "grad out", "grad in", "pool-planned", "chained"]


def _format(plan: MemoryPlan) -> str:
    t = plan.totals
    rows = [
        [str(p.index), p.label, fmt_bytes(p.static_input_bytes), fmt_bytes(p.output_bytes),
         fmt_bytes(p.grad_output_bytes), fmt_bytes(p.grad_input_bytes), fmt_bytes(p.pool_planned_bytes),
         ",".join(p.chained_slots) or "-"]
        for p in plan.passes
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [_HEADER, *rows]) for i in range(len(_HEADER))]
    table = ["  ".join(c.ljust(w) if i in (1, 7) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [_HEADER, ["-" * w for w in widths], *rows]]  # fmt: skip
    out = [f"gograph memory plan: {t.passes} pass(es), engine {plan.engine} (nothing captured)", *table]
    out.append(
        f"static buffers: {fmt_bytes(t.static_bytes)}, {fmt_bytes(t.pool_planned_bytes)} of it pool-planned; "
        f"new buffers outside the pool: {fmt_bytes(t.new_buffer_bytes)}"
    )
    if t.pool_reserved_bytes is None:
        out.append("pool: not predicted (" + ("eager engine: no device pool" if plan.engine == "eager"
                   else "allocator history was already being recorded") + ")")  # fmt: skip
        return "\n".join(out)
    out += [
        f"graph pool: {fmt_bytes(t.pool_reserved_bytes)} reserved in {t.pool_segments} segment(s), at most "
        f"{fmt_bytes(t.pool_peak_allocated_bytes)} allocated, {fmt_bytes(t.pool_live_bytes)} live once built",
        f"warmup: {fmt_bytes(t.warmup_peak_reserved_bytes)} reserved; beside the pool "
        f"{fmt_bytes(t.outside_pool_bytes)} (cuBLAS workspaces, new buffers); make_graphed_callables adds at most "
        f"{fmt_bytes(t.build_peak_bytes)}; the graphs hold {fmt_bytes(t.step_graph_bytes)} through a training step "
        "(plus the caller's batch, loss, optimizer and .grad)",
    ]
    return "\n".join(out)
