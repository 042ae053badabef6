"""Oracle 2 of the lifetime fuzzer: liveness, by weak references.

:data:`TRACKER` files every tensor a fuzzed callable's forward returns (and a few of its internal
activations) under the callable's index, with weak references only. During a build it also
hooks each output that requires grad, so it knows when a backward consumed it (and raises the
fault a case injects into a build, :class:`InjectedFault`). The rules:

* during a build (warmup and capture), at every forward (when it reports its outputs) and in every
  capture-time ``forward_pre_hooks`` hook: the outputs of an inference pass (no output requires
  grad) are dead at once, and a training pass's outputs are dead once the backward that consumes
  them ran;
* when ``make_graphed_callables`` returns, everything its warmup and captures made is dead (the
  static buffers are detached aliases, not these tensors);
* after ``reset()``: every static buffer of that callable is dead (unless another live callable
  reads the same buffer), and so is everything its forwards made;
* once every callable is reset, everything is dead.

Garbage is collected before a leak is reported (cheap: the fuzzer freezes the heap it starts
with, ``gc.freeze()``). On CUDA nothing is collected inside a stream capture.
"""

from __future__ import annotations

import functools
import gc
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from gograph.engines import capturing_on_this_thread

__all__ = ["SETTLE_TRIES", "TRACKER", "InjectedFault", "LiveTracker", "StaticRefs", "settle"]


class InjectedFault(RuntimeError):
    """The error a fuzzed callable raises where the case injects a fault into a build."""


@dataclass(eq=False)
class _Made:
    """What one forward of callable ``owner`` made (weakly): ``n`` numbers it in the build."""

    owner: int
    phase: str
    n: int
    refs: list[weakref.ref[Tensor]]
    inference: bool
    consumed: bool = False

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)

    def describe(self) -> str:
        what = "inference" if self.inference else "training (its backward ran)"
        return f"{self.phase} forward #{self.n} of callable {self.owner} ({what})"


def _consumed(made: _Made, tracker: LiveTracker, grad: Tensor) -> None:
    if not made.consumed:
        made.consumed = True
        tracker.backward_ran(made.owner)


def _capturing() -> bool:
    """Inside a CUDA stream capture (nothing may be collected there: a finalizer could launch)."""
    if capturing_on_this_thread():
        return True
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@dataclass(eq=False)
class LiveTracker:
    """Weak references to what fuzzed forwards made, and the leaks found (``violations``).
    ``phase`` None: off (the eager reference run); "build": inside ``make_graphed_callables``;
    "run": the graphed training program (eager-engine replays re-run the forwards)."""

    phase: str | None = None
    cuda: bool = False  # the CUDA engine: no checks inside captures
    made: list[_Made] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    fault: tuple[int, str, int] | None = None  # (callable, "forward" / "backward", n-th of the build)
    seen: dict[tuple[int, str], int] = field(default_factory=dict)

    def start(self, cuda: bool, fault: tuple[int, str, int] | None = None) -> None:
        self.phase, self.made, self.violations, self.cuda, self.fault, self.seen = "build", [], [], cuda, fault, {}

    def stop(self) -> None:
        self.phase, self.made, self.fault = None, [], None

    def _count(self, owner: int, kind: str) -> None:
        """Raises the injected fault at the build's n-th forward / backward of its callable."""
        n = self.seen.get((owner, kind), 0)
        self.seen[(owner, kind)] = n + 1
        if self.phase == "build" and self.fault == (owner, kind, n):
            raise InjectedFault(f"injected fault in {kind} #{n} of callable {owner}")

    def backward_ran(self, owner: int) -> None:
        self._count(owner, "backward")

    def record(self, owner: int, out: Any, internals: Iterable[Tensor]) -> None:
        """Called by every fuzzed forward with what it returns."""
        if self.phase is None:
            return
        if self.phase == "build":
            self.check_build(f"a build forward of callable {owner}")
            self._count(owner, "forward")
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
        made = _Made(
            owner,
            self.phase,
            sum(m.owner == owner and m.phase == self.phase for m in self.made),
            [weakref.ref(t) for t in (*leaves, *internals)],
            inference=not any(t.requires_grad for t in leaves),
        )
        if self.phase == "build":
            for t in leaves:
                if t.requires_grad:
                    t.register_hook(functools.partial(_consumed, made, self))
        self.made.append(made)

    def check_build(self, where: str) -> None:
        """Inside a build: inference outputs and consumed training outputs are dead."""
        if self.cuda and _capturing():
            return
        self._report(where, [m for m in self.made if m.phase == "build" and (m.inference or m.consumed)])

    def check_all_dead(self, where: str, owner: int | None = None, phase: str | None = None) -> None:
        """Everything made (by ``owner``, in ``phase``) is dead."""
        self._report(
            where,
            [m for m in self.made if (owner is None or m.owner == owner) and (phase is None or m.phase == phase)],
        )

    def _report(self, where: str, must_be_dead: Sequence[_Made]) -> None:
        if not any(m.alive() for m in must_be_dead):
            return
        gc.collect()
        for m in must_be_dead:
            if m.alive():
                self.violations.append(f"liveness: {m.alive()} tensor(s) of {m.describe()} still alive at {where}")


TRACKER = LiveTracker()


#: How often :func:`settle` is tried before a tensor still alive is a verdict (about 0.1 s in all).
SETTLE_TRIES = 50


def settle() -> None:
    """Gives autograd's device threads the time to drop what they hold, then collects cycles.

    A CUDA backward runs on autograd's device thread; the caller's ``backward()`` returns when
    the last node has run, while that thread still holds its last node's inputs and the graph
    task's captured grads (a graphed callable's static grad inputs among them). Dropping a
    tensor that has a Python object takes the GIL, which the checking thread holds until it
    sleeps: so a buffer can look alive, and its block reserved, for a moment after every
    reference of this process is gone. A leak stays alive through the tries; that moment does
    not."""
    time.sleep(0.002)  # releases the GIL
    gc.collect()


@dataclass(eq=False)
class StaticRefs:
    """Weak references to the static buffers of each graphed callable (inputs, outputs, grad
    outputs, grad inputs; not parameters), taken when the build returned."""

    refs: dict[int, list[tuple[str, weakref.ref[Tensor]]]] = field(default_factory=dict)

    @staticmethod
    def buffers(g: Any) -> list[tuple[str, Tensor]]:
        out: list[tuple[str, Tensor]] = []
        groups = (
            ("static input", g.static_input_surface[: g.len_user_args]),
            ("static output", g.static_outputs),
            ("static grad output", g.static_grad_outputs),
            ("static grad input", g.static_grad_inputs),
        )
        for name, ts in groups:
            out += [(f"{name} {k}", t) for k, t in enumerate(ts) if isinstance(t, Tensor)]
        return out

    def take(self, graphed: Sequence[Any]) -> None:
        for i, g in enumerate(graphed):
            self.refs[i] = [(name, weakref.ref(t)) for name, t in self.buffers(g)]

    def check_released(self, i: int, graphed: Sequence[Any], violations: list[str]) -> None:
        """After ``graphed[i].reset()``: its buffers are dead unless a live callable holds the same
        tensor (a chained input, a shared grad-output buffer)."""
        live = {id(t) for g in graphed if not g.is_reset for _, t in self.buffers(g)}
        for _ in range(SETTLE_TRIES):
            if all(r() is None or id(r()) in live for _, r in self.refs[i]):
                return
            settle()
        for name, r in self.refs[i]:
            t = r()
            if t is not None and id(t) not in live:
                violations.append(f"liveness: {name} of graphed callable {i} is still alive after its reset()")
