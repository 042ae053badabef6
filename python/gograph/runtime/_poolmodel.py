"""The eager engine's model of CUDA's graph pools: where each block of a capture would be, and
what a replay would overwrite.

On CUDA every capture of a build allocates in one graph pool, and a block that one capture frees
(a temporary, a buffer the plan released) can be carved again by a later capture: the earlier
graph still writes it at every replay. The eager engine has no pool, so it cannot show what that
does. With its pool model on (``EagerEngine(pool_model=True)``) it reports, while each capture
runs, every storage an op creates and every one that dies to the core's model of the caching
allocator (``internal/poolmodel``, as ``internal/allocsim`` models it), which places each block
where CUDA's allocator would. Then, right before a replay of graph G, every storage that is still
alive on the host and whose modelled block G's capture allocated -- another graph's output,
saved tensor or handed-out buffer on CUDA -- is overwritten (bytes 0xFF: NaN for floats), as G's
replay would overwrite it. Saved activations are followed to the replay that made them: the
tensors a forward replay saves take the blocks its capture saved, in the order autograd saved
them. The existing oracles (values, canaries) then see on the CPU what CUDA would give.

Nothing here decides: the core places, the build plans; this module only records and writes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core import _core

__all__ = ["Block", "FreeBlock", "PoolModel", "Range", "hold_requests"]

Range = tuple[int, int]  # [start, end) in model addresses
Graph = tuple[int, int]  # (pass id, kind)
FreeBlock = tuple[int, int, bool]  # [start, end), and whether it is in the small pool

#: The caching allocator's largest small-pool request (kSmallSize): a small-pool block is only
#: ever given to requests up to it, whatever its own size.
SMALL_REQUEST = 1 << 20
#: Rounds of requests that take a pool's free blocks (one is enough but for best-fit ties).
HOLD_ROUNDS = 4


@dataclass
class Block:
    """One storage a capture created: its modelled range, its pool, the graph whose capture
    allocated it, and the host storage (weakly)."""

    id: int
    range: Range
    pool: str
    graph: Graph | None
    ref: StorageWeakRef
    freed: bool = False  # freed in the model (dead on the host, or released by the plan)
    freed_at: int = -1  # the model's clock when it was freed

    def alive(self) -> bool:
        return not self.ref.expired()


@dataclass
class _ForwardSaves:
    """What a forward's capture saved (the blocks, in autograd's order) and what its latest replay
    saved in their place (weakly)."""

    blocks: list[Block | None] = field(default_factory=list)
    replayed: list[weakref.ReferenceType[torch.Tensor]] = field(default_factory=list)


class PoolModel:
    """One engine's model of its graph pools (see the module docstring). Not thread-safe: the
    eager engine captures and replays on the calling thread."""

    def __init__(self) -> None:
        self.handle = int(_core.pool_model_new())
        self._finalizer = weakref.finalize(self, _core.pool_model_drop, self.handle)
        self._next = 0
        self._live: dict[int, Block] = {}  # storage address on the host -> its block (host-alive)
        self.blocks: list[Block] = []  # every block recorded, in order
        self.writes: dict[Graph, list[Block]] = {}  # what each graph's capture allocated
        self._saves: dict[int, _ForwardSaves] = {}  # pass id -> its forward's saves
        self.clock = 0  # counts the model's events
        self.began: dict[Graph, int] = {}  # when each graph's capture began

    # -- recording --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def window(self, pool: str, graph: Graph | None = None) -> Iterator[None]:
        """Records every storage created in the block as allocated in ``pool`` (by ``graph``'s
        capture), and every recorded storage that dies meanwhile as freed, in order."""
        self.collect()
        if graph is not None:
            self.began[graph] = self.clock
        with _Recorder(self, pool, graph):
            yield
        self.collect()

    def _new_storage(self, storage: torch.UntypedStorage, pool: str, graph: Graph | None) -> None:
        ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
        old = self._live.get(ptr)
        if old is not None and old.alive():
            return  # known (a view, or an in-place result)
        self.collect()
        ident, self._next = self._next, self._next + 1
        self.clock += 1
        text = str(_core.pool_model_apply(self.handle, f"a {ident} {nbytes} {pool}\n"))
        _, start, end = (int(x) for x in text.split())
        block = Block(ident, (start, end), pool, graph, StorageWeakRef(storage))
        self._live[ptr] = block
        self.blocks.append(block)
        if graph is not None:
            self.writes.setdefault(graph, []).append(block)

    def collect(self) -> None:
        """Frees in the model the recorded storages that died on the host."""
        dead = [ptr for ptr, b in self._live.items() if not b.alive()]
        events = []
        for ptr in dead:
            b = self._live.pop(ptr)
            if not b.freed:
                self.clock += 1
                b.freed, b.freed_at = True, self.clock
                events.append(f"f {b.id}")
        if events:
            _core.pool_model_apply(self.handle, "\n".join(events) + "\n")

    def release(self, tensor: torch.Tensor) -> None:
        """The plan released ``tensor``'s buffer: free in the pool from here (later captures may
        carve it), though the host keeps it for whoever still reads it."""
        b = self._live.get(int(tensor.untyped_storage().data_ptr()))
        if b is not None and not b.freed:
            self.clock += 1
            b.freed, b.freed_at = True, self.clock
            _core.pool_model_apply(self.handle, f"f {b.id}\n")

    def hold(self, pool: str) -> list[int]:
        """Takes every free block of ``pool`` in the model (:func:`hold_requests`), so its next
        allocation gets new memory; returns what :meth:`release_held` frees."""
        ids: list[int] = []
        for _ in range(HOLD_ROUNDS):
            sizes = hold_requests(self.free_blocks(pool))
            if not sizes:
                break
            new = list(range(self._next, self._next + len(sizes)))
            self._next += len(sizes)
            _core.pool_model_apply(self.handle, "".join(f"a {i} {n} {pool}\n" for i, n in zip(new, sizes)))
            ids += new
        return ids

    def release_held(self, ids: list[int]) -> None:
        """Frees what :meth:`hold` took."""
        if ids:
            _core.pool_model_apply(self.handle, "".join(f"f {i}\n" for i in ids))
            ids.clear()

    def free_blocks(self, pool: str) -> list[FreeBlock]:
        """The memory of ``pool`` a request may be given now: (start, end, small pool?)."""
        self.collect()
        text = str(_core.pool_model_free_ranges(self.handle, pool))
        return [(int(a), int(b), c == "1") for a, b, c in (line.split() for line in text.splitlines())]

    def free_ranges(self, pool: str) -> list[Range]:
        """The memory of ``pool`` a request may be given now."""
        return [(s, e) for s, e, _ in self.free_blocks(pool)]

    def block(self, t: torch.Tensor) -> Block | None:
        """The block of ``t``'s storage (None: not a storage a capture made)."""
        b = self._live.get(int(t.untyped_storage().data_ptr()))
        return b if b is not None and b.alive() else None

    def range_of(self, t: torch.Tensor) -> Range | None:
        """The modelled block of ``t``'s storage (None: not a storage a capture made)."""
        b = self.block(t)
        return b.range if b is not None else None

    def saved_blocks(self, pass_id: int, graph: Graph) -> list[Block]:
        """The blocks a pass's forward capture saved (in the pool) that were still allocated when
        ``graph``'s capture began: a backward frees what autograd saved, so a weight-gradient graph
        reads only what its backward kept."""
        saves = self._saves.get(pass_id)
        began = self.began.get(graph, self.clock)
        if saves is None:
            return []
        return [b for b in saves.blocks if b is not None and not (b.freed and b.freed_at <= began)]

    # -- saved activations ------------------------------------------------------------------------
    def saving_capture(self, pass_id: int) -> contextlib.AbstractContextManager[None]:
        """While a forward is captured: notes the blocks autograd saves, in order."""
        saves = self._saves[pass_id] = _ForwardSaves()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saves.blocks.append(self._live.get(int(t.untyped_storage().data_ptr())))
            # detached: an op's own output saved as itself would hold its grad_fn, a reference
            # cycle through autograd's C++ nodes that no collector frees
            return t.detach()

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def saving_replay(self, pass_id: int) -> contextlib.AbstractContextManager[None]:
        """While a forward replays: notes what it saves in place of its capture's saves."""
        saves = self._saves.get(pass_id)
        if saves is None:
            return contextlib.nullcontext()
        saves.replayed = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept = t.detach()  # (see saving_capture) the storage autograd reads, held by it alone
            saves.replayed.append(weakref.ref(kept))
            return kept

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    # -- replay -----------------------------------------------------------------------------------
    def overwrite_before(self, graph: Graph) -> int:
        """Overwrites what a replay of ``graph`` would on CUDA: every host-alive storage another
        capture made whose block meets one ``graph``'s capture allocated, and every saved tensor of
        a pending forward replay whose capture block meets one. Returns how many were written."""
        writes = [b.range for b in self.writes.get(graph, ())]
        if not writes:
            return 0
        written = 0
        for b in list(self._live.values()):
            if b.graph != graph and b.alive() and _meets(b.range, writes):
                storage = _storage(b.ref)
                if storage is not None:
                    written += _scribble(storage, b.range, writes)
        for pass_id, saves in self._saves.items():
            if pass_id == graph[0]:
                continue
            for cap, ref in zip(saves.blocks, saves.replayed):
                t = ref()
                if cap is not None and t is not None and _meets(cap.range, writes):
                    written += _scribble(t.untyped_storage(), cap.range, writes)
        return written

    def forget(self, pass_id: int) -> None:
        """A pass was reset: its saves go (its graphs write nothing any more)."""
        self._saves.pop(pass_id, None)
        for kind in (0, 1, 2):
            self.writes.pop((pass_id, kind), None)


class _Recorder(TorchDispatchMode):
    """Sees every op while a window is open: storages an op creates (not those of its inputs)
    are the pool's new blocks."""

    def __init__(self, model: PoolModel, pool: str, graph: Graph | None) -> None:
        super().__init__()
        self.model, self.pool, self.graph = model, pool, graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                if s.nbytes() > 0 and int(s.data_ptr()) not in inputs:
                    self.model._new_storage(s, self.pool, self.graph)
        return out


def hold_requests(free: Sequence[FreeBlock]) -> list[int]:
    """The requests that take every block of ``free``, largest first (the caching allocator
    gives each the best-fitting block): a block's size, or for a small-pool block above a small
    request, pieces of at most 1 MiB."""
    sizes: list[int] = []
    for s, e, small in free:
        n = e - s
        while small and n > SMALL_REQUEST:
            sizes.append(SMALL_REQUEST)
            n -= SMALL_REQUEST
        sizes.append(n)
    return sorted(sizes, reverse=True)


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass)
        return -1


def _meets(r: Range, writes: Sequence[Range]) -> bool:
    return any(r[0] < e and s < r[1] for s, e in writes)


def _storage(ref: StorageWeakRef) -> torch.UntypedStorage | None:
    if ref.expired():
        return None
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


def _scribble(storage: torch.UntypedStorage, block: Range, writes: Sequence[Range]) -> int:
    """Writes 0xFF over the bytes of ``storage`` (modelled at ``block``) that ``writes`` meet;
    through a byte view of its own, so no tensor's version counter moves (a kernel's write)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    n = 0
    for s, e in writes:
        lo, hi = max(s, block[0]) - block[0], min(e, block[1]) - block[0]
        hi = min(hi, raw.numel())
        if lo < hi:
            raw[lo:hi].fill_(255)
            n = 1
    return n
