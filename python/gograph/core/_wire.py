"""The line protocols between Python and the core, one record type each, versioned.

Python sends :class:`Facts` (what warmup learned, to plan the captures) and :class:`Trace`
(what a warmup allocated, to predict memory); the core returns a :class:`WarmupProgram`, a
:class:`CaptureProgram` and a :class:`Prediction`, and once per process the
:class:`GradSlotPolicy`. Every text starts with a header line ``NAME vN`` (Go's
``internal/wire``): a reader refuses another name or version, saying which it got, so a Python
package and a core built from different sources fail at the first plan instead of misreading
each other. The lines are docs/CORE_API.md's; the Go record types are
``lifetime.Facts``, ``lifetime.Program``, ``memplan.Trace``, ``memplan.Result`` and
``gradslot.Encode``'s table.

Nothing here decides: these are the boundary's data, decoded once per build (the policy once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._kinds import (
    BufferSource,
    CaptureOp,
    GradPolicy,
    GradSource,
    Learned,
    ReleaseRole,
    SlotAfter,
    SlotBefore,
    SlotDeliver,
    SlotPrepare,
    SlotState,
    WarmOp,
)

__all__ = [
    "CaptureProgram",
    "Decision",
    "Facts",
    "GradSlotPolicy",
    "Op",
    "Prediction",
    "ProtocolError",
    "Source",
    "Trace",
    "WarmupProgram",
]

#: The versions this package speaks (the core's ``internal/wire``).
FACTS, TRACE, WARMUP, PROGRAM, PREDICTION = ("facts", 1), ("trace", 1), ("warmup", 1), ("program", 1), ("prediction", 1)
GRADSLOT = ("gradslot", 1)


class ProtocolError(RuntimeError):
    """A text from the core that is not of the protocol or version this package reads: the
    extension and the Python package were built from different sources."""


def _header(protocol: tuple[str, int]) -> str:
    return f"{protocol[0]} v{protocol[1]}"


def _body(text: str, protocol: tuple[str, int]) -> tuple[list[str], list[list[str]]]:
    """The header's fields after the version, and the other lines split into fields."""
    lines = [f for f in map(str.split, text.splitlines()) if f]
    name, version = protocol
    if not lines or lines[0][:2] != [name, f"v{version}"]:
        got = " ".join(lines[0]) if lines else ""
        raise ProtocolError(
            f"gograph: the core's {name} text starts with {got[:40]!r}, not {_header(protocol)!r}: the Go "
            "extension and the Python package were built from different sources; rebuild the extension "
            "(`make build`, or `pip install .` again)"
        )
    return lines[0][2:], lines[1:]


class Op(NamedTuple):
    """One op of a program: its kind, the pass (-1: none), and for a release the buffer's role
    and its index there (output index, user-input leaf, static-surface position)."""

    kind: WarmOp | CaptureOp
    pass_index: int
    role: ReleaseRole | None = None
    buffer: int = -1


# ---------------------------------------------------------------------------------------------
# Python -> core
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Facts:
    """What warmup learned about each pass, as the core's facts lines (``pass``, ``in``, ``out``,
    ``pg``; written by :func:`gograph.build._reuse.facts`)."""

    lines: tuple[str, ...]

    def text(self) -> str:
        return "\n".join((_header(FACTS), *self.lines)) + "\n"


@dataclass(frozen=True)
class Trace:
    """What one warmup allocated, as the core's trace lines (``step``, ``a``, ``r``, ``out``,
    ``grad``, ``new``, ``noseed``; written by :func:`gograph.probes._probe.trace_text`)."""

    lines: tuple[str, ...]

    def text(self) -> str:
        return "\n".join((_header(TRACE), *self.lines)) + "\n"

    def with_lines(self, more: Sequence[str]) -> Trace:
        """The trace and ``more`` lines (the build's new buffers, ``noseed``)."""
        return Trace((*self.lines, *more))


# ---------------------------------------------------------------------------------------------
# core -> Python
# ---------------------------------------------------------------------------------------------
def _members(kinds: Any) -> dict[str, Any]:
    """Value -> member of an enum: one dict lookup per field (an enum's call is slow in Python)."""
    return {k.value: k for k in kinds}


_WARM_OPS, _CAPTURE_OPS, _ROLES = _members(WarmOp), _members(CaptureOp), _members(ReleaseRole)
_SOURCES, _POLICIES = _members(BufferSource), _members(GradPolicy)


def _op(f: list[str], kinds: dict[str, Any]) -> Op:
    kind = kinds[f[1]]
    if kind is CaptureOp.RELEASE:
        return Op(kind, int(f[3]), _ROLES[f[2]], int(f[4]))
    return Op(kind, int(f[2]))


@dataclass(frozen=True)
class WarmupProgram:
    """The warmup ops in order, and whether warmup allocates in the build's graph pool."""

    ops: tuple[Op, ...]
    in_pool: bool

    @classmethod
    def decode(cls, text: str) -> WarmupProgram:
        fields, lines = _body(text, WARMUP)
        return cls(tuple([_op(f, _WARM_OPS) for f in lines if f[0] == "op"]), "pool=1" in fields)


@dataclass(frozen=True)
class Source:
    """Where a static buffer comes from: for a slot, its number; for a chained buffer, the other
    pass and its output (inputs) or user-input leaf (grad outputs)."""

    kind: BufferSource
    slot: int = -1
    pass_index: int = -1
    index: int = -1


def _source(f: list[str]) -> Source:
    kind = _SOURCES[f[3]]
    if kind is BufferSource.SLOT:
        return Source(kind, slot=int(f[4]))
    if kind is BufferSource.CHAINED:
        return Source(kind, pass_index=int(f[4]), index=int(f[5]))
    return Source(kind)


@dataclass(frozen=True)
class CaptureProgram:
    """A planned capture: ops in order; buffer sources that are not the pass's own, by (pass,
    leaf) and (pass, output); parameter-grad policies by (pass, facts entry); slot counts per
    signature id (buffers, slots, TransformerEngine's FIFO count); and per captured graph
    ((capture op, pass) -> op index) the first op from which a lending backward's lent grads
    are memory its replay may overwrite (``len(ops)``: none of this build)."""

    ops: tuple[Op, ...]
    inputs: dict[tuple[int, int], Source]
    grad_outputs: dict[tuple[int, int], Source]
    grad_policy: dict[tuple[int, int], GradPolicy]
    sigs: dict[int, tuple[int, int, int]]
    slots: int
    lent_from: dict[tuple[CaptureOp, int], int] = field(default_factory=dict)
    #: pass -> the pass whose graphs and buffers it replays (``share_microbatch_graphs``); a pass
    #: not in it captures its own
    share: dict[int, int] = field(default_factory=dict)

    @classmethod
    def decode(cls, text: str) -> CaptureProgram:
        _, lines = _body(text, PROGRAM)
        ops: list[Op] = []
        inputs, gouts, policy, sigs, lent, slots, share = {}, {}, {}, {}, {}, 0, {}
        for f in lines:
            tag = f[0]
            if tag == "op":
                ops.append(_op(f, _CAPTURE_OPS))
            elif tag == "in":
                inputs[(int(f[1]), int(f[2]))] = _source(f)
            elif tag == "gout":
                gouts[(int(f[1]), int(f[2]))] = _source(f)
            elif tag == "grad":
                policy[(int(f[1]), int(f[2]))] = _POLICIES[f[3]]
            elif tag == "sig":
                sigs[int(f[1])] = (int(f[2]), int(f[3]), int(f[4]))
            elif tag == "lent":
                lent[(_CAPTURE_OPS[f[1]], int(f[2]))] = int(f[3])
            elif tag == "slots":
                slots = int(f[1])
            elif tag == "share":
                share[int(f[1])] = int(f[2])
        return cls(tuple(ops), inputs, gouts, policy, sigs, slots, lent, share)

    @property
    def backwards(self) -> frozenset[int]:
        """The passes (indices) that have a backward: those the program captures one for. A
        forward-only pass (built under no_grad, TransformerEngine's eval ``_order``, outputs that
        need no grad) has none, so nothing of it waits for one."""
        return frozenset(op.pass_index for op in self.ops if op.kind is CaptureOp.BACKWARD)


@dataclass(frozen=True)
class Prediction:
    """The core's memory prediction: the seed segment a build carves before its first capture
    (0: none), and -- absent where the core says nothing -- the pool once built (reserved, peak
    allocated, live, segments), one warmup iteration (reserved, peak allocated, beside the pool),
    the pool's segment sizes, where the model put each traced block (block -> (segment, offset))
    and the pool after each capture op (op text, reserved, allocated)."""

    seed: int = 0
    pool: tuple[int, ...] = ()
    warmup: tuple[int, ...] = ()
    segments: tuple[int, ...] = ()
    places: dict[int, tuple[int, int]] = field(default_factory=dict)
    ops: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def decode(cls, text: str) -> Prediction:
        _, lines = _body(text, PREDICTION)
        nums: dict[str, tuple[int, ...]] = {}
        places: dict[int, tuple[int, int]] = {}
        ops: list[tuple[str, int, int]] = []
        for f in lines:
            if f[0] in ("seed", "pool", "warmup", "segments"):
                nums[f[0]] = tuple(int(x) for x in f[1:])
            elif f[0] == "place":
                places[int(f[1])] = (int(f[2]), int(f[3]))
            elif f[0] == "op":
                ops.append((" ".join(f[1:-2]), int(f[-2]), int(f[-1])))
        seed = nums.get("seed", (0,))
        return cls(
            seed=seed[0] if seed else 0,
            pool=nums.get("pool", ()),
            warmup=nums.get("warmup", ()),
            segments=nums.get("segments", ()),
            places=places,
            ops=tuple(ops),
        )


class Decision(NamedTuple):
    """The grad-slot policy's answer for one slot: what happens to the graph's memory before it
    replays, what reaches the slot after, whether the hand-out is watched until a replay that may
    overwrite a lent buffer, and what the slot has learnt."""

    prepare: SlotPrepare
    deliver: SlotDeliver
    watch: bool
    learned: Learned


_LEARNED = {m.letter: m for m in Learned}


@dataclass(frozen=True)
class GradSlotPolicy:
    """The core's grad-slot policy (``internal/gradslot``), every row of it: ``handout`` by
    (source, slot state, whether something besides gograph holds the graph's memory, learned);
    ``sweep`` by (lent, present, learned) -> (copy out, learned); ``capture`` by (before, after)
    -> the source the slot is to its weight-gradient graph (None: no target)."""

    handout: dict[tuple[GradSource, SlotState, bool, Learned], Decision]
    sweep: dict[tuple[bool, bool, Learned], tuple[bool, Learned]]
    capture: dict[tuple[SlotBefore, SlotAfter], GradSource | None]

    @classmethod
    def decode(cls, text: str) -> GradSlotPolicy:
        _, lines = _body(text, GRADSLOT)
        src, st, prep, dl = _members(GradSource), _members(SlotState), _members(SlotPrepare), _members(SlotDeliver)
        handout, sweep, capture = {}, {}, {}
        for f in lines:
            if f[0] == "handout":
                key = (src[f[1]], st[f[2]], f[3] == "1", _LEARNED[f[4]])
                handout[key] = Decision(prep[f[5]], dl[f[6]], f[7] == "1", _LEARNED[f[8]])
            elif f[0] == "sweep":
                sweep[(f[1] == "1", f[2] == "1", _LEARNED[f[3]])] = (f[4] == "1", _LEARNED[f[5]])
            elif f[0] == "capture":
                capture[(SlotBefore(f[1]), SlotAfter(f[2]))] = None if f[3] == "-" else src[f[3]]
        return cls(handout, sweep, capture)
