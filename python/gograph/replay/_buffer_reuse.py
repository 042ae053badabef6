"""What the core planned for the static buffers of one ``make_graphed_callables`` call, as the
callables it returned report it (``buffer_reuse``; computed by :func:`gograph.build._reuse.buffer_reuse`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BufferReuse"]


@dataclass
class BufferReuse:
    """How the core planned the static buffers of one ``make_graphed_callables`` call (attribute
    ``buffer_reuse`` of every returned callable).

    * ``signatures``: per tensor signature (``"[4096, 1024] bfloat16 cuda:0"``), a dict with
      ``buffers`` (static inputs and grad outputs that would exist without reuse), ``slots``
      (what this plan needs, by liveness over the schedule) and ``te_fifo`` (what
      TransformerEngine's FIFO scheme keeps for the same buffers);
    * ``slots``, ``te_fifo``, ``buffers``: their sums;
    * ``released``: pool buffers handed back to the graph pool once their last capture-time
      reader is captured (CUDA engine);
    * ``chained``: static inputs that read the previous layer's output in place, and grad
      outputs that are the next layer's input grad (``chain_buffers``);
    * ``lent_param_grads``: parameter grads whose static buffer is lent to ``.grad``.
    """

    signatures: dict[str, dict[str, int]]
    slots: int
    te_fifo: int
    buffers: int
    released: int = 0
    chained: int = 0
    lent_param_grads: int = 0

    def __repr__(self) -> str:
        return (
            f"BufferReuse(slots={self.slots}, te_fifo={self.te_fifo}, buffers={self.buffers}, "
            f"released={self.released}, chained={self.chained}, signatures={self.signatures})"
        )
