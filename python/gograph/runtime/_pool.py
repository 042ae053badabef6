"""Memory-pool tokens: what ``pool=`` may be, in one type and one check.

A token names the memory pool a build's captures share, also across ``make_graphed_callables``
calls: ``torch.cuda.graph_pool_handle()``'s pair of ints (a CUDA pool), a ``torch.cuda.MemPool``
(standing for its id, that pair), or an :class:`EagerPool` (the eager engine's own,
``gograph.graph_pool_handle()`` without CUDA). The eager engine also takes a CUDA pair, so that
calls passing one token share one pool whichever engine runs them. Nothing else is a token.
"""

from __future__ import annotations

import itertools
from typing import Any, Union

import torch

__all__ = ["EagerPool", "PoolToken", "check", "is_cuda_token"]


class EagerPool:
    """Opaque pool token of the eager engine (it allocates nothing from pools; the core counts
    the references captures take so that release can be checked)."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id: int = next(EagerPool._ids)

    def __repr__(self) -> str:
        return f"EagerPool({self.id})"


#: A pool token: a CUDA pool's pair of ints, or the eager engine's own.
PoolToken = Union[tuple[int, int], EagerPool]  # noqa: UP007 (a runtime alias on Python 3.10)

_WHAT = (
    "a token from gograph.graph_pool_handle() or torch.cuda.graph_pool_handle() (a pair of ints), or a "
    "torch.cuda.MemPool"
)


def is_cuda_token(pool: Any) -> bool:
    """``torch.cuda.graph_pool_handle()``'s token: a pair of non-negative ints, not (0, 0) (torch's
    id of no pool)."""
    return (
        isinstance(pool, tuple) and len(pool) == 2 and all(type(x) is int and x >= 0 for x in pool) and pool != (0, 0)
    )


def check(pool: Any, engine: str | None = None) -> PoolToken | None:
    """``pool`` as a token (a ``MemPool`` becomes its id), or None for None; raises TypeError
    saying what a token is for anything else. ``engine`` ("cuda" or "eager", once the engine is
    known) also refuses a token that engine cannot capture into: an :class:`EagerPool` on CUDA."""
    mem_pool = getattr(getattr(torch, "cuda", None), "MemPool", None)
    if mem_pool is not None and isinstance(pool, mem_pool):
        pool = tuple(pool.id)
    if pool is None:
        return None
    if is_cuda_token(pool) or (isinstance(pool, EagerPool) and engine != "cuda"):
        token: PoolToken = pool
        return token
    where = {"cuda": " for the CUDA engine", "eager": " (an EagerPool on the eager engine)"}.get(engine or "", "")
    raise TypeError(f"gograph: pool must be {_WHAT}{where}, or None; got {pool!r} (a {type(pool).__name__})")
