"""Static inputs that several graphed callables share, and the guard on copies into them.

After the build some static input buffers belong to more than one pass: a sample that needs no
grad passed to several layers (a mask, rotary embeddings: one buffer, as in torch and
TransformerEngine), a sample the planner kept shared because the schedule runs its passes one
after another (``_order``), and TransformerEngine's slots (``_reuse_graph_input_output_buffers``).
A copy into such a buffer changes what every sharer's graphs read. That is harmless when the
contents stay the same (every layer of a step gets the same mask) or when no other sharer still
has its backward to run; otherwise that backward computes from the new contents and its
gradients are silently wrong (torch's graphs are). The guard refuses that copy instead, as
autograd refuses a saved tensor modified in place: it remembers which tensor (identity and
version counter) was copied in last, the buffer's version then, and which sharers' autograd
nodes still wait for their backward. The same tensor again is not copied (every layer of a step
passing one mask costs one copy, not one per layer); a different tensor while a sharer waits is
compared with the buffer (a device sync, only then), accepted without a copy when equal and
refused when not.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._regions import overlapping

__all__ = ["SharedInput", "SharedInputError", "shared_inputs", "version_of"]

log = logging.getLogger("gograph")


class SharedInputError(RuntimeError):
    """A call passed new contents for a static input that another graphed callable shares and
    whose backward, still to run, reads it."""


class SharedInput:
    """One static buffer read by several passes' graphs (``label``: pass id -> what to call it;
    ``backwards``: the sharers that have a backward, the capture program's answer).

    ``source`` is the tensor last copied in (a weak reference, and its version counter then);
    ``waiting`` holds, per pass with a backward, a weak reference to the autograd node of its
    latest forward: the node lives until its backward has run or its graph is dropped. A
    forward-only sharer never waits: no backward of it will read the buffer."""

    __slots__ = ("_compared", "backwards", "buffer_version", "labels", "source", "version", "waiting")

    def __init__(self, labels: dict[int, str], backwards: frozenset[int]) -> None:
        self.labels, self.backwards = labels, backwards
        self.source: weakref.ref[Tensor] | None = None
        self.version: int | None = None
        self.buffer_version: int | None = None
        self.waiting: dict[int, weakref.ref[Any]] = {}
        self._compared = False

    def copy_in(self, pass_id: int, leaf: int, static: Tensor, new: Tensor) -> None:
        """Makes ``static`` hold ``new``'s contents for pass ``pass_id``'s argument ``leaf``:
        nothing to do when it holds them already (the tensor copied in last, neither changed
        since); a copy when no other sharer's backward waits; else a comparison, and
        SharedInputError (before anything is written) when the contents differ."""
        src, version, buffer_version = self.source, version_of(new), version_of(static)
        if (
            src is not None
            and src() is new
            and version is not None
            and version == self.version
            and buffer_version == self.buffer_version
        ):
            return  # a pending backward's buffer stays untouched (an eager replay saved it)
        waiter = self._waiting_other(pass_id)
        if waiter is not None:
            self._check_same(pass_id, leaf, waiter, static, new)  # equal: no copy needed
        else:
            static.copy_(new)
            buffer_version = version_of(static)
        self.source, self.version, self.buffer_version = weakref.ref(new), version, buffer_version

    def forward_ran(self, pass_id: int, node: Any) -> None:
        """Pass ``pass_id``'s forward made autograd node ``node`` (its backward, if it has one,
        reads the buffer)."""
        if pass_id in self.backwards:
            self.waiting[pass_id] = weakref.ref(node)

    def _waiting_other(self, pass_id: int) -> int | None:
        for other, ref in self.waiting.items():
            if other != pass_id:
                node = ref()
                if node is not None and not getattr(node, "gograph_backward_done", False):
                    return other
        return None

    def _check_same(self, pass_id: int, leaf: int, waiter: int, static: Tensor, new: Tensor) -> None:
        if not self._compared:
            self._compared = True
            log.info(
                "%s got a different tensor for a static input it shares with %s, whose backward has "
                "not run: gograph compares the contents (a device sync on every such call). Pass the same "
                "tensor to every callable that shares it",
                self.labels[pass_id],
                self.labels[waiter],
            )
        if torch.equal(static, new.to(dtype=static.dtype)):
            return
        raise SharedInputError(
            f"gograph: argument leaf {leaf} of {self.labels[pass_id]} has other contents than the static input "
            f"buffer it shares with {self.labels[waiter]}, whose backward has not run yet and reads that buffer: "
            "copying them in would change what that backward computes (silently wrong gradients, as with "
            "torch's graphs). Pass every callable that shares the buffer the same contents until their "
            "backwards have run, or give them sample_args of their own (distinct tensors: each then gets its "
            "own static input)"
        )


def version_of(t: Tensor) -> int | None:
    """The version counter (None for an inference tensor: it has none, so it never matches; a
    forward that changes an input's writes it in place)."""
    return None if t.is_inference() else t._version


def shared_inputs(
    surfaces: Sequence[Sequence[Tensor]],
    passes: Sequence[int],
    labels: Sequence[str],
    skip: Sequence[frozenset[int]],
    backward: Sequence[bool],
) -> list[dict[int, SharedInput]]:
    """Per pass (``surfaces[k]`` its static inputs, ``passes[k]`` its id, ``labels[k]`` what to
    call it, ``skip[k]`` leaves left to a plain copy: chained ones, never copied into, and those
    its forward writes in place, whose buffer a replay changes without a version bump;
    ``backward[k]`` whether the capture program gave it a backward): leaf -> the guard of the
    buffer it shares with another pass's static input (bytes that overlap). Buffers no sharer
    with a backward reads get none: no pending backward can read what a copy changes."""
    leaves = [((k, j), t) for k, ts in enumerate(surfaces) for j, t in enumerate(ts) if j not in skip[k]]
    out: list[dict[int, SharedInput]] = [{} for _ in surfaces]
    for group in overlapping(leaves):
        owners = {k for k, _ in group}
        if len(owners) < 2 or not any(backward[k] for k in owners):
            continue  # one pass's own leaves, or forward-only sharers: no backward to protect
        guard = SharedInput({passes[k]: labels[k] for k in owners}, frozenset(passes[k] for k in owners if backward[k]))
        for k, j in group:
            out[k][j] = guard
    return out
