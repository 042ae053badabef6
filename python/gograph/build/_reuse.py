"""The static buffers' plan, Python side: what warmup learned, written as the core's facts, and
the capture program's buffer decisions carried out.

The core (:func:`gograph.core._plan.capture_program`) decides, per pass, where each static input and
each grad-output buffer comes from (the pass's own, a slot shared by liveness with
``_reuse_graph_input_output_buffers``, or, with ``chain_buffers``, the previous layer's output /
the next layer's input grad), when each pool buffer dies, and how each parameter grad reaches
``.grad``. This module writes the facts (:func:`facts`), backs slots with tensors
(:func:`slot_tensors`), and hands dead pool buffers back (:func:`release`). Nothing here decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..core._kinds import BufferSource, CaptureOp, GradPolicy, ReleaseRole
from ..core._wire import CaptureProgram, Facts, Op
from ..replay._buffer_reuse import BufferReuse
from ..replay._regions import Region, overlapping
from ..support import _torch

if TYPE_CHECKING:  # pragma: no cover
    from ._state import PassState

__all__ = [
    "Signatures",
    "buffer_reuse",
    "facts",
    "grad_output_slot",
    "release",
    "sample_regions",
    "signature_text",
    "slot_eligible",
    "slot_tensors",
    "tensor_signature",
]


def tensor_signature(t: Tensor) -> tuple[Any, ...]:
    """What must be equal for two buffers to be one: shape, strides, dtype, device."""
    return (tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def te_signature(t: Tensor) -> tuple[Any, ...]:
    """TransformerEngine's reuse key of one tensor (shape, dtype, layout)."""
    return (tuple(t.shape), t.dtype, t.layout)


def signature_text(sig: tuple[Any, ...]) -> str:
    shape, stride, dtype, device = sig
    return f"{list(shape)} {str(dtype).replace('torch.', '')} {device}" + (
        "" if _contiguous_strides(shape) == tuple(stride) else f" strides {list(stride)}"
    )


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def slot_eligible(t: Tensor) -> bool:
    """A sample tensor can back (or move into) a shared slot: a dense leaf that is its whole
    storage (a view of it would lose a non-leaf's autograd history)."""
    if t.layout != torch.strided or (t.requires_grad and not t.is_leaf) or isinstance(t, torch.nn.Parameter):
        return False
    if t.storage_offset() != 0 or t.numel() == 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return False
    expected = 1  # non-overlapping and dense: the strides, sorted, are the running products of the sizes
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class Signatures:
    """Small ids for tensor signatures (the core compares ints)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[Any, ...], int] = {}

    def id(self, sig: tuple[Any, ...]) -> int:
        return self.ids.setdefault(sig, len(self.ids))

    def text(self, sig_id: int) -> str:
        inverse = {v: k for k, v in self.ids.items()}
        return signature_text(inverse[sig_id])


def facts(states: Sequence[PassState], sigs: Signatures, clone_param_grads: bool) -> Facts:
    """What warmup learned about each pass, in the core's facts format (docs/CORE_API.md)."""
    occurrences: dict[int, int] = {}
    params: set[int] = set()
    for st in states:
        for t in st.flat_args:
            occurrences[id(t)] = occurrences.get(id(t), 0) + 1
        params.update(id(p) for p in st.params)
    regions = sample_regions(states)
    param_ids: dict[int, int] = {}
    te_in: dict[tuple[Any, ...], int] = {}
    te_grad: dict[tuple[Any, ...], int] = {}
    lines: list[str] = []
    for st in states:
        p, spec = st.index, st.spec
        in_key = te_in.setdefault(tuple(te_signature(t) for t in st.flat_args), len(te_in))
        grad_key = te_grad.setdefault(tuple((m[0][0], m[0][2]) for m in st.output_meta if m[1]), len(te_grad))
        lines.append(f"pass {p} {int(st.captures_backward)} {int(st.may_need_dw)} {spec.n_pos} {in_key} {grad_key}")
        for j, t in enumerate(st.flat_args):
            region, in_param = regions.get((p, j), (0, False))
            unique = occurrences[id(t)] == 1 and id(t) not in params and region == 0
            lines.append(
                f"in {p} {sigs.id(tensor_signature(t))} {int(t.requires_grad)} {int(unique)} "
                f"{int(unique and slot_eligible(t))} {region} {int(in_param)}"
            )
        for sig, rg in st.output_meta:
            lines.append(f"out {p} {sigs.id(sig)} {int(rg)}")
        if clone_param_grads and st.captures_backward:
            n = len(st.flat_args)
            for k, prm in enumerate(st.params):
                if prm.requires_grad and not getattr(prm, "skip_backward_post_hook", False):
                    pid = param_ids.setdefault(id(prm), len(param_ids))
                    lines.append(f"pg {p} {n + k} {pid} {sigs.id(tensor_signature(prm))}")
    return Facts(tuple(lines))


def slot_tensors(states: Sequence[PassState], program: CaptureProgram) -> dict[int, Tensor]:
    """The slots inputs use: the sample tensor of the first pass whose input uses it. A slot only
    grad outputs use is made when the first backward using it is captured
    (:func:`grad_output_slot`)."""
    backing: dict[int, Tensor] = {}
    for (p, j), src in sorted(program.inputs.items()):
        if src.kind is BufferSource.SLOT and src.slot not in backing:
            backing[src.slot] = states[p].flat_args[j]
    return backing


def grad_output_slot(slots: dict[int, Tensor], slot: int, st: PassState, k: int) -> Tensor:
    """Slot ``slot``, made now (zeros of output ``k``'s signature, outside any graph pool) if no
    earlier capture made it: its bytes then count in the first backward capture that copies into
    it, as a grad-output buffer of its own would."""
    t = slots.get(slot)
    if t is None:
        shape, stride, dtype, device = st.output_meta[k][0]
        t = slots[slot] = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
    return t


def _weak(t: Tensor) -> Tensor:
    return _torch.nonowning_view(t).requires_grad_(t.requires_grad)


def release(op: Op, states: Sequence[PassState], keep_owners: bool) -> list[Tensor]:
    """Drops gograph's owning references to a pool buffer the core proved dead, keeping
    non-owning views for the graphs' static tensors (later captures may reuse its memory), and
    returns the buffer (none when the role has no tensor). A chained buffer has two holders -- an
    output and the next layer's static input, or a user input's grad and the previous layer's
    grad output: both let go. ``keep_owners`` (host memory, which goes with its last owner):
    the references stay, only the release is recorded."""
    st = states[op.pass_index]
    assert op.role is not None  # a release op names its buffer's role
    st.released.add((op.role, op.buffer))
    if op.role is ReleaseRole.OUTPUT:
        old = st.static_outputs[op.buffer]
        if keep_owners:
            return [old]
        st.static_outputs = _replaced(st.static_outputs, op.buffer, _weak(old))
        for other in states:  # chained consumers read it as their static input
            repl = {j: _weak(other.flat_args[j]) for j in other.chained_inputs
                    if other.flat_args[j].data_ptr() == old.data_ptr()}  # fmt: skip
            other.replace_args(repl)
        return [old]
    grad = st.static_grad_inputs[op.buffer] if op.buffer < len(st.static_grad_inputs) else None
    if grad is None or keep_owners:
        return [] if grad is None else [grad]
    st.static_grad_inputs = _replaced(st.static_grad_inputs, op.buffer, _weak(grad))
    for other in states:  # a chained producer reads it as its grad output
        for k, g in enumerate(other.static_grad_outputs):
            if g is grad:
                other.static_grad_outputs = _replaced(other.static_grad_outputs, k, _weak(g))
    return [grad]


def _replaced(items: tuple[Any, ...], i: int, value: Any) -> tuple[Any, ...]:
    return (*items[:i], value, *items[i + 1 :])


def buffer_reuse(program: CaptureProgram, sigs: Signatures) -> BufferReuse:
    """The :class:`BufferReuse` summary of ``program``'s buffer plan (``sigs`` names its tensor
    signatures)."""
    signatures = {
        sigs.text(s): {"buffers": b, "slots": n, "te_fifo": te} for s, (b, n, te) in sorted(program.sigs.items())
    }
    return BufferReuse(
        signatures=signatures,
        slots=program.slots,
        te_fifo=sum(d["te_fifo"] for d in signatures.values()),
        buffers=sum(d["buffers"] for d in signatures.values()),
        released=sum(1 for op in program.ops if op.kind is CaptureOp.RELEASE),
        chained=sum(
            1 for s in (*program.inputs.values(), *program.grad_outputs.values()) if s.kind is BufferSource.CHAINED
        ),
        lent_param_grads=sum(1 for v in program.grad_policy.values() if v is GradPolicy.LEND),
    )


def sample_regions(states: Sequence[PassState]) -> dict[tuple[int, int], Region]:
    """Per (pass index, input leaf): the region of memory its sample shares with other input
    leaves or parameters (of the graphed modules, and any ``nn.Parameter`` passed as a sample),
    numbered from 1 in address order, and whether a parameter is in it. Leaves that share
    nothing are absent. Byte ranges that overlap (or are equal) are one region; views of one
    tensor that do not overlap are not."""
    tensors: list[tuple[tuple[int, int] | None, Tensor]] = []
    params: dict[int, Tensor] = {}
    for st in states:
        for j, t in enumerate(st.flat_args):
            tensors.append(((st.index, j), t))
            if isinstance(t, torch.nn.Parameter):  # some module's weights, graphed or not
                params[id(t)] = t
        params.update((id(p), p) for p in st.params)
    tensors.extend((None, p) for p in params.values())
    out: dict[tuple[int, int], Region] = {}
    region = 0
    for group in overlapping(tensors):
        leaves = [leaf for leaf in group if leaf is not None]
        if not leaves:
            continue
        region += 1
        param = len(leaves) < len(group)
        for leaf in leaves:
            out[leaf] = (region, param)
    return out
