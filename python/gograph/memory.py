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

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from .core import _core
from .replay.graphed import GraphedCallable
from .runtime._observe import KIND_NAMES, BuildStats, CaptureRecord, WarmupPeak, fmt_bytes, json_text

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
    pool_planned_bytes: int
    """Static buffers this pass does not own: pool blocks handed back once the schedule is past
    their last reader (``_reuse_graph_input_output_buffers``, ``chain_buffers``, and the
    parameter grads of ``_order`` schedules on a CUDA pool), reused by later captures; included in
    the categories above."""
    chained_slots: list[str]
    """Slots that are another pass's buffer (``chain_buffers``): inputs reading the previous
    layer's output, grad outputs that are the next layer's input grad."""
    lent_param_grads: int
    """Parameter grads whose static buffer is lent to ``.grad`` (``chain_buffers``)."""
    separated_inputs: list[str]
    """Inputs whose static buffer is a clone of the sample, because the sample shares memory with
    another pass's that is live at the same time, or with a parameter (docs/API.md, "Samples
    that share memory")."""
    shared_inputs: list[str]
    """Inputs whose static buffer other passes' graphs read too (a no-grad sample passed to
    several layers, a slot shared by schedule); a call's copy into one is guarded."""
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
    pool_planned_bytes: int
    """The part of ``static_bytes`` that is pool-planned (not owned; see PassMemory)."""
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
        return json_text(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return _format(self)


# ---------------------------------------------------------------------------------------------
# Building the report
# ---------------------------------------------------------------------------------------------
def _graphed_callables(obj: Any, seen: set[int]) -> Iterator[Any]:
    """The GraphedCallables in ``obj``: one, a module whose forward is one, an object holding
    several (``graphed_callables`` attribute), or any (nested) tuple/list of those."""
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


def _slots(g: Any) -> Iterator[tuple[str, str, Tensor, bool, bool]]:
    """(category, slot name, tensor, is a parameter's grad, pool-planned) for every static
    tensor of ``g``.
    Slots: ``input[i]``, ``param[name]``, ``output[i]``, ``grad_output[i]``, ``grad_input[i]``
    (user arg i) and ``grad_input[name]`` (parameter)."""
    n_user = g.len_user_args
    names = _param_names(g)
    released_out, released_grad = g.released_outputs, g.released_grad_inputs
    for i, t in enumerate(g.static_input_surface[:n_user]):
        yield "input", f"input[{i}]", t, False, False
    for name, t in zip(names, g.module_params):
        yield "param", f"param[{name}]", t, False, False
    for i, t in enumerate(g.static_outputs):
        yield "output", f"output[{i}]", t, False, i in released_out
    for i, t in enumerate(g.static_grad_outputs):
        if t is not None:
            yield "grad_output", f"grad_output[{i}]", t, False, False
    for i, t in enumerate(g.static_grad_inputs):
        if t is None:
            continue
        if i < n_user:
            yield "grad_input", f"grad_input[{i}]", t, False, i in released_grad
        else:
            k = i - n_user
            yield "grad_input", f"grad_input[{names[k] if k < len(names) else k}]", t, True, i in released_grad


def memory_report(graphed: Any) -> MemoryReport:
    """A :class:`MemoryReport` of ``graphed``: what ``make_graphed_callables`` returned (a graphed
    module or callable, or the tuple), or any list/tuple of graphed modules and callables (e.g.
    from several calls sharing a pool). Reading it synchronizes nothing and changes nothing;
    on CUDA it takes one ``torch.cuda.memory_snapshot()`` per pool."""
    gcs = list(_graphed_callables(graphed, set()))
    if not gcs:
        raise ValueError("gograph.memory_report: no graphed callables given")
    c = _Collector()
    for g in gcs:
        c.add(g)
    pools = c.pool_usage()
    shared = c.shared()
    builds = [
        BuildSummary(
            build=b.id,
            engine=b.engine,
            seconds=b.seconds,
            captures=len(b.captures),
            warmup_seconds=b.warmup_seconds,
            warmup=b.warmup,
            debug_replay_order=b.debug_replay_order,
        )
        for b in c.builds.values()
    ]
    return MemoryReport(passes=c.passes, pools=pools, shared=shared, builds=builds, totals=c.totals(pools))


_Key = tuple[str, int, int]  # device, storage data_ptr, bytes


class _Collector:
    """Gathers the passes of a report: storages by category and holder, pools, builds."""

    def __init__(self) -> None:
        self.passes: list[PassMemory] = []
        self.owners: dict[_Key, list[tuple[int, str, str, str]]] = {}
        self.per_category: dict[str, dict[_Key, int]] = {c: {} for c in CATEGORIES}
        self.planned: dict[_Key, int] = {}
        self.pools: dict[tuple[int, str], PoolMemory] = {}
        self.pool_tokens: dict[tuple[int, str], tuple[Any, Any]] = {}
        self.builds: dict[int, BuildStats] = {}
        self.per_pass_static = 0

    def add(self, g: Any) -> None:
        pid, eng = int(g.pass_id), g.engine
        pool_key = str(_core.pass_pool(pid)) or eng.pool_key(g.pool)
        bytes_by, param_grad, planned = self._storages(g, pid)
        build = g.build_stats
        if build is not None:
            self.builds.setdefault(build.id, build)
        seqs, nodes = _graphs_of(pid)
        pm = PassMemory(
            index=int(g.index),
            label=str(g.label),
            pass_id=pid,
            state=str(_core.pass_state(pid)),
            engine=eng.name,
            pool=pool_key,
            capture_seq=seqs,
            static_input_bytes=bytes_by["input"],
            param_bytes=bytes_by["param"],
            output_bytes=bytes_by["output"],
            grad_output_bytes=bytes_by["grad_output"],
            grad_input_bytes=bytes_by["grad_input"],
            param_grad_bytes=param_grad,
            pool_planned_bytes=planned,
            chained_slots=[f"input[{j}]" for j in sorted(g.chained_inputs)]
            + [f"grad_output[{k}]" for k in sorted(g.chained_grad_outputs)],
            lent_param_grads=int(g.lent_param_grads),
            separated_inputs=[f"input[{j}]" for j in sorted(g.separated_inputs)],
            shared_inputs=[f"input[{j}]" for j in sorted(g.shared_inputs)],
            graph_nodes=nodes,
            replay_order_check=bool(_core.replay_order_check(pid)),
            captures=[c for c in build.captures if c.pass_id == pid] if build is not None else [],
        )
        self.per_pass_static += pm.static_bytes
        self.passes.append(pm)
        pk = (id(eng), pool_key)
        if pk not in self.pools:
            self.pools[pk] = PoolMemory(
                pool=pool_key, engine=eng.name, pass_ids=[], reserved_bytes=None, active_bytes=None, segments=None
            )
            self.pool_tokens[pk] = (eng, g.pool)
        if pid not in self.pools[pk].pass_ids:  # callables sharing graphs share the pass
            self.pools[pk].pass_ids.append(pid)

    def _storages(self, g: Any, pid: int) -> tuple[dict[str, int], int, int]:
        bytes_by = {c: 0 for c in CATEGORIES}
        param_grad = planned = 0
        seen_here: dict[str, set[_Key]] = {c: set() for c in CATEGORIES}
        for cat, slot, t, is_param_grad, is_planned in _slots(g):
            key = _storage_key(t)
            if key[2] == 0:
                continue
            self.owners.setdefault(key, []).append((pid, g.label, slot, cat))
            self.per_category[cat][key] = key[2]
            if key in seen_here[cat]:
                continue
            seen_here[cat].add(key)
            bytes_by[cat] += key[2]
            param_grad += key[2] if is_param_grad else 0
            if is_planned:
                planned += key[2]
                self.planned[key] = key[2]
        return bytes_by, param_grad, planned

    def pool_usage(self) -> list[PoolMemory]:
        for pk, pmem in self.pools.items():
            eng, token = self.pool_tokens[pk]
            usage = eng.pool_memory(token)
            if usage is not None:
                pmem.reserved_bytes, pmem.active_bytes, pmem.segments = (int(x) for x in usage)
        return list(self.pools.values())

    def shared(self) -> list[SharedStorage]:
        """Storages held by more than one slot (parameters are the model's, expected to be shared
        between passes of one layer, so they are left out)."""
        out: list[SharedStorage] = []
        by_pass = {p.pass_id: p for p in self.passes}
        for key, holders in self.owners.items():
            holders = [h for h in holders if h[3] != "param"]
            if len(holders) < 2:
                continue
            names = [f"pass {h[0]} ({h[1]}) {h[2]}" for h in holders]
            out.append(SharedStorage(device=key[0], data_ptr=key[1], nbytes=key[2], holders=names))
            for a in holders:
                for b in holders:
                    if a[0] != b[0]:
                        by_pass[a[0]].shared.append(
                            SharedSlot(slot=a[2], other_pass_id=b[0], other_label=b[1], other_slot=b[2], nbytes=key[2])
                        )
        return out

    def totals(self, pools: list[PoolMemory]) -> Totals:
        static_keys: set[_Key] = set()
        for cat in ("input", "output", "grad_output", "grad_input"):
            static_keys.update(self.per_category[cat])
        static_total = sum(k[2] for k in static_keys)
        node_counts = [
            n for p in {p.pass_id: p for p in self.passes}.values() for n in p.graph_nodes.values() if n is not None
        ]
        reserved = [p.reserved_bytes for p in pools if p.reserved_bytes is not None]
        active = [p.active_bytes for p in pools if p.active_bytes is not None]
        per = self.per_category
        return Totals(
            passes=len(self.passes),
            # callables that replay one set of graphs (share_microbatch_graphs) count it once
            graphs=sum(len(p.capture_seq) for p in {p.pass_id: p for p in self.passes}.values()),
            graph_nodes=sum(node_counts) if node_counts else None,
            static_input_bytes=sum(per["input"].values()),
            param_bytes=sum(per["param"].values()),
            output_bytes=sum(per["output"].values()),
            grad_output_bytes=sum(per["grad_output"].values()),
            grad_input_bytes=sum(per["grad_input"].values()),
            static_bytes=static_total,
            pool_planned_bytes=sum(self.planned.values()),
            shared_bytes=self.per_pass_static - static_total,
            pool_reserved_bytes=sum(reserved) if reserved else None,
            pool_active_bytes=sum(active) if active else None,
            capture_seconds=sum(c.seconds for p in self.passes for c in p.captures),
        )


def _graphs_of(pid: int) -> tuple[dict[str, int], dict[str, int | None]]:
    """Capture sequence numbers and node counts of a pass's graphs, by kind name."""
    seqs: dict[str, int] = {}
    nodes: dict[str, int | None] = {}
    for kind, kname in KIND_NAMES.items():
        seq = int(_core.capture_seq(pid, kind))
        if seq <= 0:
            continue
        seqs[kname] = seq
        handle = int(_core.pass_graph(pid, kind))
        nodes[kname] = int(_core.graph_node_count(handle)) if handle else None
    return seqs, nodes


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


_HEADER = ["#", "pass", "label", "state", "seq f/b/w", "inputs", "params", "outputs", "grad out", "grad in",
           "pool-planned", "nodes f/b/w", "capture ms", "shared"]  # fmt: skip


def _pass_row(p: PassMemory) -> list[str]:
    ms = sum(c.seconds for c in p.captures) * 1e3
    others = sorted({s.other_pass_id for s in p.shared})
    return [
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
        fmt_bytes(p.pool_planned_bytes),
        _kinds_str(p.graph_nodes),
        f"{ms:.1f}" if p.captures else "-",
        ",".join(map(str, others)) if others else "-",
    ]


def _total_row(t: Totals) -> list[str]:
    return ["", "", "total (distinct storages)", "", "", fmt_bytes(t.static_input_bytes), fmt_bytes(t.param_bytes),
            fmt_bytes(t.output_bytes), fmt_bytes(t.grad_output_bytes), fmt_bytes(t.grad_input_bytes),
            fmt_bytes(t.pool_planned_bytes), "-" if t.graph_nodes is None else str(t.graph_nodes),
            f"{t.capture_seconds * 1e3:.1f}", ""]  # fmt: skip


def _build_line(b: BuildSummary) -> str:
    if b.warmup is None:
        peak = "warmup peak not measured (eager engine)"
    else:
        w = b.warmup
        peak = (
            f"warmup peak {fmt_bytes(w.peak_bytes)} allocated, {fmt_bytes(w.delta_bytes)} above the "
            f"{fmt_bytes(w.baseline_bytes)} before warmup"
            + ("" if w.exact else " (upper bound: the device's earlier peak was higher)")
        )
    return (
        f"build {b.build} ({b.engine}, {b.captures} capture(s), {b.seconds * 1e3:.1f} ms, warmup "
        f"{b.warmup_seconds * 1e3:.1f} ms): {peak}" + ("; replay-order guard on" if b.debug_replay_order else "")
    )


def _format(r: MemoryReport) -> str:
    t = r.totals
    engines = sorted({p.engine for p in r.passes})
    out = [
        f"gograph memory report: {t.passes} pass(es), {t.graphs} graph(s), engine {', '.join(engines)}, "
        f"{len(r.pools)} pool(s)"
    ]
    rows = [_pass_row(p) for p in r.passes] + [_total_row(t)]
    out += _table(_HEADER, rows, right=(0, 1, 5, 6, 7, 8, 9, 10, 11, 12))
    lent = sum(p.lent_param_grads for p in r.passes)
    chained = sum(len(p.chained_slots) for p in r.passes)
    separated = sum(len(p.separated_inputs) for p in r.passes)
    shared = sum(len(p.shared_inputs) for p in r.passes)
    out.append(
        f"static buffers: {fmt_bytes(t.static_bytes)} (inputs, outputs, grad buffers; parameters not included), "
        f"{fmt_bytes(t.pool_planned_bytes)} of it pool-planned (not owned); sharing saves {fmt_bytes(t.shared_bytes)}"
        + (f"; {chained} chained slot(s)" if chained else "")
        + (f"; {lent} parameter grad(s) lent to .grad" if lent else "")
        + (f"; {separated} input(s) separated (a clone of a sample that shares memory)" if separated else "")
        + (f"; {shared} input(s) read by other passes too (copy-ins guarded)" if shared else "")
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
        out += [f"  {fmt_bytes(s.nbytes)} on {s.device}: " + " = ".join(s.holders) for s in r.shared]
    out += [_build_line(b) for b in r.builds]
    return "\n".join(out)
