"""Owned copies of one backward's parameter grads, packed in one allocation.

When ``.grad`` is None a graphed backward hands AccumulateGrad an owned copy of each parameter
grad (never the static buffer a later replay overwrites: pytorch#181723). Eager training gets
those grads from the backward kernels themselves, in the caching allocator's pool next to the
activations, whose smaller blocks fill the gaps the grads' segments leave. A graphed step has its
activations in the graph pool, so the default pool holds the caller's tensors and these copies
only, and copies of 1 to 10 MiB are carved from 20 MiB segments (two 8 MiB grads leave 4 MiB of
each free). One allocation per backward, sized to the sum, takes a segment of its own rounded to
2 MiB instead (the pipeline footprint cell: 16 MiB less at the peak), and one
``_foreach_copy_`` fills it.

Aliasing: each copy is a view of the packed buffer (as DDP's ``gradient_as_bucket_view`` grads
and Megatron's grad buffers are). The buffer is freed when the last of them dies, so dropping
some of a backward's ``.grad`` keeps the bytes until the rest go too; ``zero_grad(set_to_none=
True)`` drops them all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: The caching allocator's block alignment: every packed copy starts where a block would.
ALIGN = 512
#: Below this a packed buffer saves nothing: the allocator's small pool packs sub-MiB blocks.
MIN_PACK_BYTES = 1 << 20


def owned_copies(grads: Sequence[Tensor]) -> list[Tensor]:
    """Copies of ``grads`` (same shapes, dtypes, strides and values) that share no memory with
    them: views of one new buffer when there are several contiguous grads on one device adding up
    to at least ``MIN_PACK_BYTES``, otherwise ``clone()`` each. Outside autograd recording only
    (a ``create_graph`` backward's grads need their clone's graph): there it clones each."""
    packable = len(grads) > 1 and not torch.is_grad_enabled() and _one_device_contiguous(grads)
    if not packable or sum(g.nbytes for g in grads) < MIN_PACK_BYTES:
        return [g.clone() for g in grads]
    offsets, total = [], 0
    for g in grads:
        offsets.append(total)
        total += -(-g.nbytes // ALIGN) * ALIGN
    flat = torch.empty(total, dtype=torch.uint8, device=grads[0].device)
    copies = [flat[o : o + g.nbytes].view(g.dtype).view(g.shape) for o, g in zip(offsets, grads)]
    torch._foreach_copy_(copies, list(grads))
    return copies


def _one_device_contiguous(grads: Sequence[Tensor]) -> bool:
    device = grads[0].device
    return all(g.device == device and g.is_contiguous() and g.layout == torch.strided for g in grads)
