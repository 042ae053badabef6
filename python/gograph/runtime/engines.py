"""Engines: how a pass's graphs are captured and replayed, on the GPU and on the CPU.

:func:`gograph.make_graphed_callables` executes its build through :class:`Engine`:

* :class:`CudaEngine` routes torch's allocations to a graph memory pool and runs the body while
  the Go core captures it on a side CUDA stream; replay launches the graph;
* :class:`EagerEngine` is the CPU reference: "capture" runs the body once and records it,
  "replay" re-runs it and copies its results into the static tensors capture returned, so every
  replay has exactly the aliasing semantics of a graph replay.

Both go through the same capture transaction in the Go core (``begin_pass_capture`` ->
body -> ``end_pass_capture``, or ``abort_pass_capture``; two core calls per capture), so the
lifecycle rules and the pool counts are the core's on both: a reset releases exactly the pool
references the pass's captures took, and the core says how many. Engines execute; they decide
nothing the core can.

Pass kinds (the core's numbering, :class:`gograph.core._kinds.GraphKind`): :data:`FORWARD` = 0,
:data:`BACKWARD` = 1, :data:`WGRAD` = 2 (plain ints: the replay path passes them to the core).
"""

from __future__ import annotations

import abc
import contextlib
import gc
import logging
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import _core, _native
from ..core._kinds import GraphKind
from ..support import _torch
from ..support._warn import warn_user
from . import _capture_state, _dry_run, _observe
from ._pool import EagerPool
from ._poolmodel import HOLD_ROUNDS, PoolModel, hold_requests
from ._rng import RngCompanions, _OnStream

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KIND_NAMES",
    "WGRAD",
    "CudaEngine",
    "EagerEngine",
    "EagerPool",
    "Engine",
    "capturing_on_this_thread",
    "default_cuda_engine",
    "default_eager_engine",
    "resolve_engine",
]

log = logging.getLogger("gograph")

FORWARD, BACKWARD, WGRAD = (int(k) for k in GraphKind)
#: Report names of the kinds ("forward", "backward", "wgrad"), by kind number.
KIND_NAMES = {int(k): k.key for k in GraphKind}
CAPTURE_MODE_GLOBAL = 0  # CUstreamCaptureMode, as torch.cuda.graph's default

Body = Callable[..., Sequence["torch.Tensor | None"]]
"""A capture body: runs torch work and returns a flat sequence of tensors (or None)."""


class _CaptureState(threading.local):
    """Per-thread count of the engine captures underway on this thread (any engine): a graphed
    callable called while it is non-zero would replay a graph inside another capture."""

    depth = 0


CAPTURE_STATE = _CaptureState()


def capturing_on_this_thread() -> bool:
    """True while an :meth:`Engine.capture` is underway on the calling thread."""
    return CAPTURE_STATE.depth > 0


class Engine(abc.ABC):
    """What :func:`gograph.make_graphed_callables` needs from a capture backend. Pool tokens are
    opaque to the build: whatever :meth:`new_pool` returns (or the user passed as ``pool``)."""

    #: "cuda" or "eager"
    name: str = "?"

    def __init__(self) -> None:
        self._capture_depth = 0
        self._deferred: list[tuple[int, Hashable]] = []

    # -- pools and passes -------------------------------------------------------------------
    @abc.abstractmethod
    def new_pool(self) -> Hashable:
        """A fresh memory-pool token shared by the captures of one make_graphed_callables."""

    def pool_key(self, pool: Hashable) -> str:
        """The core's name of ``pool``: equal for captures that share it."""
        return f"{self.name}/{pool!r}"

    def pool_refs(self, pool: Hashable) -> int:
        """References the live passes hold on ``pool``, as the core counts them."""
        return int(_core.pool_refs(self.pool_key(pool)))

    def new_pass(self, index: int, label: str) -> int:
        """The core's record of one graphed pass (state ``building``)."""
        if self._deferred and not self._must_defer():
            self._drain_deferred()
        return int(_core.new_pass(int(index), str(label)))

    def seal(self, pass_id: int) -> None:
        """``building -> ready``: the pass may now be replayed."""
        _core.seal_pass(pass_id)

    def capture(
        self,
        pass_id: int,
        kind: int,
        body: Body,
        *body_args: Any,
        pool: Hashable,
        uses_rng: bool | None = None,
        mode: int = CAPTURE_MODE_GLOBAL,
    ) -> tuple[tuple[torch.Tensor | None, ...], int]:
        """Captures ``body(*body_args)`` as graph ``kind`` of pass ``pass_id`` in ``pool`` and
        returns the body's results -- the *static* tensors every later replay of this kind
        overwrites in place -- and the capture's sequence number in the pool. ``uses_rng``:
        whether the body consumed generator state in warmup (None: unknown); ``mode`` the stream
        capture mode (0 global, 1 thread_local, 2 relaxed:
        ``capture_error_mode``). On failure nothing of this capture is attached to the pass; a pool
        reference it took stays with the pass (released by :meth:`release`). Finalizers that
        fire during the capture release their passes after it."""
        self._capture_depth += 1
        CAPTURE_STATE.depth += 1
        try:
            probe = _observe.CaptureProbe(self, pass_id, kind, pool, body)
            result, seq = self._capture(pass_id, kind, body, *body_args, pool=pool, uses_rng=uses_rng, mode=mode)
            probe.finished(seq)
            return result, seq
        finally:
            CAPTURE_STATE.depth -= 1
            self._capture_depth -= 1
            if self._capture_depth == 0 and self._deferred:
                self._drain_deferred()

    @abc.abstractmethod
    def _capture(
        self, pass_id: int, kind: int, body: Body, *body_args: Any, pool: Hashable, uses_rng: bool | None, mode: int
    ) -> tuple[tuple[torch.Tensor | None, ...], int]:
        """The engine's part of :meth:`capture`: the body's results and the capture's sequence
        number in the pool (from ``end_pass_capture``)."""

    @abc.abstractmethod
    def replay(self, pass_id: int, kind: int) -> None:
        """Replays graph ``kind`` of ``pass_id`` (RuntimeError from the core after a reset)."""

    def order(self, pass_id: int, kind: int) -> None:  # noqa: B027 (optional: engines with streams)
        """Orders the current stream after the previous replay of any graph the core orders with
        graph ``kind`` of ``pass_id``, before work that writes a buffer such a replay may still
        read (a grad-output buffer passes share). Nothing to order on one host thread without
        device streams."""

    def release(self, pass_id: int, pool: Hashable) -> None:
        """Destroys the pass's graphs and returns, on the allocator, the pool references the
        core says its captures took; the record stays (``reset``) so a later replay reports the
        reset. Harmless twice. A graph the driver failed to destroy raises after everything
        else was released."""
        refs = int(_core.reset_pass(pass_id))
        self._release_refs(pool, refs)
        self._forget(pass_id)
        failure = str(_core.pass_reset_error(pass_id))
        if failure:
            raise RuntimeError(failure)

    #: Whether forward captures keep static outputs out of memory earlier captures of their pool
    #: wrote (:mod:`gograph.runtime._isolation`): engines with a pool, or a model of one.
    isolates_outputs = False

    def pool_free_blocks(self, pool: Hashable) -> list[tuple[int, int]]:
        """The memory of ``pool`` a capture's allocation may be given now (engines with a pool)."""
        return []

    def block_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """Where ``t``'s storage lies, in the addresses :meth:`pool_free_blocks` speaks."""
        return None

    def hold_free_blocks(self, pool: Hashable, capturing: bool) -> Any:
        """Takes every free block of ``pool`` (as allocations of exactly their sizes), so that the
        pool's next allocations get new memory; ``capturing``: inside a capture into ``pool``
        (its allocations are routed there already). Returns what :meth:`release_hold` frees."""
        return None

    def release_hold(self, hold: Any) -> None:  # noqa: B027 (optional: engines with a pool)
        """Frees what :meth:`hold_free_blocks` took (None: nothing)."""

    @contextlib.contextmanager
    def pool_plugged(self, pool: Hashable) -> Iterator[None]:
        """Inside a capture into ``pool``: while open, every free block of the pool is held, so an
        allocation gets new memory."""
        hold = self.hold_free_blocks(pool, capturing=True)
        try:
            yield
        finally:
            self.release_hold(hold)

    #: Whether a pool buffer's memory outlives its owning tensor while the pool lives (a graph
    #: pool keeps its blocks mapped): then a buffer the core hands back keeps only non-owning
    #: views. Host memory goes with its last owner, so the eager engine keeps the owners.
    pool_keeps_released_memory = False

    def buffer_released(self, tensor: torch.Tensor) -> None:  # noqa: B027 (optional: engines modelling a pool)
        """The core proved ``tensor``'s pool buffer dead: later captures may carve its memory
        (the build has let go of it, or, without :attr:`pool_keeps_released_memory`, keeps it
        only so that a view a caller still holds stays readable)."""

    def drop(self, pass_id: int, pool: Hashable) -> None:
        """:meth:`release` and forget the core's record (finalizers, failed builds)."""
        try:
            self.release(pass_id, pool)
        finally:
            self._release_refs(pool, int(_core.drop_pass(pass_id)))

    def _release_refs(self, pool: Hashable, refs: int) -> None:  # noqa: B027 (optional: engines with device pools)
        """Returns ``refs`` pool references on the allocator (none to return without one)."""

    def _forget(self, pass_id: int) -> None:  # noqa: B027 (optional)
        """Drops engine-side state of a released pass."""

    def finalize_pass(self, pass_id: int, pool: Hashable) -> None:
        """Finalizer of a graphed callable: :meth:`drop` now, or right after the capture in
        progress (destroying graphs mid-capture is not allowed). Never raises."""
        if self._must_defer():
            self._deferred.append((pass_id, pool))
            return
        try:
            self.drop(pass_id, pool)
        except Exception as e:  # a finalizer must not raise
            log.warning("releasing pass %d in its finalizer failed: %s", pass_id, str(e))

    def _must_defer(self) -> bool:
        return self._capture_depth > 0

    def _drain_deferred(self) -> None:
        while self._deferred:
            self.finalize_pass(*self._deferred.pop())

    # -- warmup and RNG -----------------------------------------------------------------------
    @abc.abstractmethod
    def warmup_context(self, pool: Hashable | None = None) -> contextlib.AbstractContextManager[None]:
        """Context in which warmup iterations run (the side stream for CUDA). With ``pool`` an
        engine with device pools allocates warmup's memory in that graph pool and takes one
        reference on it, which :meth:`end_warmup_in_pool` returns once the captures hold theirs
        (a pool whose last reference went cannot be captured into again)."""

    def end_warmup_in_pool(self, pool: Hashable) -> None:  # noqa: B027 (optional: engines with device pools)
        """Returns the pool reference ``warmup_context(pool)`` took."""

    def release_cached(self) -> None:  # noqa: B027 (optional: engines with device pools)
        """Gives the memory the allocator caches outside graph pools back to the device."""

    def carve_seed(self, pool: Hashable, nbytes: int) -> bool:
        """Allocates one block of ``nbytes`` in ``pool`` and frees it before the first capture
        (engines with device pools), so the captures split their blocks out of that one free
        segment. True when it took a pool reference (:meth:`end_warmup_in_pool` returns it);
        an allocation the device cannot make is skipped, with the reference taken all the same."""
        return False

    @abc.abstractmethod
    def rng_marker(self) -> Hashable:
        """A value that changes when the body consumes generator state captures must carry."""

    @abc.abstractmethod
    def get_rng_state(self) -> Any:
        """Snapshot of the generator state graphing must not disturb."""

    @abc.abstractmethod
    def set_rng_state(self, state: Any) -> None:
        """Restores a :meth:`get_rng_state` snapshot."""

    def synchronize(self) -> None:  # noqa: B027 (optional: engines without a device)
        """Waits for device work (no-op on the eager engine)."""

    # -- introspection (memory report, logging) -----------------------------------------------
    def memory_allocated(self) -> int | None:
        """Bytes allocated on the engine's device now (None when not measurable)."""
        return None

    def max_memory_allocated(self) -> int | None:
        return None

    def pool_memory(self, pool: Hashable) -> tuple[int, int, int] | None:
        """(reserved, active, segments) of ``pool`` on the device, or None (no device pool)."""
        return None


class HeldSpans:
    """Where, in the allocator history a debug recorder is recording, the CUDA engine allocated
    blocks only to hold them from other allocations (no kernel writes them): the recorder leaves
    those allocations out of the graph's writes. Positions, not addresses: a block held once is
    an ordinary block of a later allocation at the same address. ``position`` (set by the
    recorder while it records) gives the history's current length."""

    def __init__(self) -> None:
        self.position: Callable[[], int] | None = None
        self.spans: list[tuple[int, int]] = []  # [start, end) positions of the holds' allocations


HELD = HeldSpans()


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------
class _OnDevice:
    """``with torch.cuda.device(index)`` through torch's raw calls; nothing when current."""

    __slots__ = ("index", "prev")

    def __init__(self, index: int) -> None:
        self.index = index
        self.prev = -1

    def __enter__(self) -> None:
        prev = _torch.get_device()
        if prev != self.index:
            _torch.set_device(self.index)
            self.prev = prev

    def __exit__(self, *exc: object) -> None:
        if self.prev >= 0:
            _torch.set_device(self.prev)
            self.prev = -1


class CudaEngine(Engine):
    """Captures with the Go core on a side CUDA stream of ``device``.

    One capture: (1) ``synchronize`` and ``empty_cache`` (as ``torch.cuda.graph`` does); (2) if
    the body may consume RNG, an RNG companion begins (:mod:`gograph.runtime._rng`); (3) on the side
    stream torch's allocations are routed to the pool, the core's transaction begins (pool
    reference counted, stream capture begun), the body runs, the core ends, instantiates and
    attaches the graph (or aborts); (4) the companion ends. Graphs are not uploaded ahead of
    their first launch (torch's are not either; an upload per capture cost ~45 us each).

    Replay: the companion's replay (philox offsets), then one core call launching the graph on
    the current stream.
    """

    name = "cuda"
    pool_keeps_released_memory = True

    def __init__(
        self,
        device: torch.device | int | str | None = None,
        generators: Sequence[torch.Generator] = (),
        stream: torch.cuda.Stream | None = None,
        isolate_outputs: bool = False,
    ) -> None:
        """``device``: the CUDA device of the captures (default: the current one).
        ``generators``: extra CUDA generators captures must carry (besides the default one, e.g.
        a tensor-parallel RNG tracker's). ``stream``: the side stream for warmup and capture
        (default: a new one); pass the stream a DistributedDataParallel model was constructed
        under (DDP's gradient accumulators record their stream at creation).
        ``isolate_outputs``: keep static outputs, and the default schedule's weight-gradient
        graphs, out of memory other graphs of the pool write (:mod:`gograph.runtime._isolation`). Off by
        default for now: each output it moves takes a new segment of its own, which the memory
        plan does not predict yet."""
        super().__init__()
        if not isinstance(isolate_outputs, bool):
            raise TypeError(f"CudaEngine: isolate_outputs must be a bool, got {type(isolate_outputs).__name__}")
        self.isolates_outputs = isolate_outputs
        if not _native.cuda_available():
            raise RuntimeError(
                "gograph: the CUDA engine needs the cuda flavor of the Go core, which is not loaded: "
                f"{_native.cuda_unavailable_reason()}"
            )
        if not torch.cuda.is_available():
            raise RuntimeError("gograph: the CUDA engine needs torch with CUDA; torch.cuda.is_available() is False")
        self.device = _cuda_device(device)
        self.device_index: int = int(self.device.index or 0)
        if stream is not None and stream.device != self.device:
            raise ValueError(f"gograph: CudaEngine stream is on {stream.device}, not on the engine's {self.device}")
        if stream is not None and int(stream.cuda_stream) == 0:
            raise ValueError(
                "gograph: CudaEngine cannot capture on the legacy default stream (0); "
                "pass a side stream such as torch.cuda.Stream()"
            )
        self.stream: torch.cuda.Stream = stream if stream is not None else torch.cuda.Stream(self.device)
        self.rng = RngCompanions(self.device, generators)

    def __repr__(self) -> str:
        return f"CudaEngine(device={self.device})"

    @property
    def generators(self) -> list[torch.Generator]:
        return self.rng.generators

    def register_generator(self, generator: torch.Generator) -> None:
        """Adds a CUDA generator whose state captures must carry."""
        if generator not in self.rng.generators:
            self.rng.generators.append(generator)

    def new_pool(self) -> Hashable:
        return torch.cuda.graph_pool_handle()

    def pool_key(self, pool: Hashable) -> str:
        return f"cuda/{pool!r}"

    def _must_defer(self) -> bool:
        # Also while a capture that is not ours (torch.cuda.graph in user code) is underway on
        # this thread's current stream: the release then waits for the next build.
        return self._capture_depth > 0 or bool(_torch.is_current_stream_capturing())

    def _capture(
        self, pass_id: int, kind: int, body: Body, *body_args: Any, pool: Hashable, uses_rng: bool | None, mode: int
    ) -> tuple[tuple[torch.Tensor | None, ...], int]:
        # Python's cyclic GC must not run while the stream captures: a collected cycle holding a
        # torch CUDAGraph destroys it mid-capture, which invalidates the capture (seen on the H200).
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            with _OnDevice(self.device_index):
                _torch.synchronize()
                _torch.empty_cache()  # as torch.cuda.graph: the pool can grow into cached blocks
                return self._capture_with_companion(pass_id, kind, body, body_args, pool, uses_rng is not False, mode)
        except Exception as e:
            explained = explain_capture_error(e)
            if explained is None:
                raise
            raise explained from e
        finally:
            if gc_enabled:
                gc.enable()

    def _capture_with_companion(
        self, pass_id: int, kind: int, body: Body, body_args: tuple[Any, ...], pool: Hashable, rng: bool, mode: int
    ) -> tuple[tuple[torch.Tensor | None, ...], int]:
        companion, companion_pool = self.rng.begin() if rng else (None, None)
        ok = False
        try:
            result, seq = self._transaction(pass_id, kind, body, body_args, pool, mode)
            ok = True
        finally:
            if companion is not None:
                try:
                    self.rng.end(companion, companion_pool)
                except Exception as e:
                    if ok:  # the graph is attached: the build's rollback resets the pass
                        raise
                    log.warning("ending the RNG companion after a failed capture: %s", str(e))
        if companion is not None:
            self.rng.keep(pass_id, kind, companion)
        return result, seq

    def _transaction(
        self, pass_id: int, kind: int, body: Body, body_args: tuple[Any, ...], pool: Hashable, mode: int
    ) -> tuple[tuple[torch.Tensor | None, ...], int]:
        """The core's capture transaction on the side stream, allocations routed to ``pool``."""
        idx, sid = self.device_index, int(self.stream.cuda_stream)
        with _OnStream(self.stream):
            _torch.begin_allocate_to_pool(idx, pool)  # one allocator reference on the pool
            try:
                _core.begin_pass_capture(pass_id, kind, self.pool_key(pool), sid, mode)
            except BaseException:
                _torch.end_allocate_to_pool(idx, pool)
                _torch.release_pool(idx, pool)  # the core counted nothing: the reference is ours
                raise
            try:
                try:
                    result = tuple(body(*body_args))
                except BaseException:
                    _abort(pass_id, kind, sid)
                    raise
                seq = int(_core.end_pass_capture(pass_id, kind, sid))
            finally:
                _torch.end_allocate_to_pool(idx, pool)
        return result, seq

    def pool_free_blocks(self, pool: Hashable) -> list[tuple[int, int]]:
        return [(s, e) for s, e, _ in _torch.pool_free_blocks(self.device_index, pool, int(self.stream.cuda_stream))]

    def block_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        s = t.untyped_storage()
        return int(s.data_ptr()), int(s.data_ptr()) + int(s.nbytes())

    def hold_free_blocks(self, pool: Hashable, capturing: bool) -> Any:
        # On the capture stream, routed to the pool: requests of the free blocks' sizes take them
        # (best fit, the largest first; _poolmodel.hold_requests), so nothing free is left.
        if capturing:
            return self._take_free(pool)
        idx = self.device_index
        with _OnDevice(idx), _OnStream(self.stream):
            _torch.begin_allocate_to_pool(idx, pool)
            try:
                return self._take_free(pool)
            finally:
                _torch.end_allocate_to_pool(idx, pool)
                _torch.release_pool(idx, pool)  # the routing's reference; the blocks hold the pool

    def _take_free(self, pool: Hashable) -> list[torch.Tensor]:
        held: list[torch.Tensor] = []
        stream = int(self.stream.cuda_stream)
        position = HELD.position
        start = position() if position is not None else 0
        for _ in range(HOLD_ROUNDS):
            sizes = hold_requests(_torch.pool_free_blocks(self.device_index, pool, stream))
            if not sizes:
                break
            held += [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        if position is not None:  # no kernel writes them: the debug recorder leaves them out
            HELD.spans.append((start, position()))
        return held

    def release_hold(self, hold: Any) -> None:
        if hold:
            hold.clear()

    def replay(self, pass_id: int, kind: int) -> None:
        # The hot path: one capture-status query, one raw current-stream query, one dict probe
        # (RNG companion: then a core ordering call before it), one core call.
        if _torch.is_current_stream_capturing():
            raise RuntimeError(
                f"gograph: cannot replay the {_noun(kind)} graph of pass {pass_id} while the "
                "current CUDA stream is capturing (inside torch.cuda.graph or another "
                "make_graphed_callables capture): a graphed callable cannot run inside a second capture. "
                "Graph the callables together in one make_graphed_callables call, or run the original "
                "(ungraphed) module inside the capture."
            )
        # The core orders the launch after the previous replay of any graph captured on our
        # stream when that ran on another stream (a shared cuBLAS workspace: internal/cudagraph).
        # A companion's seed/offset writes come first and must wait too (the previous replay's
        # dropout kernels read those holders), so the core orders the stream before them.
        stream = _torch.current_raw_stream(self.device_index)
        companions = self.rng.companions
        if companions:
            companion = companions.get((pass_id, kind))
            if companion is not None:
                _core.order_replay(pass_id, kind, stream)
                companion.replay()
        _core.raw_replay(pass_id, kind, stream)

    def order(self, pass_id: int, kind: int) -> None:
        _core.raw_order_replay(pass_id, kind, _torch.current_raw_stream(self.device_index))

    def _release_refs(self, pool: Hashable, refs: int) -> None:
        if refs <= 0:
            return
        # A replay on another thread may have launched between the caller's synchronize and the
        # reset: the pool's memory goes back only once the device is done with it.
        try:
            torch.cuda.synchronize(self.device)
        except Exception as e:  # the references must still be released
            log.warning("synchronize before releasing a pool: %s", str(e))
        for _ in range(refs):
            _torch.release_pool(self.device_index, pool)

    def _forget(self, pass_id: int) -> None:
        self.rng.release(pass_id, tuple(KIND_NAMES))

    @contextlib.contextmanager
    def warmup_context(self, pool: Hashable | None = None) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                if pool is None:
                    yield
                else:  # stream-scoped: autograd's device thread running the backward is routed too
                    _torch.begin_allocate_to_pool(self.device_index, pool)
                    try:
                        yield
                    finally:
                        _torch.end_allocate_to_pool(self.device_index, pool)
        torch.cuda.synchronize(self.device)

    def end_warmup_in_pool(self, pool: Hashable) -> None:
        self._release_refs(pool, 1)

    def release_cached(self) -> None:
        _torch.empty_cache()  # the cuBLAS workspaces stay: torch holds them (per handle and stream)

    def carve_seed(self, pool: Hashable, nbytes: int) -> bool:
        torch.cuda.synchronize(self.device)
        _torch.empty_cache()  # warmup's cached blocks go first: the seed is memory of its own
        with _OnDevice(self.device_index), _OnStream(self.stream):  # the captures' stream
            _torch.begin_allocate_to_pool(self.device_index, pool)  # one reference on the pool
            try:
                block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                del block
            except torch.OutOfMemoryError:
                log.info("no %.0f MiB for the graph pool's seed segment; capturing without", nbytes / 2**20)
            finally:
                _torch.end_allocate_to_pool(self.device_index, pool)
        return True

    def rng_marker(self) -> Hashable:
        default = torch.cuda.default_generators[self.device_index].get_offset()
        if not self.rng.generators:
            return default
        return (default, *(g.get_offset() for g in self.rng.generators))

    def get_rng_state(self) -> Any:
        return ([torch.cuda.get_rng_state(self.device)], [g.get_state() for g in self.rng.generators])

    def set_rng_state(self, state: Any) -> None:
        default_states, extra_states = state
        torch.cuda.set_rng_state(default_states[0], self.device)
        for gen, s in zip(self.rng.generators, extra_states):
            gen.set_state(s)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _allocated_bytes(self, which: str) -> int:
        try:
            return int(_torch.memory_stats(self.device_index)["allocated_bytes"]["all"][which])
        except (AttributeError, KeyError, TypeError):
            stat = torch.cuda.memory_allocated if which == "current" else torch.cuda.max_memory_allocated
            return int(stat(self.device))

    def memory_allocated(self) -> int | None:
        return self._allocated_bytes("current")

    def max_memory_allocated(self) -> int | None:
        return self._allocated_bytes("peak")

    def pool_memory(self, pool: Hashable) -> tuple[int, int, int] | None:
        try:
            want: tuple[Any, ...] = tuple(pool)  # type: ignore[arg-type]
        except TypeError:
            return None
        reserved = active = segments = 0
        for seg in torch.cuda.memory_snapshot():
            if (
                seg.get("device", self.device_index) == self.device_index
                and tuple(seg.get("segment_pool_id", ())) == want
            ):
                reserved += int(seg.get("total_size", 0))
                active += int(seg.get("active_size", 0))
                segments += 1
        return reserved, active, segments


#: How an implicit synchronization with the legacy default stream reads: torch's message for
#: cudaErrorStreamCaptureImplicit, and the driver's name of the code the core reports.
_IMPLICIT_SYNC = (
    "legacy stream depend on a capturing",
    "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
    "cudaErrorStreamCaptureImplicit",
)


def explain_capture_error(e: Exception) -> Exception | None:
    """``e`` again, of its type, with what to do when a capture failed because work on the legacy
    default stream had to wait for it; None for any other error (or a type not built from a
    message)."""
    text = str(e)
    if not any(sig in text for sig in _IMPLICIT_SYNC):
        return None
    hint = (
        " [the capture made the legacy default stream wait for it: autograd synchronizes a backward "
        "with the stream each of its nodes was created on, and nodes created while the default stream "
        "was current -- a DistributedDataParallel wrapper's gradient accumulators above all -- tie it "
        "into every backward capture. Build the model wrapper while a side stream is current: "
        "Megatron-LM's initialize makes one current (torch.cuda.set_stream(torch.cuda.Stream())) for "
        "cuda_graph_impl='transformer_engine' and get_model builds DDP under its own stream; for torch's "
        "DDP, `with torch.cuda.stream(side): model = DDP(model)` and graph with "
        "engine=gograph.CudaEngine(device, stream=side)]"
    )
    try:
        new = type(e)(text + hint)
    except Exception:
        return None
    return new if type(new) is type(e) else None


def _abort(pass_id: int, kind: int, stream: int) -> None:
    try:
        _core.abort_pass_capture(pass_id, kind, stream)
    except Exception as e:  # keep the original error
        log.warning("aborting a failed capture: %s", str(e))


def _cuda_device(device: torch.device | int | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"gograph: CudaEngine needs a CUDA device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------
# Eager (CPU reference)
# ---------------------------------------------------------------------------------------------
@dataclass
class _EagerEntry:
    """One recorded kind of an eager pass."""

    body: Body
    body_args: tuple[Any, ...]
    static: tuple[torch.Tensor | None, ...]
    grad_enabled: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...] = ()  # (device type, enabled, dtype) at capture
    autocast_cache: bool = True
    module: weakref.ReferenceType[torch.nn.Module] | None = None  # the module its pass calls
    state: tuple[_capture_state.StateFactory, ...] = ()  # what integrations recorded at capture


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


def _as_captured(entry: _EagerEntry) -> contextlib.ExitStack:
    """The state of the capture: a CUDA graph replays the kernels it recorded, whatever autocast
    (or a framework's state) says at replay time, so the eager engine's re-run must see the
    capture's -- and no hook of the module's own (:mod:`gograph.runtime._capture_state`)."""
    stack = contextlib.ExitStack()
    for device, enabled, dtype in entry.autocast:
        stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=entry.autocast_cache))
    if entry.module is not None:
        stack.enter_context(_capture_state.entered(entry.module, entry.state))
    return stack


@dataclass
class _EagerPassRecord:
    entries: dict[int, _EagerEntry] = field(default_factory=dict)
    # Outputs (with their autograd graph) of the latest forward replay, consumed by the next
    # backward replay: the eager counterpart of the activations a graph keeps in its pool.
    live_outputs: tuple[torch.Tensor | None, ...] | None = None


class EagerEngine(Engine):
    """The CPU reference engine: capture runs and records, replay re-runs into static buffers.

    A forward replay runs in the grad mode of its capture and keeps its live outputs; a backward
    replay runs ``backward_body(live_outputs)`` and drops them, as a graph replay would reuse
    that memory. Differences from a graph replay are reported instead of silently diverging: a
    result whose shape or dtype differs from the static one, or a backward replay without a
    forward replay since the previous backward, raise RuntimeError.
    """

    name = "eager"

    def __init__(
        self,
        dry_run: bool = False,
        generators: Sequence[torch.Generator] = (),
        pool_model: bool = False,
        isolate_outputs: bool = False,
    ) -> None:
        """``dry_run``: captures refuse what a CUDA capture cannot contain (host reads, syncs,
        device-to-host copies, draws from a generator the capture does not carry), with
        :class:`gograph.CaptureUnsupportedError`. Off by default: a model may take a CPU-only
        branch (one that reads a value on the host) that it does not take on CUDA.
        ``generators``: the generators, besides the default one, that the CUDA engine will carry
        (``CudaEngine(generators=...)``: a tensor-parallel RNG tracker's); a dry run refuses a
        random op that draws from any other.
        ``pool_model``: model CUDA's graph pools (:mod:`gograph.runtime._poolmodel`): each capture's
        blocks are placed as CUDA's caching allocator would place them, and a replay overwrites
        what the graph's replay would overwrite on CUDA (another graph's output or saved
        activations in a block it writes). Off by default (it costs a dispatch hook per op while
        capturing). ``isolate_outputs`` (with the model): what ``CudaEngine(isolate_outputs=True)``
        does, modelled: static outputs and the default schedule's weight-gradient graphs kept out
        of memory other graphs write."""
        super().__init__()
        if not isinstance(dry_run, bool):
            raise TypeError(f"EagerEngine: dry_run must be a bool, got {type(dry_run).__name__}")
        for name, value in (("pool_model", pool_model), ("isolate_outputs", isolate_outputs)):
            if not isinstance(value, bool):
                raise TypeError(f"EagerEngine: {name} must be a bool, got {type(value).__name__}")
        if not all(isinstance(g, torch.Generator) for g in generators):
            raise TypeError("EagerEngine: generators must be torch.Generator objects")
        self.dry_run = dry_run
        self._generators = tuple(generators)
        self._passes: dict[int, _EagerPassRecord] = {}
        self.pool_model: PoolModel | None = PoolModel() if pool_model else None
        self.isolates_outputs = pool_model and isolate_outputs

    def __repr__(self) -> str:
        flags = (("dry_run", self.dry_run), ("pool_model", self.pool_model), ("isolate_outputs", self.isolates_outputs))
        opts = [name for name, on in flags if on]
        return f"EagerEngine({', '.join(f'{o}=True' for o in opts)})"

    def new_pool(self) -> Hashable:
        return EagerPool()

    def new_pass(self, index: int, label: str) -> int:
        pass_id = super().new_pass(index, label)
        self._passes[pass_id] = _EagerPassRecord()
        return pass_id

    def _capture(
        self, pass_id: int, kind: int, body: Body, *body_args: Any, pool: Hashable, uses_rng: bool | None, mode: int
    ) -> tuple[tuple[torch.Tensor | None, ...], int]:
        _core.begin_pass_capture(pass_id, kind, self.pool_key(pool), 0, 0)
        try:
            # what a CUDA capture would refuse, refused here too
            with (
                _dry_run.capture_checked(self._generators) if self.dry_run else contextlib.nullcontext(),
                self._modelled(pool, pass_id, kind),
            ):
                result = tuple(body(*body_args))
        except BaseException:
            _abort(pass_id, kind, 0)
            raise
        seq = int(_core.end_pass_capture(pass_id, kind, 0))
        static = tuple(t.detach() if isinstance(t, torch.Tensor) else None for t in result)
        # A backward body is replayed with the outputs of the latest forward replay, so its
        # capture-time arguments are not kept (they hold the capture's autograd graph).
        args = body_args if kind == FORWARD else ()
        record = self._passes.setdefault(pass_id, _EagerPassRecord())
        forward = body if kind == FORWARD else getattr(record.entries.get(FORWARD), "body", None)
        module = getattr(forward, "module", None)  # the module a forward body calls (None: a function)
        record.entries[kind] = _EagerEntry(
            body,
            args,
            static,
            torch.is_grad_enabled(),
            _autocast_state(),
            torch.is_autocast_cache_enabled(),
            weakref.ref(module) if module is not None else None,
            _capture_state.record(module),
        )
        return result, seq

    def _modelled(self, pool: Hashable, pass_id: int, kind: int) -> contextlib.ExitStack:
        """With the pool model: the capture's allocations recorded in ``pool``'s model, and what a
        forward saves for its backward noted."""
        stack = contextlib.ExitStack()
        model = self.pool_model
        if model is not None:
            stack.enter_context(model.window(self.pool_key(pool), (pass_id, kind)))
            if kind == FORWARD:
                stack.enter_context(model.saving_capture(pass_id))
        return stack

    def replay(self, pass_id: int, kind: int) -> None:
        _core.replay(pass_id, kind, 0)  # lifecycle check; raises after reset
        record = self._passes.get(pass_id)
        if record is None:  # released by another thread since the lifecycle check
            _core.replay(pass_id, kind, 0)
            raise RuntimeError(f"gograph eager engine: pass {pass_id} was reset during its replay")
        entry = record.entries[kind]
        model = self.pool_model
        if model is not None:  # what this graph's replay overwrites on CUDA, overwritten
            model.overwrite_before((pass_id, kind))
        if kind == BACKWARD:
            live, record.live_outputs = record.live_outputs, None
            if live is None:
                raise RuntimeError(
                    f"gograph eager engine: backward replay of pass {pass_id} without a forward replay since "
                    "the previous backward; a CUDA graph would silently reuse the activations of the latest forward"
                )
            # the parameters' own hooks fire once, in the outer autograd, as after a CUDA replay
            with (
                torch.enable_grad(),
                _as_captured(entry),
                _torch.tensor_hooks_suspended(getattr(entry.body, "inputs", ())),
            ):
                new = tuple(entry.body(live))
            del live
        else:
            saving = model.saving_replay(pass_id) if model is not None else contextlib.nullcontext()
            with torch.set_grad_enabled(entry.grad_enabled), _as_captured(entry), saving:
                new = tuple(entry.body(*entry.body_args))
            if kind == FORWARD and BACKWARD in record.entries:
                record.live_outputs = new
        _copy_into_static(pass_id, kind, entry.static, new)

    def _forget(self, pass_id: int) -> None:
        self._passes.pop(pass_id, None)
        if self.pool_model is not None:
            self.pool_model.forget(pass_id)

    def warmup_context(self, pool: Hashable | None = None) -> contextlib.AbstractContextManager[None]:
        if pool is not None and self.pool_model is not None:  # a warmup in the graph pool lays it out
            return self.pool_model.window(self.pool_key(pool))
        return contextlib.nullcontext()  # host memory: no pool to allocate in, nothing cached

    def buffer_released(self, tensor: torch.Tensor) -> None:
        if self.pool_model is not None:
            self.pool_model.release(tensor)

    def pool_free_blocks(self, pool: Hashable) -> list[tuple[int, int]]:
        return self.pool_model.free_ranges(self.pool_key(pool)) if self.pool_model is not None else []

    def block_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        return self.pool_model.range_of(t) if self.pool_model is not None else None

    def hold_free_blocks(self, pool: Hashable, capturing: bool) -> Any:
        return self.pool_model.hold(self.pool_key(pool)) if self.pool_model is not None else None

    def release_hold(self, hold: Any) -> None:
        if self.pool_model is not None and hold:
            self.pool_model.release_held(hold)

    def rng_marker(self) -> Hashable:
        return None  # re-running the body consumes RNG exactly as eager code does

    def get_rng_state(self) -> Any:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.set_rng_state(state)


def _copy_into_static(pass_id: int, kind: int, static: tuple[torch.Tensor | None, ...], new: tuple[Any, ...]) -> None:
    what = _noun(kind)
    if len(new) != len(static):
        raise RuntimeError(
            f"gograph eager engine: {what} replay of pass {pass_id} produced {len(new)} results, "
            f"capture produced {len(static)}"
        )
    with torch.no_grad():
        for i, (s, n) in enumerate(zip(static, new)):
            if s is None:
                continue
            if n is None:
                s.zero_()
                continue
            if n.shape != s.shape or n.dtype != s.dtype:
                raise RuntimeError(
                    f"gograph eager engine: {what} replay of pass {pass_id} produced result {i} with shape "
                    f"{tuple(n.shape)} and dtype {n.dtype}, but the captured static tensor has shape "
                    f"{tuple(s.shape)} and dtype {s.dtype}; graphed callables need static shapes"
                )
            if s.data_ptr() != n.data_ptr():
                s.copy_(n)


# ---------------------------------------------------------------------------------------------
# Shared default engines
# ---------------------------------------------------------------------------------------------
_default_lock = threading.Lock()
_default_cuda: dict[int, CudaEngine] = {}
_default_eager: list[EagerEngine] = []


def default_cuda_engine(device: torch.device) -> CudaEngine:
    """The process-wide CudaEngine of ``device`` (one side stream per device, as
    ``torch.cuda.graph`` keeps one default capture stream)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _default_lock:
        eng = _default_cuda.get(index)
        if eng is None:
            eng = _default_cuda[index] = CudaEngine(torch.device("cuda", index))
        return eng


def default_eager_engine() -> EagerEngine:
    """The process-wide EagerEngine."""
    with _default_lock:
        if not _default_eager:
            _default_eager.append(EagerEngine())
        return _default_eager[0]


def resolve_engine(engine: Engine | str | None, tensors: Sequence[torch.Tensor]) -> Engine:
    """The engine of a build: the one given, or by name, or by where the sample tensors live."""
    if isinstance(engine, Engine):
        return engine
    if engine not in (None, "eager", "cuda"):
        raise ValueError(f"gograph: engine must be None, 'eager', 'cuda' or an Engine instance, not {engine!r}")
    if engine == "eager":
        return default_eager_engine()
    cuda_tensors = [t for t in tensors if t.is_cuda]
    if engine != "cuda" and not cuda_tensors:
        if engine is None:
            _warn_eager_beside_cuda()
        return default_eager_engine()
    if not _native.cuda_available():
        what = "engine='cuda' was requested" if engine == "cuda" else "sample_args are CUDA tensors"
        raise RuntimeError(
            f"gograph: {what} but the CUDA core is unavailable: {_native.cuda_unavailable_reason()}. "
            "Pass CPU tensors (or engine='eager') to use the eager reference engine."
        )
    devices = {t.device for t in cuda_tensors}
    if len(devices) > 1:
        raise ValueError(
            f"gograph: all sample args and parameters must be on one CUDA device, got {sorted(map(str, devices))}"
        )
    return default_cuda_engine(next(iter(devices)) if devices else torch.device("cuda", torch.cuda.current_device()))


_warned_eager: list[bool] = []


def _warn_eager_beside_cuda() -> None:
    """Once per process: CPU sample tensors chose the eager engine (nothing is graphed) on a
    machine where CUDA is available -- most likely a model or sample left on the CPU."""
    if _warned_eager or not torch.cuda.is_available():
        return
    _warned_eager.append(True)
    warn_user(
        "gograph: the sample args and parameters are CPU tensors, so make_graphed_callables runs the eager "
        "engine (a CPU reference: nothing is graphed, a replay re-runs the callable) although CUDA is "
        "available; move the module and the samples to the GPU (.cuda()) to capture CUDA graphs, or pass "
        "engine='eager' to choose the eager engine explicitly"
    )


def _noun(kind: int) -> str:
    """How messages call a graph of ``kind`` (the number itself when it is none)."""
    try:
        return GraphKind(kind).noun
    except ValueError:
        return str(kind)
