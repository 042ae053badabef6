"""The state a module's call saw at capture, which the eager engine re-enters at each replay.

A CUDA graph replays the kernels its capture recorded, whatever Python state chose them. The
eager engine re-runs the call instead (``module(*args)`` through its class's ``__call__``), so
each replay must see what the capture saw:

* autocast (:func:`gograph.engines._as_captured`);
* no hooks of the module's own: torch's rule refuses a module with hooks at graphing, and a
  graph replay runs none of the hooks registered since (the outer call runs them, once), so
  the re-run suspends them;
* state a framework sets only while it makes graphs and that its modules' ``__call__`` routes
  on, which gograph cannot know: integrations register a *recorder* for it. Called at each
  eager capture with the pass's module, a recorder returns a factory of a context manager that
  re-enters that state, or None when the module is not its framework's or the state is not set
  (``gograph.integrations.megatron`` records Megatron-Core's capture flag).

Nothing here runs on the CUDA engine: its replays never call back into Python.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch

from ..support import _torch

__all__ = ["Recorder", "StateFactory", "entered", "record", "register", "unregister"]

StateFactory = Callable[[], AbstractContextManager[None]]
"""Makes a context manager that re-enters, around one eager replay, the state of its capture."""

Recorder = Callable[[torch.nn.Module], "StateFactory | None"]
"""Called at an eager capture with the pass's module; a :data:`StateFactory`, or None."""

_lock = threading.Lock()
_recorders: list[Recorder] = []


def register(recorder: Recorder) -> None:
    """Adds a recorder (once: registering it again changes nothing)."""
    if not callable(recorder):
        raise TypeError(f"gograph: a capture-state recorder must be callable, got {type(recorder).__name__}")
    with _lock:
        if recorder not in _recorders:
            _recorders.append(recorder)


def unregister(recorder: Recorder) -> None:
    """Removes a recorder; captures recorded with it keep what it recorded."""
    with _lock:
        if recorder in _recorders:
            _recorders.remove(recorder)


def record(module: torch.nn.Module | None) -> tuple[StateFactory, ...]:
    """What the registered recorders say about ``module``'s state now (at its capture)."""
    if module is None:
        return ()
    with _lock:
        recorders = tuple(_recorders)
    factories = (rec(module) for rec in recorders)
    return tuple(f for f in factories if f is not None)


@contextlib.contextmanager
def entered(
    module_ref: weakref.ReferenceType[torch.nn.Module] | None, factories: tuple[StateFactory, ...]
) -> Iterator[None]:
    """Around one eager replay: the module's own hooks suspended, each recorded state entered."""
    module = module_ref() if module_ref is not None else None
    with contextlib.ExitStack() as stack:
        if module is not None:
            stack.enter_context(_torch.module_hooks_suspended(module))
        for factory in factories:
            stack.enter_context(factory())
        yield
