"""Static outputs out of the memory other graphs write.

A forward's static output is the caller's until that callable's next forward (torch's rule). On
CUDA it is a block of the graph pool, and a block a capture takes may be one an earlier capture
freed (a temporary of its forward, a buffer the plan released): that earlier graph writes it at
every replay, so the next forward of *another* callable would change an output the caller still
holds (the next microbatch's first layer, an evaluation output held across a training step).

So each forward capture looks, before its body runs, at which memory of its pool is free -- all
of it was written by earlier captures, or by none -- and after the body, at where each output
landed. An output that landed in such memory gets a buffer of its own, in memory no capture of the
pool had (every free block of the pool held while it is allocated: a new segment), and the
graph copies the output there as its last node: that buffer is the static output. Outputs the
plan releases (``_reuse_graph_input_output_buffers``: valid until the schedule reuses them) are
left alone. The CUDA engine reads its pool from the caching allocator; the eager engine with its
pool model (:mod:`gograph.runtime._poolmodel`) from the model, and does the same.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from torch import Tensor

from .engines import Engine

__all__ = ["IsolatingBody"]

Range = tuple[int, int]


class IsolatingBody:
    """A forward body whose outputs, where they landed in memory earlier captures of ``pool``
    wrote, get a buffer of their own (see the module docstring). It returns the body's outputs and
    then those buffers, in output order (:attr:`isolated` says whose). At capture it decides; on
    the eager engine a replay re-runs it, which repeats the decision's copies."""

    def __init__(self, body: Any, engine: Engine, pool: Hashable, released: frozenset[int]) -> None:
        self.body, self.engine, self.pool, self.released = body, engine, pool, released
        self.isolated: tuple[int, ...] | None = None  # decided at capture

    @property
    def out_spec(self) -> Any:
        return self.body.out_spec

    @property
    def module(self) -> Any:
        return getattr(self.body, "module", None)

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if self.isolated is not None:  # an eager replay: the copies the graph makes
            outs = tuple(self.body(*args))
            return outs + tuple(outs[k].clone() for k in self.isolated)
        free = self.engine.pool_free_blocks(self.pool)
        outs = tuple(self.body(*args))
        carved = [k for k, o in enumerate(outs) if k not in self.released and _carved(self.engine, o, free)]
        self.isolated = tuple(carved)
        if not carved:
            return outs
        with self.engine.pool_plugged(self.pool):  # every free block held: new memory
            own = [outs[k].new_empty_strided(outs[k].size(), outs[k].stride()) for k in carved]
        for buf, k in zip(own, carved):
            buf.copy_(outs[k].detach())
        return outs + tuple(own)


def _carved(engine: Engine, o: Any, free: Sequence[Range]) -> bool:
    """Whether output ``o`` lies in memory that was free in the pool when its capture began."""
    if not isinstance(o, Tensor):
        return False
    r = engine.block_of(o)
    return r is not None and any(r[0] < e and s < r[1] for s, e in free)
