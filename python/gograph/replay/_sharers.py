"""Graphed callables that replay one set of graphs (``share_microbatch_graphs``).

With ``share_microbatch_graphs=True`` the core gives the passes of one layer that the ``_order``
never has in flight together one set of graphs and static buffers (internal/lifetime, share.go):
the first of them captures, the others replay its graphs. Each pass is still a graphed callable
of its own, in the order TransformerEngine and Megatron-LM index them. :class:`Sharers` is what
they share besides the graphs:

* the order the schedule promised: a member's forward writes the static inputs and the saved
  activations another member's backward (or its weight-gradient graph, until ``backward_dw()``)
  still reads, so while one member's backward is pending another member's forward raises
  RuntimeError naming both, instead of training on overwritten buffers;
* the lifetime of the graphs: a member's ``reset()`` (or its garbage collection) takes it out;
  the graphs and pool references go when the last member goes.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["Sharers"]


class Sharers:
    """The members (pass index -> label) of one colour; the member whose backward, or weight
    gradient, is pending; the members still live."""

    __slots__ = ("_lock", "_node", "_owner", "_wgrad_owner", "alive", "labels", "live")

    def __init__(self, labels: dict[int, str]) -> None:
        self.labels = labels
        self.live = set(labels)  # neither reset nor collected: the graphs serve them
        self.alive = set(labels)  # not collected: the core's record serves their "was reset" errors
        self._lock = threading.Lock()
        self._owner: int | None = None  # the member whose autograd node may still run its backward
        self._node: weakref.ref[Any] | None = None
        self._wgrad_owner: int | None = None  # the member whose backward_dw() is still to run

    def leave(self, member: int) -> bool:
        """``member`` was reset or collected: True when this took the last live one out (then the
        graphs go)."""
        with self._lock:
            was = member in self.live
            self.live.discard(member)
            return was and not self.live

    def collect(self, member: int) -> bool:
        """``member`` was collected: True when this took the last one out (then the core's record
        of the pass goes)."""
        with self._lock:
            was = member in self.alive
            self.alive.discard(member)
            return was and not self.alive

    def before_forward(self, member: int) -> None:
        """Raises if another member still has to read the shared buffers."""
        waiting = self._waiting()
        if waiting is not None and waiting != member:
            raise RuntimeError(
                f"gograph: {self.labels[member]} replays the graphs of {self.labels[min(self.labels)]} "
                f"(share_microbatch_graphs), as does {self.labels[waiting]}, whose "
                f"{'backward_dw()' if waiting == self._wgrad_owner else 'backward'} has not run yet and reads "
                "the buffers this forward would overwrite. Call the graphed callables in the order of the _order "
                "they were graphed with, or graph without share_microbatch_graphs"
            )

    def forward_ran(self, member: int, node: Any) -> None:
        """``member``'s forward made autograd node ``node``, whose backward reads the buffers."""
        self._owner, self._node = member, weakref.ref(node)

    def backward_ran(self, member: int, wgrad: bool) -> None:
        """``member``'s backward replayed; with a weight-gradient graph the buffers stay read until
        its ``backward_dw()``."""
        if wgrad:
            self._wgrad_owner = member

    def wgrad_ran(self, member: int) -> None:
        if self._wgrad_owner == member:
            self._wgrad_owner = None

    def _waiting(self) -> int | None:
        if self._wgrad_owner is not None:
            return self._wgrad_owner
        node = self._node() if self._node is not None else None
        if node is not None and not getattr(node, "gograph_backward_done", False):
            return self._owner
        return None
