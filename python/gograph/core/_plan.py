"""Typed facade of the Go core's planners.

A build's plan lives in Go behind a handle (:class:`Schedule`), from :func:`plan_schedule` to
:meth:`Schedule.free`; Python reads what it executes, once per ``make_graphed_callables``:

* the steps (which pass runs which callable, its chunk, layer and microbatch);
* the warmup program (:func:`warmup_program`): warmup ops in order, with the points where each
  pass's warmup outputs die;
* the capture program (:func:`capture_program`), planned from what warmup learned: capture ops
  with every release point, where each static buffer comes from, how each parameter grad
  reaches ``.grad``.

Formats are docs/CORE_API.md's, their record types :mod:`gograph.core._wire`'s. Go decides;
:mod:`gograph.build._build` executes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import _core
from ._kinds import StepKind
from ._wire import CaptureProgram, Facts, Prediction, Trace, WarmupProgram

__all__ = [
    "Schedule",
    "ScheduleError",
    "ScheduleTypeError",
    "Step",
    "capture_program",
    "encode_layers",
    "encode_order",
    "megatron_order",
    "plan_schedule",
    "predict",
    "warmup_program",
]


class ScheduleError(ValueError):
    """A malformed ``_order`` / ``_num_layers_per_chunk`` (or arguments that do not fit them):
    the message names the entry and the rule. A ValueError."""


class ScheduleTypeError(ScheduleError, TypeError):
    """An ``_order`` or ``_num_layers_per_chunk`` entry of the wrong type (a ScheduleError, so a
    ValueError, and a TypeError)."""


def encode_order(order: Any) -> str:
    """``_order`` as the core's text: entries joined by commas (integers as such, floats with
    their decimal, ``-1.5``). Raises :class:`ScheduleTypeError` for entries that are not real
    numbers (bools included: they are not chunk ids)."""
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        raise ScheduleTypeError(f"gograph: _order must be a list of chunk ids, got {type(order).__name__}")
    parts = []
    for i, c in enumerate(order):
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            raise ScheduleTypeError(
                f"gograph: _order entry {i} ({c!r}) is a {type(c).__name__}; entries are integers c "
                "(forward of chunk c), -c (backward) or -(c+0.5) (weight gradient)"
            )
        if isinstance(c, numbers.Integral):
            parts.append(str(int(c)))
            continue
        x = float(c)
        # Exact decimal: -1.5 renders as "-1.5"; non-halves stay recognisably fractional.
        parts.append(repr(x) if not math.isfinite(x) or "e" not in repr(x) else f"{x:.6f}")
    return ",".join(parts)


def encode_layers(layers: Any) -> str:
    """``_num_layers_per_chunk`` as the core's text: "" (None), "*L" (one int), "L1,L2,..."."""
    if layers is None:
        return ""
    if isinstance(layers, bool):
        raise ScheduleTypeError("gograph: _num_layers_per_chunk must be an int or a list of ints, got a bool")
    if isinstance(layers, numbers.Integral):
        return f"*{int(layers)}"
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise ScheduleTypeError(
            f"gograph: _num_layers_per_chunk must be an int or a list of ints, got {type(layers).__name__}"
        )
    out = []
    for i, n in enumerate(layers):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise ScheduleTypeError(f"gograph: _num_layers_per_chunk[{i}] ({n!r}) is not an int")
        out.append(str(int(n)))
    if not out:
        raise ScheduleError("gograph: _num_layers_per_chunk is empty; give one layer count per chunk")
    return ",".join(out)


class Step(NamedTuple):
    """One schedule step: its kind, the graphed pass, its callable, the ``_order`` entry it
    expands (-1 without ``_order``), chunk (1-based), layer, microbatch."""

    kind: StepKind
    pass_index: int
    callable_index: int
    entry: int
    chunk: int
    layer: int
    micro: int


@dataclass(eq=False)
class Schedule:
    """A validated schedule in the core (``handle``) and what Python needs to know of it."""

    handle: int
    ordered: bool
    num_passes: int
    steps: tuple[Step, ...]
    chunks: int = 1
    microbatches: int = 1
    layers: tuple[int, ...] = ()
    order: tuple[Any, ...] = ()
    callable_of: tuple[int, ...] = ()
    wgrad_passes: frozenset[int] = frozenset()
    _freed: bool = field(default=False, repr=False)

    def entry_name(self, entry: int) -> str:
        """How messages name an ``_order`` entry."""
        if 0 <= entry < len(self.order):
            return f"_order entry {entry} ({self.order[entry]!r})"
        return "the default schedule"

    def step_entry(self, pass_index: int, kind: StepKind) -> str | None:
        """How messages name the ``_order`` entry of the pass's step of ``kind`` (None without
        ``_order``)."""
        if not self.ordered:
            return None
        entry = next((s.entry for s in self.steps if s.pass_index == pass_index and s.kind == kind), -1)
        return self.entry_name(entry)

    def pass_label(self, pass_index: int, base: str) -> str:
        """``base`` with the pass's chunk, layer and microbatch when the schedule is an _order."""
        if not self.ordered:
            return base
        s = next(st for st in self.steps if st.pass_index == pass_index)
        return f"{base}[chunk {s.chunk} layer {s.layer} microbatch {s.micro}]"

    def free(self) -> None:
        """Forgets the plan in the core (idempotent)."""
        if not self._freed:
            self._freed = True
            _core.free_plan(self.handle)


def _invalid(e: RuntimeError) -> ScheduleError | None:
    marker = "invalid schedule: "
    msg = str(e)
    return ScheduleError("gograph: " + msg.split(marker, 1)[1]) if marker in msg else None


def plan_schedule(
    order: Any, layers: Any, num_callables: int, num_samples: int, training: bool, warmup_iters: int
) -> Schedule:
    """Validates and expands the schedule in the core (``order`` None: the default one). A
    malformed ``_order`` raises :class:`ScheduleError` naming the entry and the rule."""
    order_text = "" if order is None else encode_order(order)
    if order is not None and not order_text:
        raise ScheduleError("gograph: _order is empty; it must list each chunk's forward and backward entries")
    try:
        handle = int(
            _core.plan_schedule(
                order_text,
                encode_layers(layers),
                int(num_callables),
                int(num_samples),
                bool(training),
                int(warmup_iters),
            )
        )
    except RuntimeError as e:
        invalid = _invalid(e)
        if invalid is not None:
            raise invalid from None
        raise
    try:
        return _decode_schedule(handle, str(_core.plan_steps(handle)), tuple(order) if order is not None else ())
    except BaseException:
        _core.free_plan(handle)
        raise


def _decode_schedule(handle: int, text: str, order: tuple[Any, ...]) -> Schedule:
    lines = text.strip().split("\n")
    head = dict(kv.split("=", 1) for kv in lines[0].split()[2:])
    steps = []
    for line in lines[1:]:
        k, *nums = line.split()
        steps.append(Step(StepKind(k), *(int(x) for x in nums)))
    n = int(head["passes"])
    callable_of = [0] * n
    for s in steps:
        if s.kind is StepKind.FORWARD:
            callable_of[s.pass_index] = s.callable_index
    return Schedule(
        handle=handle,
        ordered=head["ordered"] == "1",
        num_passes=n,
        steps=tuple(steps),
        order=order,
        chunks=int(head["chunks"]),
        microbatches=int(head["microbatches"]),
        layers=tuple(int(x) for x in head["layers"].split(",") if x),
        callable_of=tuple(callable_of),
        wgrad_passes=frozenset(s.pass_index for s in steps if s.kind is StepKind.WGRAD),
    )


def warmup_program(
    schedule: Schedule, iters: int, hooks: bool, whole_step: bool = False, own_pool: bool = False
) -> WarmupProgram:
    """The warmup for ``iters`` iterations, as the core chooses it: per callable (torch's loop)
    for the default schedule, in the schedule's order with capture-time ``hooks`` or an
    ``_order``, and in the schedule's order inside the graph pool when the callables make the
    whole training step (``whole_step``: the last one returns the loss) and the build's pool is
    its own (``own_pool``); with the points where each pass's outputs and zero grads die."""
    text = str(_core.plan_warmup(schedule.handle, int(iters), bool(hooks), bool(whole_step), bool(own_pool)))
    return WarmupProgram.decode(text)


def capture_program(
    schedule: Schedule, facts: Facts, reuse: bool, chain: bool, release: bool, share: bool = False
) -> CaptureProgram:
    """Plans the captures from what warmup learned (``facts``); the core keeps the program with
    the schedule, where :func:`predict` reads it. ``share``: microbatches of a layer that are never
    in flight together replay one set of graphs (``CaptureProgram.share``)."""
    return CaptureProgram.decode(
        str(_core.plan_capture(schedule.handle, facts.text(), bool(reuse), bool(chain), bool(release), bool(share)))
    )


def predict(schedule: Schedule, trace: Trace) -> Prediction:
    """The memory of the captures :func:`capture_program` planned for ``schedule``, over what a
    warmup allocated (``trace``), through the core's model of the caching allocator."""
    return Prediction.decode(str(_core.plan_memory(schedule.handle, trace.text())))


def megatron_order(
    pipeline_size: int, rank: int, chunks: int, microbatches: int, group_size: int | None = None
) -> list[int]:
    """Megatron-LM's interleaved 1F1B schedule for one pipeline rank as a TransformerEngine
    ``_order`` (its ``get_schedule_table`` and ``convert_schedule_table_to_order``): microbatches
    in groups of ``group_size`` (default ``pipeline_size``) per virtual chunk, warmup forwards
    ``(pipeline_size - rank - 1) * 2 + (chunks - 1) * group_size``, then one forward / one
    backward, then the remaining backwards (backwards run the chunks in reverse).

    The arguments follow Megatron-LM's rules for its interleaved schedule: ``0 <= rank <
    pipeline_size``, ``chunks >= 1``, ``pipeline_size <= group_size <= microbatches``, and the last
    group of microbatches (``microbatches % group_size``) either empty or at least
    ``pipeline_size`` (with the default group size: ``microbatches`` a multiple of
    ``pipeline_size``). Anything else raises :class:`ScheduleError` (a ValueError; a TypeError too
    for a non-int), as Megatron-LM refuses that schedule."""
    group = _check_megatron_args(pipeline_size, rank, chunks, microbatches, group_size)
    table: list[int] = []  # chunk id (0-based) of each forward, in schedule order
    for lo in range(0, microbatches, group):
        hi = microbatches if lo + group >= microbatches else lo + group
        for c in range(chunks):
            table.extend([c] * (hi - lo))
    total = microbatches * chunks
    warm = min((pipeline_size - rank - 1) * 2 + (chunks - 1) * group, total)
    fwd = [c + 1 for c in table]
    bwd = [c - chunks for c in table]
    order = fwd[:warm]
    for i in range(warm, total):
        order += [fwd[i], bwd[i - warm]]
    if warm:
        order += bwd[total - warm :]
    return order


def _check_megatron_args(pipeline_size: Any, rank: Any, chunks: Any, microbatches: Any, group_size: Any) -> int:
    """Megatron-LM's checks of an interleaved schedule's sizes; returns the group size."""
    given = {"pipeline_size": pipeline_size, "rank": rank, "chunks": chunks, "microbatches": microbatches}
    if group_size is not None:
        given["group_size"] = group_size
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ScheduleTypeError(
                f"gograph: megatron_order: {name} must be an int, got {value!r} (a {type(value).__name__})"
            )
    for name in ("pipeline_size", "chunks", "microbatches"):
        if given[name] < 1:
            raise ScheduleError(f"gograph: megatron_order: {name} must be >= 1, got {given[name]}")
    if not 0 <= rank < pipeline_size:
        raise ScheduleError(
            f"gograph: megatron_order: rank must be in [0, pipeline_size) = [0, {pipeline_size}), got {rank}"
        )
    group = int(pipeline_size if group_size is None else group_size)
    if group_size is None and microbatches < pipeline_size:
        raise ScheduleError(
            f"gograph: megatron_order: Megatron-LM's interleaved schedule needs at least pipeline_size "
            f"({pipeline_size}) microbatches, got {microbatches}"
        )
    if not pipeline_size <= group <= microbatches:
        raise ScheduleError(
            f"gograph: megatron_order: group_size must be in [pipeline_size, microbatches] = "
            f"[{pipeline_size}, {microbatches}] (Megatron-LM's microbatch_group_size_per_vp_stage), got {group}"
        )
    last = microbatches % group
    if 0 < last < pipeline_size:
        raise ScheduleError(
            f"gograph: megatron_order: Megatron-LM's interleaved schedule refuses {microbatches} microbatches in "
            f"groups of {group}: the last group would hold {last}, fewer than pipeline_size {pipeline_size}; use a "
            f"multiple of {group} microbatches"
            + (" (of pipeline_size)" if group_size is None else " or a group_size that divides microbatches")
        )
    return group
