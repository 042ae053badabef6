"""Owned copies of one backward's parameter grads, laid out for the caching allocator.

When ``.grad`` is None a graphed backward hands AccumulateGrad an owned copy of each parameter
grad (never the static buffer a later replay overwrites: pytorch#181723). Those copies live in
the caching allocator's default pool beside the caller's tensors (the activations are in the
graph pool), so their sizes decide what a step reserves. Two layouts, each measured where it is
used (docs/benchmarks-history.md):

* **natural** (the default schedule, whose copies are made at the first step only, then lent or
  accumulated into): a grad of 1 MiB or more is an allocation of its own, of the parameter's size,
  as eager's backward makes it; blocks of the model's own sizes fit the blocks the caller's tensors
  of the same model freed (a loss's temporaries, the last batch), as eager's grads fit its freed
  activations. One packed allocation per backward does not: on 8 per-layer MLPs 4096-4096-4096
  (bf16, H200) its 64 MiB + 16 KiB blocks missed the 64 MiB holes, and the first step reserved
  198 MiB more with ``zero_grad(set_to_none=True)`` and 326 MiB more with ``False``.
* **packed** (``_order`` schedules, whose copies are made at every step's first microbatch): one
  allocation per backward, sized to the sum: copies of 1 to 10 MiB would be carved from 20 MiB
  segments two at a time, where one buffer takes a segment of its own rounded to 2 MiB (the
  pipeline cell: 16 MiB less at the peak).

Either way grads under 1 MiB (biases, norms) are packed together when they add up to 1 MiB or more
(below that the allocator's small pool packs them as well, from 2 MiB segments).

Aliasing: a packed copy is a view of its backward's buffer, freed when the last of them dies
(``zero_grad(set_to_none=True)`` drops them all); a natural copy is a tensor of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: The caching allocator's block alignment: every packed copy starts where a block would.
ALIGN = 512
#: Grads at or above this get a copy of their own; the ones below are packed together.
MIN_OWN_BYTES = 1 << 20


def owned_copies(grads: Sequence[Tensor], natural: bool = False) -> list[Tensor]:
    """Copies of ``grads`` (same shapes, dtypes, strides and values) that share no memory with
    them. ``natural``: ``clone()`` for each grad of ``MIN_OWN_BYTES`` or more; otherwise those too
    are packed. The packed ones are views of one new buffer when there are several contiguous ones
    on one device adding up to ``MIN_OWN_BYTES`` or more (else clones). Inside autograd recording
    (a ``create_graph`` backward, whose grads need their clone's graph) each is cloned."""
    out = list(grads)
    small = [i for i, g in enumerate(grads) if not natural or g.nbytes < MIN_OWN_BYTES]
    packed = [grads[i] for i in small]
    packable = len(small) > 1 and not torch.is_grad_enabled() and _one_device_contiguous(packed)
    if packable and sum(g.nbytes for g in packed) < MIN_OWN_BYTES:
        packable = False  # the allocator's small pool packs sub-MiB blocks: nothing to gain
    chosen = set(small) if packable else set()
    for i, g in enumerate(grads):
        if i not in chosen:
            out[i] = g.clone()
    if packable:
        for i, c in zip(small, _packed(packed)):
            out[i] = c
    return out


def _packed(grads: Sequence[Tensor]) -> list[Tensor]:
    """Copies of ``grads`` as views of one new buffer, each starting at a block boundary, filled
    by one ``_foreach_copy_``."""
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
