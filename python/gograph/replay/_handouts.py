"""Pool-planned buffers handed to the caller, watched in debug mode (the core's shared-pool
checker decides; ``internal/recarve``'s ``Clobbers``).

A pool-planned output or input grad goes back to the graph pool once the schedule is done with
it, so a later capture may re-carve its memory; that graph's replay then overwrites what the
caller was handed. In debug mode a replay hands out such a buffer as a fresh non-owning alias (a
storage of its own over the same bytes; the caller's tensor, its views and a ``.grad`` that
stole it share that storage), and the watch keeps a weak reference to that storage. When the core
says a replay overwrites it, a storage the caller still holds is made to raise the core's
message on any later read -- the "accessing tensor output of CUDAGraphs that has been
overwritten" error torch.compile gives its own outputs -- instead of handing out another graph's
bytes. Nothing here decides which replay overwrites what.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..core import _core
from ..core._kinds import GraphKind
from ..support import _torch

__all__ = ["WATCH", "HandoutWatch"]

log = logging.getLogger("gograph")

Graph = tuple[int, int]  # (pass id, kind)
_Key = tuple[int, int, int]  # (pass id, kind, index of the output or grad input)


class HandoutWatch:
    """Which outputs / grad inputs of each graph are pool-planned hand-outs, which of them some
    replay overwrites (the core's answer, cached until a build or a reset changes the specs), and
    the storages of the last ones handed out. One per process: graphs of any build may share a
    pool. Only a hand-out some replay overwrites is returned as an alias (a replay order where
    nothing re-carves costs one dict lookup per replay)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._graphs: dict[Graph, frozenset[int]] = {}  # every graph with a spec -> its hand-out indices
        self._clobbers: dict[Graph, list[tuple[_Key, str]]] | None = None  # None: ask the core again
        self._exposed: set[_Key] = set()  # hand-outs some replay overwrites
        self._live: dict[_Key, StorageWeakRef] = {}  # the storage last handed out

    def register(self, graph: Graph, indices: Iterable[int]) -> None:
        """Graph ``graph`` has a spec in the core; its replay hands out pool-planned buffers at
        ``indices`` of what it returns."""
        with self._lock:
            self._graphs[graph] = frozenset(indices)
            self._clobbers = None

    def watches(self, pass_id: int, kind: int) -> bool:
        """Whether the core's checker knows this graph (it may hand out or overwrite a hand-out)."""
        return (pass_id, kind) in self._graphs

    def after_replay(self, pass_id: int, kind: int, out: list[Any]) -> None:
        """Called right after graph (pass_id, kind) replayed, with what the replay returns (changed
        in place): poisons the hand-outs it overwrote, then hands out its exposed ones as fresh
        aliases."""
        clobbers = self._clobbers if self._clobbers is not None else self._refresh()
        for key, message in clobbers.get((pass_id, kind), ()):
            self._poison(key, message)
        for i in self._graphs.get((pass_id, kind), ()):
            t = out[i] if i < len(out) else None
            if t is None or (pass_id, kind, i) not in self._exposed:
                continue
            alias = _torch.nonowning_view(t).requires_grad_(t.requires_grad)
            out[i] = alias
            with self._lock:
                self._live[(pass_id, kind, i)] = StorageWeakRef(alias.untyped_storage())

    def _refresh(self) -> dict[Graph, list[tuple[_Key, str]]]:
        """Asks the core, for every known graph, which hand-outs its replay overwrites."""
        clobbers: dict[Graph, list[tuple[_Key, str]]] = {}
        for g in list(self._graphs):
            try:
                text = _core.replay_clobbers(*g)
            except RuntimeError as e:  # its pass is gone from the core (dropped without a reset)
                log.debug("hand-out watch drops pass %d: %s", g[0], e)
                with self._lock:
                    self._graphs.pop(g, None)
                continue
            lines = []
            for line in text.splitlines():
                owner, owner_kind, index, message = line.split(" ", 3)
                lines.append(((int(owner), int(owner_kind), int(index)), message))
            clobbers[g] = lines
        with self._lock:
            self._exposed = {key for lines in clobbers.values() for key, _ in lines}
            self._clobbers = clobbers
        return clobbers

    def _poison(self, key: _Key, message: str) -> None:
        with self._lock:
            ref = self._live.pop(key, None)
        if ref is None:
            return
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)  # None once nothing holds it
        if storage is not None:
            _torch.poison_storage(storage, message)

    def forget(self, pass_id: int) -> None:
        """Drops what the watch knows of a pass that is being reset. Its hand-outs the caller still
        holds are non-owning: their memory goes back with the pass's pool references, so reading
        one afterwards raises instead."""
        with self._lock:
            for g in [g for g in self._graphs if g[0] == pass_id]:
                del self._graphs[g]
                self._clobbers = None
            held = [k for k in self._live if k[0] == pass_id]
        for k in held:
            self._poison(k, f"gograph: this tensor is a pool-planned buffer that pass {pass_id}'s "
                         f"{GraphKind(k[1]).noun} handed out (index {k[2]}), and that graphed callable was reset "
                         "since: its memory went back with its graphs. Clone what must outlive reset()")  # fmt: skip

    def __len__(self) -> int:
        """How many handed-out storages are watched now (tests, leak checks)."""
        return len(self._live)


WATCH = HandoutWatch()
