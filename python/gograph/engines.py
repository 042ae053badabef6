"""Engines: how a graphed callable's passes are captured and replayed.

:func:`gograph.make_graphed_callables` is written against the :class:`Engine` interface, so the
same algorithm (warmup, forward captures in order, backward captures in reverse order, static
buffers, autograd wiring, reset) runs on

* :class:`CudaEngine` -- the Go core captures the torch work issued on a side CUDA stream into a
  CUDA graph and launches it at replay; torch's allocations during capture are routed to a
  private graph memory pool;
* :class:`EagerEngine` -- the CPU reference and debugging engine: "capture" runs the body once
  and records it, "replay" re-runs the body and copies its results into the static tensors that
  capture returned, so every replay has exactly the aliasing semantics of a graph replay.

Both keep the same per-pass records in the Go core (``new_pass``/``attach_graph``/
``add_pool_ref``/``seal_pass``/``replay``/``reset_pass``/``drop_pass``), so the lifecycle rules
(a reset pass refuses to replay, a reset releases exactly the pool references its captures
took, dropping forgets the record) are enforced by the same code on both engines.

Pass kinds (the core's numbering): :data:`FORWARD` = 0, :data:`BACKWARD` = 1, :data:`WGRAD` = 2.
"""
from __future__ import annotations

import abc
import contextlib
import gc
import itertools
import logging
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _native, _observe

__all__ = [
    "FORWARD",
    "BACKWARD",
    "WGRAD",
    "KIND_NAMES",
    "CAPTURE_MODE_GLOBAL",
    "Engine",
    "CudaEngine",
    "EagerEngine",
    "EagerPool",
    "default_cuda_engine",
    "default_eager_engine",
]

log = logging.getLogger("gograph")

FORWARD = 0
BACKWARD = 1
WGRAD = 2
KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", WGRAD: "wgrad"}

CAPTURE_MODE_GLOBAL = 0  # CUstreamCaptureMode, as torch.cuda.graph's default

Body = Callable[..., Sequence["torch.Tensor | None"]]
"""A capture body: runs torch work and returns a flat sequence of tensors (or None)."""


def _core() -> Any:
    return _native.core


class _CaptureState(threading.local):
    """Per-thread count of the engine captures underway on this thread (any engine).

    A graphed callable called while it is non-zero would replay a graph inside another
    callable's capture (nested capture), which gograph refuses; ``make_graphed_callables``
    refuses to start then too. Thread-local, so that replays on other threads are unaffected.
    """

    depth = 0


CAPTURE_STATE = _CaptureState()
"""This thread's :class:`_CaptureState` (read on the replay hot path: one attribute access)."""


def capturing_on_this_thread() -> bool:
    """True while an :meth:`Engine.capture` is underway on the calling thread."""
    return CAPTURE_STATE.depth > 0


class Engine(abc.ABC):
    """What :func:`gograph.make_graphed_callables` needs from a capture backend.

    Pool tokens are opaque to the algorithm: whatever :meth:`new_pool` returns (or the user
    passed as ``pool``) is handed back to :meth:`capture` and :meth:`release`.
    """

    #: "cuda" or "eager"
    name: str = "?"

    def __init__(self) -> None:
        self._capture_depth = 0
        self._deferred: list[tuple[int, Hashable]] = []

    # -- pools and passes -------------------------------------------------------------------
    @abc.abstractmethod
    def new_pool(self) -> Hashable:
        """A fresh memory-pool token shared by the captures of one make_graphed_callables."""

    def new_pass(self, callable_index: int, label: str) -> int:
        """Creates the core's record for one graphed callable (state ``building``)."""
        if self._deferred and not self._must_defer():
            self._drain_deferred()
        pass_id = int(_core().new_pass(int(callable_index), str(label)))
        self._on_new_pass(pass_id)
        return pass_id

    def _on_new_pass(self, pass_id: int) -> None:
        """Hook for engine-side per-pass bookkeeping."""

    def seal(self, pass_id: int) -> None:
        """``building -> ready``: the pass may now be replayed."""
        _core().seal_pass(pass_id)

    def capture(self, pass_id: int, kind: int, body: Body, *body_args: Any, pool: Hashable,
                uses_rng: bool | None = None) -> tuple[torch.Tensor | None, ...]:
        """Captures ``body(*body_args)`` as graph ``kind`` of pass ``pass_id`` in ``pool``.

        Returns the body's results: the *static* tensors that every later :meth:`replay` of this
        kind overwrites in place. ``uses_rng`` says whether the body consumed generator state in
        warmup (None: unknown). On failure nothing of this capture stays attached to the pass,
        but the pool reference it took stays recorded on the pass (released by :meth:`release`).

        Passes finalized (garbage-collected) while a capture is underway are released after it.
        A successful capture is recorded with the core (its sequence number in the pool, which
        the replay-order guard checks replays against), logged at INFO with its time and memory
        delta, and counted by the progress bar of the build underway (``gograph._observe``).
        """
        self._capture_depth += 1
        CAPTURE_STATE.depth += 1
        try:
            probe = _observe.CaptureProbe(self, pass_id, kind, pool, body)
            result = self._capture(pass_id, kind, body, *body_args, pool=pool, uses_rng=uses_rng)
            probe.finished()
            return result
        finally:
            CAPTURE_STATE.depth -= 1
            self._capture_depth -= 1
            if self._capture_depth == 0 and self._deferred:
                self._drain_deferred()

    @abc.abstractmethod
    def _capture(self, pass_id: int, kind: int, body: Body, *body_args: Any, pool: Hashable,
                 uses_rng: bool | None) -> tuple[torch.Tensor | None, ...]:
        """Engine-specific part of :meth:`capture`."""

    @abc.abstractmethod
    def replay(self, pass_id: int, kind: int) -> None:
        """Replays graph ``kind`` of ``pass_id``. Raises RuntimeError (from the core) when the
        pass was reset or has no graph of that kind."""

    @abc.abstractmethod
    def release(self, pass_id: int, pool: Hashable) -> None:
        """Destroys the pass's graphs and returns the pool references its captures took; the
        pass record stays (state ``reset``) so that a later replay reports the reset. A
        second call is harmless."""

    def drop(self, pass_id: int, pool: Hashable) -> None:
        """:meth:`release` and forget the core's record (finalizers, failed builds)."""
        try:
            self.release(pass_id, pool)
        finally:
            _core().drop_pass(pass_id)

    def finalize_pass(self, pass_id: int, pool: Hashable) -> None:
        """Finalizer of a graphed callable: :meth:`drop` now, or right after the capture in
        progress (destroying graphs and returning pool memory must not happen mid-capture).
        Never raises: errors are logged."""
        if self._must_defer():
            self._deferred.append((pass_id, pool))
            return
        try:
            self.drop(pass_id, pool)
        except Exception as e:  # a finalizer must not raise
            log.warning("gograph: releasing pass %d in its finalizer failed: %s", pass_id, str(e))

    def _must_defer(self) -> bool:
        """True while releasing graphs or pool memory is unsafe (a capture is underway)."""
        return self._capture_depth > 0

    def _drain_deferred(self) -> None:
        while self._deferred:
            pass_id, pool = self._deferred.pop()
            self.finalize_pass(pass_id, pool)

    # -- warmup and RNG -----------------------------------------------------------------------
    @abc.abstractmethod
    def warmup_context(self) -> contextlib.AbstractContextManager[None]:
        """Context in which warmup iterations run (the side stream for CUDA)."""

    @abc.abstractmethod
    def rng_marker(self) -> Hashable:
        """A value that changes when the body consumes generator state this engine must carry
        into captures (compare before/after a warmup iteration)."""

    @abc.abstractmethod
    def get_rng_state(self) -> Any:
        """Snapshot of the generator state graphing must not disturb."""

    @abc.abstractmethod
    def set_rng_state(self, state: Any) -> None:
        """Restores a :meth:`get_rng_state` snapshot."""

    def synchronize(self) -> None:
        """Waits for device work (no-op on the eager engine)."""

    # -- introspection (memory report, logging); optional for new engines ---------------------
    def pool_key(self, pool: Hashable) -> str:
        """A string naming ``pool`` for the core's capture order: equal for captures that share
        the pool, different for different pools (pool tokens stay alive as long as their
        graphed callables, so ``repr`` is enough for the built-in tokens)."""
        return f"{self.name}/{pool!r}"

    def memory_allocated(self) -> int | None:
        """Bytes allocated on the engine's device now (None when not measurable, e.g. eager)."""
        return None

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated on the engine's device (None when not measurable)."""
        return None

    def pool_memory(self, pool: Hashable) -> tuple[int, int, int] | None:
        """(reserved, active, segments) of ``pool``'s memory on the device, or None when the
        engine allocates no pool memory (eager)."""
        return None


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------
class _OnDevice:
    """``with torch.cuda.device(index)`` for an int index, through torch's raw device calls,
    and nothing at all when ``index`` is already the current device."""

    __slots__ = ("index", "prev")

    def __init__(self, index: int) -> None:
        self.index = index
        self.prev = -1

    def __enter__(self) -> None:
        prev = torch._C._cuda_getDevice()
        if prev != self.index:
            torch._C._cuda_setDevice(self.index)
            self.prev = prev

    def __exit__(self, *exc: Any) -> None:
        if self.prev >= 0:
            torch._C._cuda_setDevice(self.prev)
            self.prev = -1


class _OnStream:
    """``with torch.cuda.stream(stream)`` for a stream on the current device, through torch's
    raw stream calls (``torch.cuda.set_stream`` does the same): makes ``stream`` the current
    stream of its device and restores the previous one on exit."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.prev: tuple[int, int, int] | None = None

    def __enter__(self) -> None:
        s = self.stream
        self.prev = torch._C._cuda_getCurrentStream(s.device_index)
        torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    def __exit__(self, *exc: Any) -> None:
        prev, self.prev = self.prev, None
        if prev is not None:
            torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])


class CudaEngine(Engine):
    """Captures with the Go core on a side CUDA stream of ``device``.

    Capture of one pass kind:

    1. ``torch.cuda.synchronize()`` and ``empty_cache()`` (as ``torch.cuda.graph`` does);
    2. if the body may consume CUDA RNG, an *RNG companion* ``torch.cuda.CUDAGraph`` begins a
       relaxed-mode capture on a second stream, in one pool the engine keeps for its
       companions: this registers the default generator (and every
       extra generator given to the engine) with torch's graph machinery, so philox offsets are
       recorded as graph-relative; the companion captures nothing itself;
    3. on the side stream: torch's allocations on that stream are routed to the pool
       (``_cuda_beginAllocateCurrentStreamToPool`` -- stream-scoped, so autograd's device thread
       running backward ops on this stream is routed too), one pool reference is recorded on the
       pass, ``core.begin_capture`` (global mode), the body runs, ``core.end_capture``
       instantiates; any exception aborts the capture in the core; the routing always ends;
    4. the companion's capture ends; the graph is attached to the pass. It is not uploaded
       ahead of time: as with torch's graphs, its first launch uploads it (an explicit
       ``cuGraphUpload`` per capture added ~45 us of graphing time per graph on the H200 and
       only moved that cost out of the first replay).

    Replay is ``companion.replay()`` (advances the philox offset, writes the seed/offset the
    kernels read) when there is a companion, then one core call launching the graph on the
    current stream.
    """

    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None,
                 generators: Sequence[torch.Generator] = (),
                 stream: torch.cuda.Stream | None = None) -> None:
        """``device``: the CUDA device of the captures (default: the current one).
        ``generators``: extra CUDA generators captures must carry (besides the default one).
        ``stream``: the side stream for warmup and capture (default: a new one). Pass the stream
        a DistributedDataParallel model was constructed under: DDP keeps its gradient
        accumulators, which record their stream at creation, and a capture on another stream
        would make that stream (or the legacy default stream) depend on the capture."""
        super().__init__()
        if not _native.cuda_available():
            raise RuntimeError(
                "gograph: the CUDA engine needs the cuda flavor of the Go core, which is not loaded: "
                f"{_native.cuda_unavailable_reason()}")
        if not torch.cuda.is_available():
            raise RuntimeError("gograph: the CUDA engine needs torch with CUDA; torch.cuda.is_available() is False")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            raise ValueError(f"gograph: CudaEngine needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device: torch.device = device
        self.device_index: int = int(device.index)  # type: ignore[arg-type]
        if stream is not None and stream.device != device:
            raise ValueError(f"gograph: CudaEngine stream is on {stream.device}, not on the engine's {device}")
        if stream is not None and int(stream.cuda_stream) == 0:
            raise ValueError("gograph: CudaEngine cannot capture on the legacy default stream (0); "
                             "pass a side stream such as torch.cuda.Stream()")
        self.stream: torch.cuda.Stream = stream if stream is not None else torch.cuda.Stream(device)
        self.rng_stream: torch.cuda.Stream = torch.cuda.Stream(device)
        self.generators: list[torch.Generator] = list(generators)
        # RNG companion graphs by (pass id, kind): the Python-side part of a CUDA pass (its
        # graphs themselves are owned by the core's record).
        self._companions: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # One pool for every companion of this engine (they allocate nothing): a fresh pool id
        # per companion cost ~42 KB of host memory per capture that torch never returns
        # (bench/companion_rss.py, H200). See _anchored_companion_pool.
        self._companion_pool: Hashable = None
        self._companion_anchor: torch.cuda.CUDAGraph | None = None
        self._companion_pool_stale = False
        # Pool references each pass took, mirrored from the core's record: when reset_pass raises
        # (a graph failed to be destroyed) Python gets no count back, though the core did reset
        # the pass and zero its references; this mirror says how many must still be released.
        self._pass_pool_refs: dict[int, int] = {}
        # gopy's generated Python wrapper adds a Python-level call to every core call; the
        # replay hot path calls the extension's C entry point directly (same arguments, same
        # RuntimeError on failure) when the generated module exposes it.
        core = _core()
        ext = getattr(core, "_gographcore", None)
        self._core_replay: Callable[[int, int, int], Any] = getattr(ext, "gograph_Replay", None) or core.replay

    def __repr__(self) -> str:
        return f"CudaEngine(device={self.device})"

    def register_generator(self, generator: torch.Generator) -> None:
        """Adds a CUDA generator (e.g. a tensor-parallel RNG tracker's) whose state captures
        must carry, besides the device's default generator."""
        if generator not in self.generators:
            self.generators.append(generator)

    # pools and passes
    def new_pool(self) -> Hashable:
        return torch.cuda.graph_pool_handle()

    def _must_defer(self) -> bool:
        # Also when a capture that is not ours (torch.cuda.graph in user code) is underway on
        # this thread's current stream: the release then waits for the next make_graphed_callables.
        return self._capture_depth > 0 or bool(torch._C._cuda_isCurrentStreamCapturing())

    def _default_generator(self) -> torch.Generator:
        return torch.cuda.default_generators[self.device_index]

    def _capture(self, pass_id: int, kind: int, body: Body, *body_args: Any, pool: Hashable,
                 uses_rng: bool | None) -> tuple[torch.Tensor | None, ...]:
        # Python's cyclic garbage collector must not run while the stream captures: a collected
        # cycle holding a torch CUDAGraph (e.g. a torch-graphed module left in a reference cycle)
        # destroys it mid-capture, which CUDA refuses and which invalidates the capture (seen on
        # the H200). Collection resumes as soon as the capture is over.
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._capture_gc_off(pass_id, kind, body, *body_args, pool=pool, uses_rng=uses_rng)
        finally:
            if gc_enabled:
                gc.enable()

    def _capture_gc_off(self, pass_id: int, kind: int, body: Body, *body_args: Any, pool: Hashable,
                        uses_rng: bool | None) -> tuple[torch.Tensor | None, ...]:
        core = _core()
        need_companion = uses_rng is None or bool(uses_rng)
        sid = int(self.stream.cuda_stream)
        idx = self.device_index
        graph = 0
        # torch.cuda.device/stream/synchronize resolve their device argument through several
        # Python layers on every call (a sizeable part of a small layer's capture time on the
        # H200); _OnDevice and _OnStream make the same raw calls directly.
        with _OnDevice(idx):
            # As torch.cuda.graph: finish pending work and return cached blocks to the device,
            # so that the capture's pool can grow into them.
            torch._C._cuda_synchronize()
            torch._C._cuda_emptyCache()
            companion: torch.cuda.CUDAGraph | None = None
            companion_pool: Hashable = None
            if need_companion:
                companion_pool = self._anchored_companion_pool()
                companion = torch.cuda.CUDAGraph()
                self._begin_companion(companion, companion_pool)
            ok = False
            try:
                with _OnStream(self.stream):
                    torch._C._cuda_beginAllocateCurrentStreamToPool(idx, pool)
                    try:
                        # The begin call took one reference on the pool: record it on the
                        # pass right away, so a failure below still gets it released.
                        try:
                            core.add_pool_ref(pass_id)
                        except BaseException:
                            torch._C._cuda_releasePool(idx, pool)
                            raise
                        self._pass_pool_refs[pass_id] = self._pass_pool_refs.get(pass_id, 0) + 1
                        core.begin_capture(sid, CAPTURE_MODE_GLOBAL)
                        try:
                            result = tuple(body(*body_args))
                            graph = int(core.end_capture(sid))
                        except BaseException:
                            try:
                                core.abort_capture(sid)
                            except Exception as abort_error:  # keep the original error
                                log.warning("gograph: abort_capture after a failed capture: %s", str(abort_error))
                            raise
                    finally:
                        torch._C._cuda_endAllocateToPool(idx, pool)
                ok = True
            finally:
                if companion is not None:
                    try:
                        self._end_companion(companion, companion_pool)
                    except Exception as companion_error:
                        if ok:
                            if graph:
                                core.destroy_graph(graph)
                            raise
                        log.warning("gograph: ending the RNG companion capture after a failed "
                                    "capture: %s", str(companion_error))
        try:
            core.attach_graph(pass_id, kind, graph)
        except BaseException:
            core.destroy_graph(graph)
            raise
        if companion is not None:
            self._companions[(pass_id, kind)] = companion
        if log.isEnabledFor(logging.DEBUG):
            log.debug("gograph: captured %s graph %d of pass %d (rng companion: %s)",
                      KIND_NAMES.get(kind, kind), graph, pass_id, companion is not None)
        return result

    def _anchored_companion_pool(self) -> Hashable:
        """The engine's companion pool. It is anchored by an empty graph captured into it once
        and kept by the engine: a CUDAGraph's capture takes a reference on the pool in both of
        torch's allocators (device and pinned host), and torch refuses to capture into a pool
        id whose last reference was released, which would happen as soon as the last companion
        is reset. The anchor goes with the engine.

        The anchor keeps the default generator registered with a graph, so torch keeps its
        graph-safe seed and offset slots (two 8-byte device tensors, 1 KiB of allocator blocks)
        allocated for the engine's life instead of freeing and re-allocating them around every
        companion. After a failed companion the pool is replaced: the new anchor is captured
        before the old one goes, so those slots are never freed and re-allocated."""
        if self._companion_pool is None or self._companion_pool_stale:
            pool = torch.cuda.graph_pool_handle()
            anchor = torch.cuda.CUDAGraph()
            with torch.cuda.device(self.device):
                self._begin_companion(anchor, pool)
                self._end_companion(anchor, pool)
            self._companion_anchor = anchor  # the previous anchor, if any, goes only now
            self._companion_pool = pool
            self._companion_pool_stale = False
        return self._companion_pool

    def _begin_companion(self, companion: torch.cuda.CUDAGraph, companion_pool: Hashable) -> None:
        """Begins the companion's relaxed capture on the RNG stream. If torch fails part-way
        (it puts the generators in capture mode and routes the pool before it begins the stream
        capture), both are undone before the error propagates."""
        for gen in self.generators:
            companion.register_generator_state(gen)
        with _OnStream(self.rng_stream):
            try:
                companion.capture_begin(pool=companion_pool, capture_error_mode="relaxed")
            except Exception:
                self._undo_companion(companion_pool)
                raise

    def _end_companion(self, companion: torch.cuda.CUDAGraph, companion_pool: Hashable) -> None:
        """Ends the companion's capture. When torch's capture_end fails (its stream capture was
        invalidated), torch leaves two things behind that would break later work: the
        companion's pool stays among the allocator's captures underway, and the generators stay
        in capture mode (every later eager RNG call would raise). Both are undone here before
        the error propagates."""
        with _OnStream(self.rng_stream), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty": by design
            try:
                companion.capture_end()
            except Exception:
                self._undo_companion(companion_pool)
                raise

    def _undo_companion(self, companion_pool: Hashable) -> None:
        # A failed companion can leave its pool marked as being recorded to (a capture that CUDA
        # invalidated), and torch refuses to begin another capture into that pool: later
        # companions get a fresh anchored pool.
        if companion_pool == self._companion_pool:
            self._companion_pool_stale = True
        try:
            torch._C._cuda_endAllocateToPool(self.device_index, companion_pool)
        except Exception as e:
            log.debug("gograph: companion pool cleanup: %s", str(e))
        try:
            # A throwaway capture runs the generators' capture prologue and epilogue, which
            # takes them out of capture mode.
            with torch.cuda.stream(self.rng_stream), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scratch = torch.cuda.CUDAGraph()
                for gen in self.generators:
                    scratch.register_generator_state(gen)
                scratch.capture_begin(capture_error_mode="relaxed")
                scratch.capture_end()
                scratch.reset()
        except Exception as e:
            log.warning("gograph: could not take the CUDA generators out of capture mode: %s", str(e))

    def replay(self, pass_id: int, kind: int) -> None:
        # The hot path: one capture-status query, one dict probe (RNG companion), one raw
        # current-stream query, one core call.
        if torch._C._cuda_isCurrentStreamCapturing():
            raise RuntimeError(
                f"gograph: cannot replay the {KIND_NAMES.get(kind, kind)} graph of pass {pass_id} while the "
                "current CUDA stream is capturing (inside torch.cuda.graph or another "
                "make_graphed_callables capture): a graphed callable cannot run inside a second capture. "
                "Graph the callables together in one make_graphed_callables call, or run the original "
                "(ungraphed) module inside the capture.")
        if self._companions:
            companion = self._companions.get((pass_id, kind))
            if companion is not None:
                companion.replay()
        self._core_replay(pass_id, kind, torch._C._cuda_getCurrentRawStream(self.device_index))

    def release(self, pass_id: int, pool: Hashable) -> None:
        held = self._pass_pool_refs.pop(pass_id, 0)
        failure: Exception | None = None
        try:
            n = int(_core().reset_pass(pass_id))
        except RuntimeError as e:
            # The core reset the pass and zeroed its references despite the error (a graph that
            # failed to be destroyed): release the references it took, then report the error.
            n, failure = held, e
        if n:
            # A replay on another thread may have launched between the caller's synchronize and
            # the reset (the core orders the two, but the launched work may still be running):
            # the pool's memory goes back to the allocator only once the device is done with it.
            try:
                torch.cuda.synchronize(self.device)
            except Exception as e:  # the references must still be released
                log.warning("gograph: synchronize before releasing pass %d's pool: %s", pass_id, str(e))
        for _ in range(n):
            torch._C._cuda_releasePool(self.device_index, pool)
        for kind in KIND_NAMES:
            companion = self._companions.pop((pass_id, kind), None)
            if companion is not None:
                companion.reset()
        if failure is not None:
            raise failure

    # warmup and RNG
    @contextlib.contextmanager
    def warmup_context(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                yield
        torch.cuda.synchronize(self.device)

    def rng_marker(self) -> Hashable:
        # Read around every warmup forward and backward: one offset read per generator.
        if not self.generators:
            return torch.cuda.default_generators[self.device_index].get_offset()
        return (torch.cuda.default_generators[self.device_index].get_offset(),
                *(g.get_offset() for g in self.generators))

    def get_rng_state(self) -> Any:
        return ([torch.cuda.get_rng_state(self.device)], [g.get_state() for g in self.generators])

    def set_rng_state(self, state: Any) -> None:
        default_states, extra_states = state
        torch.cuda.set_rng_state(default_states[0], self.device)
        for gen, s in zip(self.generators, extra_states):
            gen.set_state(s)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _allocated_bytes(self, which: str) -> int:
        # torch.cuda.memory_allocated() flattens the allocator's whole statistics tree into a
        # dict on every call (~0.3 ms, measured on the H200: a quarter of W2's graphing time when
        # read around each capture); the raw statistics give the same counter directly.
        try:
            return int(torch._C._cuda_memoryStats(self.device_index)["allocated_bytes"]["all"][which])
        except (AttributeError, KeyError, TypeError):
            stat = torch.cuda.memory_allocated if which == "current" else torch.cuda.max_memory_allocated
            return int(stat(self.device))

    def memory_allocated(self) -> int | None:
        return self._allocated_bytes("current")

    def max_memory_allocated(self) -> int | None:
        return self._allocated_bytes("peak")

    def pool_memory(self, pool: Hashable) -> tuple[int, int, int] | None:
        # The caching allocator's segments owned by this private pool (segment_pool_id is the
        # pool's id pair, as graph_pool_handle() returns it).
        try:
            want: tuple[Any, ...] = tuple(pool)  # type: ignore[arg-type]
        except TypeError:
            return None
        reserved = active = segments = 0
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", self.device_index) != self.device_index:
                continue
            if tuple(seg.get("segment_pool_id", ())) != want:
                continue
            reserved += int(seg.get("total_size", 0))
            active += int(seg.get("active_size", 0))
            segments += 1
        return reserved, active, segments


# ---------------------------------------------------------------------------------------------
# Eager (CPU reference)
# ---------------------------------------------------------------------------------------------
class EagerPool:
    """Opaque pool token of the eager engine (the eager engine allocates nothing from pools;
    it counts the references captures take so that release can be checked)."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id: int = next(EagerPool._ids)

    def __repr__(self) -> str:
        return f"EagerPool({self.id})"


@dataclass
class _EagerEntry:
    """One recorded kind of an eager pass."""

    body: Body
    body_args: tuple[Any, ...]
    static: tuple[torch.Tensor | None, ...]
    grad_enabled: bool


@dataclass
class _EagerPassRecord:
    entries: dict[int, _EagerEntry] = field(default_factory=dict)
    # Outputs (with their autograd graph) of the latest forward replay, consumed by the next
    # backward replay -- the eager counterpart of the activations a graph keeps in its pool.
    live_outputs: tuple[torch.Tensor | None, ...] | None = None


class EagerEngine(Engine):
    """The CPU reference engine: capture runs and records, replay re-runs into static buffers.

    * ``capture(pass_id, kind, body, *args)`` runs ``body(*args)`` once, attaches a kind with
      graph handle 0 to the core's pass (nothing to launch) and records the body and its results
      (the static tensors).
    * ``replay(pass_id, kind)`` first asks the core to replay (the lifecycle check: raises after
      reset, or when the kind was never captured), then re-runs the recorded body and copies each
      result into the static tensor returned at capture (``static.copy_(new)`` under no_grad;
      None stays None). A forward replay runs in the grad mode of its capture and keeps its live
      outputs; a backward replay runs ``backward_body(live_outputs)`` and then drops them, as a
      graph replay would reuse that memory.

    Differences from a graph replay are reported instead of silently diverging: a result whose
    shape or dtype differs from the static one, or a backward replay without a forward replay
    since the previous backward, raise RuntimeError.
    """

    name = "eager"

    def __init__(self) -> None:
        super().__init__()
        self._passes: dict[int, _EagerPassRecord] = {}
        self._pool_refs: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "EagerEngine()"

    def new_pool(self) -> Hashable:
        return EagerPool()

    def pool_refs(self, pool: Hashable) -> int:
        """How many references the captures of live passes hold on ``pool``."""
        return self._pool_refs.get(pool, 0)

    def _on_new_pass(self, pass_id: int) -> None:
        self._passes[pass_id] = _EagerPassRecord()

    def _capture(self, pass_id: int, kind: int, body: Body, *body_args: Any, pool: Hashable,
                 uses_rng: bool | None) -> tuple[torch.Tensor | None, ...]:
        core = _core()
        record = self._passes.setdefault(pass_id, _EagerPassRecord())
        core.add_pool_ref(pass_id)
        with self._lock:
            self._pool_refs[pool] = self._pool_refs.get(pool, 0) + 1
        result = tuple(body(*body_args))
        core.attach_graph(pass_id, kind, 0)
        static = tuple(t.detach() if isinstance(t, torch.Tensor) else None for t in result)
        # A backward body is replayed with the outputs of the latest forward replay, so its
        # capture-time arguments are not kept (they hold the capture's autograd graph).
        args = body_args if kind == FORWARD else ()
        record.entries[kind] = _EagerEntry(body, args, static, torch.is_grad_enabled())
        return result

    def replay(self, pass_id: int, kind: int) -> None:
        _core().replay(pass_id, kind, 0)  # lifecycle check; raises after reset
        record = self._passes.get(pass_id)
        if record is None:  # released by another thread since the lifecycle check
            _core().replay(pass_id, kind, 0)  # raises the core's "... was reset ..." message
            raise RuntimeError(f"gograph eager engine: pass {pass_id} was reset during its replay")
        entry = record.entries[kind]
        if kind == FORWARD:
            with torch.set_grad_enabled(entry.grad_enabled):
                new = tuple(entry.body(*entry.body_args))
            if BACKWARD in record.entries:
                record.live_outputs = new
        elif kind == WGRAD:
            # A delayed weight gradient reads what the submodules kept from the latest backward.
            with torch.set_grad_enabled(entry.grad_enabled):
                new = tuple(entry.body(*entry.body_args))
        else:
            live = record.live_outputs
            if live is None:
                raise RuntimeError(
                    f"gograph eager engine: {KIND_NAMES.get(kind, kind)} replay of pass {pass_id} without a "
                    "forward replay since the previous backward; a CUDA graph would silently reuse the "
                    "activations of the latest forward here")
            record.live_outputs = None
            with torch.enable_grad():
                new = tuple(entry.body(live))
            del live
        self._copy_into_static(pass_id, kind, entry.static, new)

    @staticmethod
    def _copy_into_static(pass_id: int, kind: int, static: tuple[torch.Tensor | None, ...],
                          new: tuple[Any, ...]) -> None:
        if len(new) != len(static):
            raise RuntimeError(
                f"gograph eager engine: {KIND_NAMES.get(kind, kind)} replay of pass {pass_id} produced "
                f"{len(new)} results, capture produced {len(static)}")
        with torch.no_grad():
            for i, (s, n) in enumerate(zip(static, new)):
                if s is None:
                    continue
                if n is None:
                    s.zero_()
                    continue
                if n.shape != s.shape or n.dtype != s.dtype:
                    raise RuntimeError(
                        f"gograph eager engine: {KIND_NAMES.get(kind, kind)} replay of pass {pass_id} "
                        f"produced result {i} with shape {tuple(n.shape)} and dtype {n.dtype}, but the "
                        f"captured static tensor has shape {tuple(s.shape)} and dtype {s.dtype}; graphed "
                        "callables need static shapes")
                if s.data_ptr() != n.data_ptr():
                    s.copy_(n)

    def release(self, pass_id: int, pool: Hashable) -> None:
        n = int(_core().reset_pass(pass_id))
        if n:
            with self._lock:
                left = self._pool_refs.get(pool, 0) - n
                if left > 0:
                    self._pool_refs[pool] = left
                else:
                    self._pool_refs.pop(pool, None)
        self._passes.pop(pass_id, None)

    def warmup_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def rng_marker(self) -> Hashable:
        return None  # re-running the body consumes RNG exactly as eager code does

    def get_rng_state(self) -> Any:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.set_rng_state(state)


# ---------------------------------------------------------------------------------------------
# Shared default engines
# ---------------------------------------------------------------------------------------------
_default_lock = threading.Lock()
_default_cuda: dict[int, CudaEngine] = {}
_default_eager: EagerEngine | None = None


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
    global _default_eager
    with _default_lock:
        if _default_eager is None:
            _default_eager = EagerEngine()
        return _default_eager
