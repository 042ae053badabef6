"""RNG companions: how a graph captured by the Go core gets torch's graph-safe random numbers.

Dropout inside a capture torch did not start raises "Attempt to increase offset for a CUDA
generator not in capture mode". A *companion* -- an empty ``torch.cuda.CUDAGraph`` whose relaxed
capture runs on a second stream around the Go core's capture -- registers the generators with
torch's graph machinery, so philox offsets are recorded graph-relative; replaying it before the
core's graph advances the offset and writes the seed/offset holders the kernels read
(verified bitwise against eager dropout, docs/DESIGN.md).

All companions of one engine capture into one pool, kept usable by an empty *anchor* graph:
every pool id costs ~42 KB of host memory in torch's allocators forever (bench/companion_rss.py),
and torch refuses to capture into a pool id whose last reference was released.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Hashable, Sequence

import torch

from ..support import _torch

__all__ = ["RngCompanions"]

log = logging.getLogger("gograph")


class _OnStream:
    """``with torch.cuda.stream(stream)`` through torch's raw stream calls."""

    __slots__ = ("prev", "stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.prev: tuple[int, int, int] | None = None

    def __enter__(self) -> None:
        s = self.stream
        self.prev = _torch.current_stream(s.device_index)
        _torch.set_stream(s.stream_id, s.device_index, s.device_type)

    def __exit__(self, *exc: object) -> None:
        prev, self.prev = self.prev, None
        if prev is not None:
            _torch.set_stream(*prev)


class RngCompanions:
    """The companions of one CUDA engine: begun and ended around captures that may consume
    generator state, kept by (pass id, kind), replayed before their graph, reset with it."""

    def __init__(self, device: torch.device, generators: Sequence[torch.Generator]) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.generators: list[torch.Generator] = list(generators)
        self.companions: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool: Hashable = None
        self._anchor: torch.cuda.CUDAGraph | None = None
        self._stale = False

    def begin(self) -> tuple[torch.cuda.CUDAGraph, Hashable]:
        """A companion whose capture is begun on the RNG stream, and its pool."""
        pool = self._anchored_pool()
        companion = torch.cuda.CUDAGraph()
        self._begin(companion, pool)
        return companion, pool

    def end(self, companion: torch.cuda.CUDAGraph, pool: Hashable) -> None:
        """Ends a companion's capture. When torch's capture_end fails (its stream capture was
        invalidated) torch leaves the pool among the captures underway and the generators in
        capture mode (every later eager RNG call would raise): both are undone before the error
        propagates."""
        with _OnStream(self.stream), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty": by design
            try:
                companion.capture_end()
            except Exception:
                self._undo(pool)
                raise

    def keep(self, pass_id: int, kind: int, companion: torch.cuda.CUDAGraph) -> None:
        self.companions[(pass_id, kind)] = companion

    def release(self, pass_id: int, kinds: Sequence[int]) -> None:
        for kind in kinds:
            companion = self.companions.pop((pass_id, kind), None)
            if companion is not None:
                companion.reset()

    def _anchored_pool(self) -> Hashable:
        """The companions' pool, anchored by an empty graph captured into it once (the anchor
        also keeps torch's graph-safe seed and offset slots allocated for the engine's life).
        After a failed companion the pool is replaced: the new anchor is captured before the
        old one goes."""
        if self.pool is None or self._stale:
            pool = torch.cuda.graph_pool_handle()
            anchor = torch.cuda.CUDAGraph()
            with torch.cuda.device(self.device):
                self._begin(anchor, pool)
                self.end(anchor, pool)
            self._anchor, self.pool, self._stale = anchor, pool, False
        return self.pool

    def _begin(self, companion: torch.cuda.CUDAGraph, pool: Hashable) -> None:
        """Begins a relaxed capture on the RNG stream; if torch fails part-way (it puts the
        generators in capture mode and routes the pool before it begins the stream capture),
        both are undone."""
        for gen in self.generators:
            companion.register_generator_state(gen)
        with _OnStream(self.stream):
            try:
                companion.capture_begin(pool=pool, capture_error_mode="relaxed")  # type: ignore[arg-type]
            except Exception:
                self._undo(pool)
                raise

    def _undo(self, pool: Hashable) -> None:
        # A failed companion can leave its pool marked as being recorded to, and torch refuses
        # to begin another capture into that pool: later companions get a fresh anchored pool.
        if pool == self.pool:
            self._stale = True
        try:
            _torch.end_allocate_to_pool(self.device.index or 0, pool)
        except Exception as e:
            log.debug("companion pool cleanup: %s", str(e))
        try:
            # A throwaway capture runs the generators' capture prologue and epilogue, which takes
            # them out of capture mode.
            with torch.cuda.stream(self.stream), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scratch = torch.cuda.CUDAGraph()
                for gen in self.generators:
                    scratch.register_generator_state(gen)
                scratch.capture_begin(capture_error_mode="relaxed")
                scratch.capture_end()
                scratch.reset()
        except Exception as e:
            log.warning("could not take the CUDA generators out of capture mode: %s", str(e))
