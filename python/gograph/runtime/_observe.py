"""Build-time observation: capture order, per-capture timing and memory, warmup peak, progress.

Kept apart from the build (``_build.py``) and the engines, and free of core calls: they call in
at two points only --

* :meth:`gograph.engines.Engine.capture` wraps every capture in a :class:`CaptureProbe`, which
  records the capture's time, memory delta and sequence number in its pool (the core gives it
  when the capture ends), logs it at INFO on the ``gograph`` logger, and advances the progress
  bar of the build underway on this thread;
* the build opens a :class:`BuildStats` for its duration (``begin`` / ``warmup_started`` /
  ``warmup_finished`` / ``close``) and gives it to every GraphedCallable it returns
  (``GraphedCallable.build_stats``), where :func:`gograph.memory_report` reads it.

Nothing here runs on the replay path.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core._kinds import GraphKind
from ..support._warn import warn_user

log = logging.getLogger("gograph")

#: Report names of the graph kinds, by kind number (``GraphKind.key``).
KIND_NAMES = {int(k): k.key for k in GraphKind}


class Engine(Protocol):
    """What observation reads of an engine (:class:`gograph.engines.Engine` has it): its name,
    the device memory it measures and the core's name of a pool."""

    name: str

    def memory_allocated(self) -> int | None: ...
    def max_memory_allocated(self) -> int | None: ...
    def pool_key(self, pool: Hashable) -> str: ...


_MiB = 1024.0 * 1024.0


def debug_env() -> bool:
    """True when ``GOGRAPH_DEBUG`` asks for debug checks ("1", "true", "yes", "on")."""
    return os.environ.get("GOGRAPH_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def json_text(d: dict[str, Any], **kwargs: Any) -> str:
    """``json.dumps(d, **kwargs)``, ``indent=2`` unless given (reports' and plans' ``to_json``)."""
    kwargs.setdefault("indent", 2)
    return json.dumps(d, **kwargs)


def fmt_bytes(n: int | None) -> str:
    """Human-readable bytes (binary units); "-" for None."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024.0 or unit == "GiB":
            return f"{sign}{int(v)} B" if unit == "B" else f"{sign}{v:.1f} {unit}"
        v /= 1024.0
    return f"{sign}{v:.1f} TiB"  # pragma: no cover


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
@dataclass
class CaptureRecord:
    """One capture of one pass kind, as the build saw it."""

    pass_id: int
    kind: str
    label: str
    seq: int
    """Capture sequence number in its pool (1 = first capture in that pool)."""
    pool: str
    seconds: float
    memory_delta_bytes: int | None
    """``torch.cuda.memory_allocated()`` after the capture minus after the previous capture of
    the same ``make_graphed_callables`` call (before the first: just before it); None on the
    eager engine. What this capture step left allocated: the capture's static outputs and, for
    a forward with a backward, the activations the backward capture will free; for a backward,
    also the static grad-output buffers allocated for it (and, with buffer reuse, minus the
    buffers the schedule handed back since the previous capture). The deltas of a build sum to
    what its captures added in all."""


@dataclass
class WarmupPeak:
    """Device memory during the warmup of one ``make_graphed_callables`` call (CUDA only).

    torch offers no peak over an interval without resetting the device's peak statistics, which
    graphing must not disturb, so the peak is ``max_memory_allocated()`` after warmup: exact when
    warmup raised it (``exact``), otherwise an upper bound (an earlier peak was higher).
    """

    baseline_bytes: int
    """``memory_allocated()`` when warmup started."""
    peak_bytes: int
    """``max_memory_allocated()`` after warmup."""
    exact: bool
    """True when the peak was reached during warmup (it exceeds the peak before warmup)."""

    @property
    def delta_bytes(self) -> int:
        """Peak allocated during warmup above the baseline (an upper bound unless exact)."""
        return self.peak_bytes - self.baseline_bytes


_build_ids = itertools.count(1)


@dataclass(eq=False)
class BuildStats:
    """What one ``make_graphed_callables`` call observed. Shared by the callables it returned."""

    engine: str
    id: int = field(default_factory=lambda: next(_build_ids))
    warmup: WarmupPeak | None = None
    captures: list[CaptureRecord] = field(default_factory=list)
    debug_replay_order: bool = False
    seconds: float = 0.0
    """Wall time of the whole ``make_graphed_callables`` call (set when it returns)."""
    warmup_seconds: float = 0.0
    """Wall time of its warmup (iterations, hooks, the synchronizations around them)."""
    _t0: float = field(default=0.0, repr=False)
    _warmup_t0: float = field(default=0.0, repr=False)
    _allocated_after_capture: int | None = field(default=None, repr=False)
    _engine_ref: Any = field(default=None, repr=False)
    _warmup_prior_peak: int = field(default=0, repr=False)
    _progress: Any = field(default=None, repr=False)
    _labels: dict[int, str] = field(default_factory=dict, repr=False)

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def begin(
        cls, engine: Engine, expected_captures: int = 0, progress: bool = False, debug_replay_order: bool = False
    ) -> BuildStats:
        """Opens the build on this thread (captures on this thread are attributed to it)."""
        stats = cls(engine=engine.name, debug_replay_order=debug_replay_order)
        stats._t0 = time.perf_counter()
        stats._engine_ref = engine
        if progress:
            stats._progress = _open_progress(expected_captures)
        _current.stack.append(stats)
        return stats

    def close(self, failed: bool = False) -> None:
        """Ends the build (idempotent): closes the progress bar, detaches from the thread."""
        if self in _current.stack:
            _current.stack.remove(self)
            self.seconds = time.perf_counter() - self._t0
            if not failed:
                log.info("%s", self._built_line())
        bar, self._progress = self._progress, None
        if bar is not None:
            try:
                bar.close()
            except Exception:  # pragma: no cover - a progress bar must never break a build
                pass
        self._engine_ref = None

    def _built_line(self) -> str:
        """The build's INFO line: graphs on CUDA; on the eager engine passes (nothing is graphed:
        its replays re-run the callables)."""
        if self.engine == "eager":
            passes = len({c.pass_id for c in self.captures})
            what = f"{passes} pass(es) (no CUDA graph: eager replays re-run the callables)"
        else:
            what = f"{len(self.captures)} graph(s)"
        peak = (
            ""
            if self.warmup is None
            else f"; warmup peak {fmt_bytes(self.warmup.delta_bytes)} above {fmt_bytes(self.warmup.baseline_bytes)}"
            f"{'' if self.warmup.exact else ' (upper bound)'}"
        )
        return (
            f"built {what} on the {self.engine} engine in {self.seconds * 1e3:.1f} ms (warmup "
            f"{self.warmup_seconds * 1e3:.1f} ms, captures {sum(c.seconds for c in self.captures) * 1e3:.1f} ms){peak}"
        )

    # -- warmup ------------------------------------------------------------------------------
    def warmup_started(self) -> None:
        eng = self._engine_ref
        self._warmup_t0 = time.perf_counter()
        self._set_progress_phase("warmup")
        base = eng.memory_allocated() if eng is not None else None
        if base is None:
            return
        self._warmup_prior_peak = int(eng.max_memory_allocated() or 0)
        self.warmup = WarmupPeak(baseline_bytes=int(base), peak_bytes=int(base), exact=False)

    def warmup_finished(self) -> None:
        self.warmup_seconds = time.perf_counter() - self._warmup_t0
        self._set_progress_phase("capture")
        eng = self._engine_ref
        if self.warmup is None or eng is None:
            return
        peak = int(eng.max_memory_allocated() or 0)
        self.warmup = WarmupPeak(
            baseline_bytes=self.warmup.baseline_bytes, peak_bytes=peak, exact=peak > self._warmup_prior_peak
        )

    # -- captures ----------------------------------------------------------------------------
    def label_of(self, pass_id: int) -> str:
        return self._labels.get(pass_id, f"pass {pass_id}")

    def _captured(self, rec: CaptureRecord) -> None:
        self.captures.append(rec)
        bar = self._progress
        if bar is not None:
            try:
                if bar.total is not None and bar.n + 1 > bar.total:
                    bar.total = bar.n + 1
                bar.set_postfix_str(f"{rec.kind} {rec.label}", refresh=False)
                bar.update(1)
            except Exception:  # pragma: no cover
                pass

    def _set_progress_phase(self, phase: str) -> None:
        bar = self._progress
        if bar is not None:
            try:
                bar.set_description(f"gograph {phase}")
            except Exception:  # pragma: no cover
                pass


class _Current(threading.local):
    def __init__(self) -> None:
        self.stack: list[BuildStats] = []


_current = _Current()


def current_build() -> BuildStats | None:
    """The build underway on this thread (innermost), if any."""
    return _current.stack[-1] if _current.stack else None


_said_no_tqdm: list[bool] = []


def _open_progress(total: int) -> Any:
    """A tqdm bar over the captures, or None when tqdm is not installed (no hard dependency;
    said once per process, as a warning: the INFO log lines exist only where logging is
    configured)."""
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        if not _said_no_tqdm:
            _said_no_tqdm.append(True)
            warn_user(
                "gograph: progress=True shows a bar only with tqdm installed (pip install tqdm); "
                "without it each capture is logged at INFO on the 'gograph' logger "
                "(logging.basicConfig(level=logging.INFO) shows them)"
            )
        return None
    return tqdm(total=total or None, desc="gograph", unit="graph", leave=False)


# ---------------------------------------------------------------------------------------------
# Per-capture probe (called by Engine.capture)
# ---------------------------------------------------------------------------------------------
class CaptureProbe:
    """Started before one capture and finished after it succeeded (see module docstring)."""

    __slots__ = ("build", "engine", "kind", "label", "mem0", "pass_id", "pool", "t0")

    def __init__(self, engine: Engine, pass_id: int, kind: int, pool: Hashable, body: Any) -> None:
        self.engine = engine
        self.pass_id = pass_id
        self.kind = kind
        self.pool = pool
        build = self.build = current_build()
        label = getattr(body, "label", None)
        if isinstance(label, str) and build is not None:
            build._labels[pass_id] = label
        self.label = (
            label if isinstance(label, str) else (build.label_of(pass_id) if build is not None else f"pass {pass_id}")
        )
        # Within a build, a capture's delta counts from the previous capture's end (one
        # allocator read per capture instead of two: each read copies torch's whole statistics
        # tree, ~11 us on the H200, and tiny layers capture in ~0.3 ms).
        last = build._allocated_after_capture if build is not None else None
        self.mem0 = engine.memory_allocated() if last is None else last
        self.t0 = time.perf_counter()

    def finished(self, seq: int) -> CaptureRecord:
        """Records the capture (its sequence number ``seq`` in the pool, from the core), logs it and
        reports it to the build."""
        seconds = time.perf_counter() - self.t0
        mem1 = self.engine.memory_allocated()
        delta = None if self.mem0 is None or mem1 is None else int(mem1) - int(self.mem0)
        build = self.build
        if build is not None:
            build._allocated_after_capture = mem1
        key = self.engine.pool_key(self.pool)
        kind = KIND_NAMES.get(self.kind, str(self.kind))
        rec = CaptureRecord(
            pass_id=self.pass_id,
            kind=kind,
            label=self.label,
            seq=seq,
            pool=key,
            seconds=seconds,
            memory_delta_bytes=delta,
        )
        if log.isEnabledFor(logging.INFO):
            log.info(
                "captured %s of %s (pass %d) in %.1f ms, memory %s (capture #%d in pool %s)",
                kind,
                self.label,
                self.pass_id,
                seconds * 1e3,
                "n/a (eager engine)" if delta is None else ("+" if delta >= 0 else "") + fmt_bytes(delta),
                seq,
                key,
            )
        if build is not None:
            build._captured(rec)
        return rec
