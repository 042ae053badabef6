"""The static buffers a build will hold, pass by pass, from its capture program and what warmup
measured (for :func:`gograph.plan_memory`), counted as :func:`gograph.memory_report` counts them:
storage bytes, once per storage within a pass and category, and once across passes in the
totals. A chained input is the producer's output, a chained grad output the consumer's input
grad, a slot one buffer for every pass that uses it, a separated input (a sample sharing memory
with another input leaf or a parameter) a new clone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core._kinds import BufferSource, CaptureOp, GradPolicy
from ..core._wire import CaptureProgram
from ._probe import Probe

__all__ = ["PassBytes", "count"]

_Key = tuple[Any, ...]


@dataclass
class PassBytes:
    """One pass's storages by category (key -> bytes), which of them are pool-planned, and its
    chained slots and lent parameter grads."""

    by_category: dict[str, dict[_Key, int]] = field(default_factory=dict)
    param_grads: dict[_Key, int] = field(default_factory=dict)
    planned: dict[_Key, int] = field(default_factory=dict)
    chained: list[str] = field(default_factory=list)
    lent: int = 0
    new: dict[_Key, int] = field(default_factory=dict)

    def total(self, category: str) -> int:
        return sum(self.by_category.get(category, {}).values())


def count(found: Probe, places: dict[tuple[str, int, int], tuple[int, int]] | None = None) -> list[PassBytes]:
    """Per pass, the storages of its static buffers (see the module docstring). ``places``: where
    the core's allocator model put pool buffers (("out", pass, k) / ("grad", pass, j) -> segment,
    offset); two buffers at one place with one size are one storage, as memory_report sees them."""
    prog, sizes = found.program, found.sizes
    where = places or {}

    def key(kind: str, p: int, i: int, nbytes: int) -> _Key:
        at = where.get((kind, p, i))
        return (kind, p, i) if at is None else ("pool", *at, nbytes)

    released = {(op.pass_index, op.role, op.buffer) for op in prog.ops if op.kind is CaptureOp.RELEASE}
    slot_users = {src.slot for (_, _), src in prog.inputs.items() if src.kind is BufferSource.SLOT}
    out: list[PassBytes] = []
    for st in found.states:
        pb = PassBytes(by_category={c: {} for c in ("input", "output", "grad_output", "grad_input")})
        p, outs = st.index, sizes.outputs.get(st.index, [])
        _inputs(pb, st, prog, sizes, key)
        for k, (nbytes, _) in enumerate(outs):
            pb.by_category["output"][key("out", p, k, nbytes)] = nbytes
            if (p, "o", k) in released:
                pb.planned[key("out", p, k, nbytes)] = nbytes
        if st.captures_backward:
            _grad_outputs(pb, st, prog, sizes, slot_users, key)
            _grad_inputs(pb, st, sizes, released, key)
        pb.lent = sum(1 for (q, _), pol in prog.grad_policy.items() if q == p and pol is GradPolicy.LEND)
        out.append(pb)
    return out


def _inputs(pb: PassBytes, st: Any, prog: CaptureProgram, sizes: Any, key: Any) -> None:
    for j, t in enumerate(st.flat_args):
        src = prog.inputs.get((st.index, j))
        if src is not None and src.kind is BufferSource.CHAINED:
            outs = sizes.outputs.get(src.pass_index, [])
            if src.index < len(outs):
                nbytes = outs[src.index][0]
                pb.by_category["input"][key("out", src.pass_index, src.index, nbytes)] = nbytes
                pb.chained.append(f"input[{j}]")
                continue
        if src is not None and src.kind is BufferSource.FRESH:  # a clone of the sample: new bytes, its elements only
            nbytes = t.numel() * t.element_size()
            pb.by_category["input"][("fresh", st.index, j)] = pb.new[("fresh", st.index, j)] = nbytes
            continue
        own: _Key = ("slot", src.slot) if src is not None and src.kind is BufferSource.SLOT else ("sample", id(t))
        pb.by_category["input"][own] = int(t.untyped_storage().nbytes())


def _grad_outputs(pb: PassBytes, st: Any, prog: CaptureProgram, sizes: Any, slot_users: set[int], key: Any) -> None:
    outs = sizes.outputs.get(st.index, [])
    for k, (_, rg) in enumerate(st.output_meta):
        src = prog.grad_outputs.get((st.index, k))
        if not rg or k >= len(outs) or (src is not None and src.kind is BufferSource.NONE):
            continue
        dense = outs[k][1]
        if src is not None and src.kind is BufferSource.CHAINED:
            g = sizes.grads.get(src.pass_index, {}).get(src.index)
            if g is not None:
                pb.by_category["grad_output"][key("grad", src.pass_index, src.index, g)] = g
                pb.chained.append(f"grad_output[{k}]")
                continue
        if src is not None and src.kind is BufferSource.SLOT:
            pb.by_category["grad_output"][("slot", src.slot)] = dense
            if src.slot not in slot_users:  # a slot only grad outputs use is a new tensor
                pb.new[("slot", src.slot)] = dense
            continue
        pb.by_category["grad_output"][("gout", st.index, k)] = dense
        pb.new[("gout", st.index, k)] = dense


def _grad_inputs(pb: PassBytes, st: Any, sizes: Any, released: set[tuple[int, Any, int]], key: Any) -> None:
    n_user = len(st.flat_args)
    for j, nbytes in sorted(sizes.grads.get(st.index, {}).items()):
        k = key("grad", st.index, j, nbytes)
        pb.by_category["grad_input"][k] = nbytes
        if j >= n_user:
            pb.param_grads[k] = nbytes
        if (st.index, "d" if j < n_user else "p", j) in released:
            pb.planned[k] = nbytes


def distinct(passes: Sequence[PassBytes], attr: str = "") -> int:
    """Bytes of the distinct storages of every pass (``attr``: "planned" or "new"; all static
    categories by default)."""
    return sum(_distinct(passes, attr).values())


def new_sizes(passes: Sequence[PassBytes]) -> list[int]:
    """Sizes of the distinct buffers the build allocates outside the pool, in pass order."""
    return list(_distinct(passes, "new").values())


def _distinct(passes: Sequence[PassBytes], attr: str) -> dict[_Key, int]:
    seen: dict[_Key, int] = {}
    for pb in passes:
        if attr:
            seen.update(getattr(pb, attr))
        else:
            for cat in pb.by_category.values():
                seen.update(cat)
    return seen
