"""What the executor's parts see of a build, and what a caller may hook into it.

:class:`gograph.build._build.Build` interprets the core's programs (the warmup program, then the
capture program) in one loop; the handlers of the ops (:mod:`gograph.build._warmup`,
:mod:`gograph.build._captures`) see the build as an :class:`Executor`, and observers injected by the
caller (``make_graphed_callables``, ``plan_memory``) implement :class:`BuildHooks`. Both live
here, below the build, so that no handler or hook imports the build.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..core._plan import Schedule
    from ..core._wire import CaptureProgram, Op
    from ..request._args import Request
    from ..runtime.engines import Engine
    from ._state import PassState

__all__ = ["BuildHooks", "Executor", "HookList", "Hooks", "Phase", "ProgramKind"]


class Phase(enum.Enum):
    """Where :meth:`gograph.build._build.Build.run` stops: once the capture program is planned
    (nothing captured; the caller rolls the build back), or with every pass sealed."""

    PLANNED = "planned"
    SEALED = "sealed"


class ProgramKind(str, enum.Enum):
    """The two programs of a build, in the order they run."""

    WARMUP = "warmup"
    CAPTURE = "capture"


class Executor(Protocol):
    """The build as its op handlers and hooks see it: the request, the schedule and the passes,
    the engine and pool, the capture program once planned (``program``, with the slot tensors
    it uses), the generator marker warmup last read (``rng_at``), the pool reference warmup or
    the seed holds (``warm_pool``), the bytes the seed carves before the first capture
    (``seed``, the core's choice), whether replays are checked (``debug``), the hooks, and what the
    default schedule's weight-gradient captures hold of the pool (``wgrad_reserve``)."""

    req: Request
    schedule: Schedule
    states: list[PassState]
    engine: Engine
    pool: Hashable
    device: torch.device | None
    program: CaptureProgram | None
    slots: dict[int, torch.Tensor]
    rng_at: Hashable
    warm_pool: Hashable | None
    seed: int
    debug: bool
    hooks: HookList
    wgrad_reserve: Any  # the default schedule's weight-gradient memory, held from other captures

    def return_warm_pool(self) -> None: ...

    def pool_of(self, st: PassState) -> Hashable:
        """The pool the pass's graphs are captured in: the build's, or its colour's own
        (``share_microbatch_graphs``)."""
        ...


class BuildHooks(Protocol):
    """What an observer of a build sees, in order: each program (``program``, a context around
    its ops: recording starts and stops there, also when the build fails), each op before it
    runs (``op(i)``, and once with ``i == len(ops)`` at the end), each warmup forward and
    backward after it ran (the outputs in ``st.warm_outputs``; the incoming grads a backward
    made and (tensor, grad) per tensor it differentiated), each forward capture (a context
    around it), the capture program once planned (``planned``), and the end (``finished``)."""

    def program(
        self, build: Executor, kind: ProgramKind, ops: Sequence[Op]
    ) -> contextlib.AbstractContextManager[Any]: ...
    def op(self, i: int) -> None: ...
    def forward(self, i: int, st: PassState) -> None: ...
    def backward(self, i: int, st: PassState, incoming: Sequence[Any], grads: Sequence[tuple[Any, Any]]) -> None: ...
    def capturing_forward(self, st: PassState) -> contextlib.AbstractContextManager[Any]: ...
    def planned(self, build: Executor, program: CaptureProgram) -> None: ...
    def finished(self, build: Executor, failed: bool) -> None: ...


class Hooks:
    """:class:`BuildHooks` that observe nothing: subclass it and override what you observe."""

    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def op(self, i: int) -> None:
        pass

    def forward(self, i: int, st: PassState) -> None:
        pass

    def backward(self, i: int, st: PassState, incoming: Sequence[Any], grads: Sequence[tuple[Any, Any]]) -> None:
        pass

    def capturing_forward(self, st: PassState) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def planned(self, build: Executor, program: CaptureProgram) -> None:
        pass

    def finished(self, build: Executor, failed: bool) -> None:
        pass


def _overrides(hook: Any, name: str) -> bool:
    """Whether ``hook`` observes ``name`` (a :class:`Hooks` subclass that overrides it, or any
    other implementation of the protocol)."""
    if not isinstance(hook, Hooks):
        return True
    return getattr(type(hook), name) is not getattr(Hooks, name)


class HookList:
    """Several hooks as one, in order. The per-op events of a program call only the hooks that
    observe them (they override the event) and watch that program (a hook's ``watching``, read
    once its ``program`` context is entered; True when it has none), so a build whose observers
    record nothing pays one empty-tuple test per op."""

    _EVENTS = ("op", "forward", "backward", "capturing_forward")

    def __init__(self, hooks: Sequence[BuildHooks]) -> None:
        self.hooks = tuple(hooks)
        self._observers = {e: tuple(h for h in self.hooks if _overrides(h, e)) for e in self._EVENTS}
        self._watch(lambda h: False)

    def _watch(self, watching: Any) -> None:
        per = {e: tuple(h for h in hs if watching(h)) for e, hs in self._observers.items()}
        self.per_op, self.per_forward = per["op"], per["forward"]
        self.per_backward, self.per_capture = per["backward"], per["capturing_forward"]

    @contextlib.contextmanager
    def program(self, build: Executor, kind: ProgramKind, ops: Sequence[Op]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(h.program(build, kind, ops))
            self._watch(lambda h: getattr(h, "watching", True))
            try:
                yield
            finally:
                self._watch(lambda h: False)

    def op(self, i: int) -> None:
        for h in self.per_op:
            h.op(i)

    def forward(self, i: int, st: PassState) -> None:
        for h in self.per_forward:
            h.forward(i, st)

    def backward(self, i: int, st: PassState, incoming: Sequence[Any], grads: Sequence[tuple[Any, Any]]) -> None:
        for h in self.per_backward:
            h.backward(i, st, incoming, grads)

    @contextlib.contextmanager
    def capturing_forward(self, st: PassState) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for h in self.per_capture:
                stack.enter_context(h.capturing_forward(st))
            yield

    def planned(self, build: Executor, program: CaptureProgram) -> None:
        for h in self.hooks:
            h.planned(build, program)

    def finished(self, build: Executor, failed: bool) -> None:
        for h in self.hooks:
            h.finished(build, failed)
