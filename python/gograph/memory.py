"""``gograph.memory_report``: what graphed callables hold in memory, pass by pass.

A report is plain data (dataclasses) that prints as a table::

    report = gograph.memory_report(graphed)     # one graphed callable/module, or the tuple returned
    print(report)                               # the table
    report.to_dict(); report.to_json()          # for logs and dashboards

For each pass (one graphed callable's record in the Go core) it gives the bytes of its static
buffers -- inputs (the sample args the graphs read), outputs, grad-output and grad-input buffers
(the latter includes parameter grads) -- with parameters counted apart (they belong to the model,
not to the graphs); which of those storages are shared with other passes (same
``untyped_storage().data_ptr()``); its memory pool, with the pool's reserved and active bytes from
``torch.cuda.memory_snapshot()`` (segments whose ``segment_pool_id`` is the pool; none on the eager
engine, which allocates no pool); its graphs' node counts; each capture's sequence number in the
pool, time and memory delta; and, per ``make_graphed_callables`` call, the warmup peak.

Byte counts are storage sizes (``untyped_storage().nbytes()``), counted once per distinct storage
within a pass and category; totals count each storage once across all passes. The caching
allocator rounds blocks up to 512 bytes, so ``torch.cuda.memory_allocated()`` deltas agree with
these numbers up to that rounding.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import _core
from ._observe import KIND_NAMES, BuildStats, CaptureRecord, WarmupPeak, fmt_bytes

__all__ = [
    "BuildSummary",
    "MemoryReport",
    "PassMemory",
    "PoolMemory",
    "SharedSlot",
    "SharedStorage",
    "Totals",
    "memory_report",
]

#: Static-buffer categories of a pass, in table order; "param" is the model's own memory.
CATEGORIES = ("input", "param", "output", "grad_output", "grad_input")


@dataclass
class SharedSlot:
    """One of this pass's slots whose storage another pass's slot also uses."""

    slot: str
    """This pass's slot, e.g. ``"output[0]"``, ``"grad_input[weight]"``."""
    other_pass_id: int
    other_label: str
    other_slot: str
    nbytes: int


@dataclass
class PassMemory:
    """The memory of one pass (graphed callable)."""

    index: int
    """Position of the callable in its ``make_graphed_callables`` tuple."""
    label: str
    pass_id: int
    state: str
    """The core's lifecycle state: "building", "ready" or "reset" (a reset pass holds nothing)."""
    engine: str
    pool: str
    """The pool's key (as the core records captures: engine name and pool token)."""
    capture_seq: dict[str, int]
    """Capture sequence number in the pool by kind ("forward", "backward", "wgrad")."""
    static_input_bytes: int
    param_bytes: int
    output_bytes: int
    grad_output_bytes: int
    grad_input_bytes: int
    """Grad buffers of the inputs *and parameters* that require grad."""
    param_grad_bytes: int
    """The parameter part of ``grad_input_bytes``."""
    graph_nodes: dict[str, int | None]
    """Node count of each captured graph by kind; None on the eager engine or after reset."""
    replay_order_check: bool
    """Whether the core checks this pass's replays against the capture order."""
    captures: list[CaptureRecord] = field(default_factory=list)
    shared: list[SharedSlot] = field(default_factory=list)

    @property
    def static_bytes(self) -> int:
        """Inputs, outputs, grad outputs and grad inputs (parameters excluded)."""
        return self.static_input_bytes + self.output_bytes + self.grad_output_bytes + self.grad_input_bytes


@dataclass
class PoolMemory:
    """One memory pool and the passes whose graphs were captured in it."""

    pool: str
    engine: str
    pass_ids: list[int]
    reserved_bytes: int | None
    """Sum of the pool's segments (cudaMalloc'd); None on the eager engine."""
    active_bytes: int | None
    """Bytes of the pool's blocks in use (static outputs and grad inputs, ...); None on eager."""
    segments: int | None


@dataclass
class SharedStorage:
    """A storage used by slots of more than one pass (or twice by one pass)."""

    device: str
    data_ptr: int
    nbytes: int
    holders: list[str]
    """``"pass 5 (Linear) output[0]"`` for each slot using it."""


@dataclass
class BuildSummary:
    """One ``make_graphed_callables`` call."""

    build: int
    engine: str
    seconds: float
    captures: int
    warmup_seconds: float
    """Part of ``seconds`` spent in warmup (the captures' part is in the passes' records)."""
    warmup: WarmupPeak | None
    """Warmup memory peak (CUDA); None on the eager engine."""
    debug_replay_order: bool


@dataclass
class Totals:
    """Sums over the report; byte totals count each storage once."""

    passes: int
    graphs: int
    graph_nodes: int | None
    static_input_bytes: int
    param_bytes: int
    output_bytes: int
    grad_output_bytes: int
    grad_input_bytes: int
    static_bytes: int
    """Distinct storages of inputs, outputs, grad outputs and grad inputs (no parameters)."""
    shared_bytes: int
    """What sharing saves: the per-pass static bytes summed, minus ``static_bytes``."""
    pool_reserved_bytes: int | None
    pool_active_bytes: int | None
    capture_seconds: float


@dataclass
class MemoryReport:
    """See the module docstring. ``str(report)`` is a table; ``to_dict``/``to_json`` serialize."""

    passes: list[PassMemory]
    pools: list[PoolMemory]
    shared: list[SharedStorage]
    builds: list[BuildSummary]
    totals: Totals

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars (``static_bytes`` and ``delta_bytes`` included)."""
        d = asdict(self)
        for p, pd in zip(self.passes, d["passes"]):
            pd["static_bytes"] = p.static_bytes
        for b, bd in zip(self.builds, d["builds"]):
            if b.warmup is not None:
                bd["warmup"]["delta_bytes"] = b.warmup.delta_bytes
        return d

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), **kwargs)`` (``indent=2`` unless given)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return _format(self)


# ---------------------------------------------------------------------------------------------
# Building the report
# ---------------------------------------------------------------------------------------------
def _graphed_callables(obj: Any, seen: set[int]) -> Iterator[Any]:
    """The GraphedCallables in ``obj``: one, a module whose forward is one, an object holding
    several (``graphed_callables`` attribute), or any (nested) tuple/list of those."""
    from .graphed import GraphedCallable

    if isinstance(obj, GraphedCallable):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield obj
        return
    if isinstance(obj, torch.nn.Module):
        fwd = obj.__dict__.get("forward")
        if fwd is None:
            raise TypeError(
                f"gograph.memory_report: module {type(obj).__name__} is not graphed "
                "(its forward was not replaced by make_graphed_callables)"
            )
        yield from _graphed_callables(fwd, seen)
        return
    many = getattr(obj, "graphed_callables", None)
    if many is not None and not isinstance(obj, (tuple, list)):
        for g in many:
            yield from _graphed_callables(g, seen)
        return
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _graphed_callables(item, seen)
        return
    raise TypeError(
        f"gograph.memory_report: expected what make_graphed_callables returned (graphed modules "
        f"or callables, or a tuple of them), got {type(obj).__name__}"
    )


def _storage_key(t: Tensor) -> tuple[str, int, int]:
    s = t.untyped_storage()
    return (str(t.device), int(s.data_ptr()), int(s.nbytes()))


def _param_names(g: Any) -> list[str]:
    module = g.module
    params = list(g.module_params)
    if module is not None:
        named = list(module.named_parameters())
        if len(named) == len(params) and all(p is q for (_, p), q in zip(named, params)):
            return [n for n, _ in named]
    return [str(i) for i in range(len(params))]


def _slots(g: Any) -> Iterator[tuple[str, str, Tensor, bool]]:
    """(category, slot name, tensor, is a parameter's grad) for every static tensor of ``g``.
    Slots: ``input[i]``, ``param[name]``, ``output[i]``, ``grad_output[i]``, ``grad_input[i]``
    (user arg i) and ``grad_input[name]`` (parameter)."""
    n_user = g.len_user_args
    names = _param_names(g)
    for i, t in enumerate(g.static_input_surface[:n_user]):
        yield "input", f"input[{i}]", t, False
    for name, t in zip(names, g.module_params):
        yield "param", f"param[{name}]", t, False
    for i, t in enumerate(g.static_outputs):
        yield "output", f"output[{i}]", t, False
    for i, t in enumerate(g.static_grad_outputs):
        if t is not None:
            yield "grad_output", f"grad_output[{i}]", t, False
    for i, t in enumerate(g.static_grad_inputs):
        if t is None:
            continue
        if i < n_user:
            yield "grad_input", f"grad_input[{i}]", t, False
        else:
            k = i - n_user
            yield "grad_input", f"grad_input[{names[k] if k < len(names) else k}]", t, True


def memory_report(graphed: Any) -> MemoryReport:
    """A :class:`MemoryReport` of ``graphed``: what ``make_graphed_callables`` returned (a graphed
    module or callable, or the tuple), or any list/tuple of graphed modules and callables (e.g.
    from several calls sharing a pool). Reading it synchronizes nothing and changes nothing;
    on CUDA it takes one ``torch.cuda.memory_snapshot()`` per pool."""
    core = _core
    gcs = list(_graphed_callables(graphed, set()))
    if not gcs:
        raise ValueError("gograph.memory_report: no graphed callables given")

    passes: list[PassMemory] = []
    owners: dict[tuple[str, int, int], list[tuple[int, str, str, str]]] = {}
    per_category: dict[str, dict[tuple[str, int, int], int]] = {c: {} for c in CATEGORIES}
    pools: dict[tuple[int, str], PoolMemory] = {}
    pool_tokens: dict[tuple[int, str], tuple[Any, Any]] = {}
    builds: dict[int, BuildStats] = {}
    per_pass_static = 0

    for g in gcs:
        pid = int(g.pass_id)
        eng = g.engine
        state = str(core.pass_state(pid))
        pool_key = str(core.pass_pool(pid)) or eng.pool_key(g.pool)
        seqs: dict[str, int] = {}
        nodes: dict[str, int | None] = {}
        for kind, kname in KIND_NAMES.items():
            seq = int(core.capture_seq(pid, kind))
            if seq <= 0:
                continue
            seqs[kname] = seq
            handle = int(core.pass_graph(pid, kind))
            nodes[kname] = int(core.graph_node_count(handle)) if handle else None
        bytes_by: dict[str, int] = {c: 0 for c in CATEGORIES}
        param_grad = 0
        seen_here: dict[str, set[tuple[str, int, int]]] = {c: set() for c in CATEGORIES}
        for cat, slot, t, is_param_grad in _slots(g):
            key = _storage_key(t)
            if key[2] == 0:
                continue
            owners.setdefault(key, []).append((pid, g.label, slot, cat))
            per_category[cat][key] = key[2]
            if key not in seen_here[cat]:
                seen_here[cat].add(key)
                bytes_by[cat] += key[2]
                if is_param_grad:
                    param_grad += key[2]
        build = g.build_stats
        if build is not None:
            builds.setdefault(build.id, build)
        captures = [c for c in build.captures if c.pass_id == pid] if build is not None else []
        pm = PassMemory(
            index=int(g.index),
            label=str(g.label),
            pass_id=pid,
            state=state,
            engine=eng.name,
            pool=pool_key,
            capture_seq=seqs,
            static_input_bytes=bytes_by["input"],
            param_bytes=bytes_by["param"],
            output_bytes=bytes_by["output"],
            grad_output_bytes=bytes_by["grad_output"],
            grad_input_bytes=bytes_by["grad_input"],
            param_grad_bytes=param_grad,
            graph_nodes=nodes,
            replay_order_check=bool(core.replay_order_check(pid)),
            captures=captures,
        )
        per_pass_static += pm.static_bytes
        passes.append(pm)
        pk = (id(eng), pool_key)
        if pk not in pools:
            pools[pk] = PoolMemory(
                pool=pool_key, engine=eng.name, pass_ids=[], reserved_bytes=None, active_bytes=None, segments=None
            )
            pool_tokens[pk] = (eng, g.pool)
        pools[pk].pass_ids.append(pid)

    for pk, pmem in pools.items():
        eng, token = pool_tokens[pk]
        usage = eng.pool_memory(token)
        if usage is not None:
            pmem.reserved_bytes, pmem.active_bytes, pmem.segments = (int(x) for x in usage)

    # Sharing: storages held by more than one slot (parameters are the model's and are expected
    # to be shared between passes of one layer, so they are left out).
    shared: list[SharedStorage] = []
    by_pass = {p.pass_id: p for p in passes}
    for key, holders in owners.items():
        holders = [h for h in holders if h[3] != "param"]
        if len(holders) < 2:
            continue
        shared.append(
            SharedStorage(
                device=key[0], data_ptr=key[1], nbytes=key[2], holders=[f"pass {h[0]} ({h[1]}) {h[2]}" for h in holders]
            )
        )
        for a in holders:
            for b in holders:
                if a[0] != b[0]:
                    by_pass[a[0]].shared.append(
                        SharedSlot(slot=a[2], other_pass_id=b[0], other_label=b[1], other_slot=b[2], nbytes=key[2])
                    )

    static_keys: set[tuple[str, int, int]] = set()
    for cat in ("input", "output", "grad_output", "grad_input"):
        static_keys.update(per_category[cat])
    static_total = sum(k[2] for k in static_keys)
    node_counts = [n for p in passes for n in p.graph_nodes.values() if n is not None]
    reserved = [p.reserved_bytes for p in pools.values() if p.reserved_bytes is not None]
    active = [p.active_bytes for p in pools.values() if p.active_bytes is not None]
    totals = Totals(
        passes=len(passes),
        graphs=sum(len(p.capture_seq) for p in passes),
        graph_nodes=sum(node_counts) if node_counts else None,
        static_input_bytes=sum(per_category["input"].values()),
        param_bytes=sum(per_category["param"].values()),
        output_bytes=sum(per_category["output"].values()),
        grad_output_bytes=sum(per_category["grad_output"].values()),
        grad_input_bytes=sum(per_category["grad_input"].values()),
        static_bytes=static_total,
        shared_bytes=per_pass_static - static_total,
        pool_reserved_bytes=sum(reserved) if reserved else None,
        pool_active_bytes=sum(active) if active else None,
        capture_seconds=sum(c.seconds for p in passes for c in p.captures),
    )
    summaries = [
        BuildSummary(
            build=b.id,
            engine=b.engine,
            seconds=b.seconds,
            captures=len(b.captures),
            warmup_seconds=b.warmup_seconds,
            warmup=b.warmup,
            debug_replay_order=b.debug_replay_order,
        )
        for b in builds.values()
    ]
    return MemoryReport(passes=passes, pools=list(pools.values()), shared=shared, builds=summaries, totals=totals)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def _kinds_str(d: dict[str, Any], fmt: Any = str) -> str:
    if not d:
        return "-"
    return "/".join("-" if d.get(k) is None else fmt(d[k]) for k in KIND_NAMES.values() if k in d)


def _table(header: list[str], rows: list[list[str]], right: Iterable[int]) -> list[str]:
    right = set(right)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _format(r: MemoryReport) -> str:
    t = r.totals
    engines = sorted({p.engine for p in r.passes})
    out = [
        f"gograph memory report: {t.passes} pass(es), {t.graphs} graph(s), engine {', '.join(engines)}, "
        f"{len(r.pools)} pool(s)"
    ]
    header = [
        "#",
        "pass",
        "label",
        "state",
        "seq f/b/w",
        "inputs",
        "params",
        "outputs",
        "grad out",
        "grad in",
        "nodes f/b/w",
        "capture ms",
        "shared",
    ]
    rows = []
    for p in r.passes:
        ms = sum(c.seconds for c in p.captures) * 1e3
        others = sorted({s.other_pass_id for s in p.shared})
        rows.append(
            [
                str(p.index),
                str(p.pass_id),
                p.label + (" [guard]" if p.replay_order_check else ""),
                p.state,
                _kinds_str(p.capture_seq),
                fmt_bytes(p.static_input_bytes),
                fmt_bytes(p.param_bytes),
                fmt_bytes(p.output_bytes),
                fmt_bytes(p.grad_output_bytes),
                fmt_bytes(p.grad_input_bytes),
                _kinds_str(p.graph_nodes),
                f"{ms:.1f}" if p.captures else "-",
                ",".join(map(str, others)) if others else "-",
            ]
        )
    rows.append(
        [
            "",
            "",
            "total (distinct storages)",
            "",
            "",
            fmt_bytes(t.static_input_bytes),
            fmt_bytes(t.param_bytes),
            fmt_bytes(t.output_bytes),
            fmt_bytes(t.grad_output_bytes),
            fmt_bytes(t.grad_input_bytes),
            "-" if t.graph_nodes is None else str(t.graph_nodes),
            f"{t.capture_seconds * 1e3:.1f}",
            "",
        ]
    )
    out += _table(header, rows, right=(0, 1, 5, 6, 7, 8, 9, 10, 11))
    out.append(
        f"static buffers: {fmt_bytes(t.static_bytes)} (inputs, outputs, grad buffers; "
        f"parameters not included); sharing saves {fmt_bytes(t.shared_bytes)}"
    )
    out.append("pools:")
    for pool in r.pools:
        if pool.reserved_bytes is None:
            mem = "no device pool (eager engine)"
        else:
            mem = (
                f"reserved {fmt_bytes(pool.reserved_bytes)}, active {fmt_bytes(pool.active_bytes)} "
                f"in {pool.segments} segment(s)"
            )
        out.append(f"  {pool.pool}: passes {','.join(map(str, pool.pass_ids))}; {mem}")
    if r.shared:
        out.append("shared storages:")
        for s in r.shared:
            out.append(f"  {fmt_bytes(s.nbytes)} on {s.device}: " + " = ".join(s.holders))
    for b in r.builds:
        if b.warmup is None:
            peak = "warmup peak not measured (eager engine)"
        else:
            w = b.warmup
            peak = (
                f"warmup peak {fmt_bytes(w.peak_bytes)} allocated, {fmt_bytes(w.delta_bytes)} above the "
                f"{fmt_bytes(w.baseline_bytes)} before warmup"
                + ("" if w.exact else " (upper bound: the device's earlier peak was higher)")
            )
        out.append(
            f"build {b.build} ({b.engine}, {b.captures} capture(s), {b.seconds * 1e3:.1f} ms, warmup "
            f"{b.warmup_seconds * 1e3:.1f} ms): {peak}" + ("; replay-order guard on" if b.debug_replay_order else "")
        )
    return "\n".join(out)
