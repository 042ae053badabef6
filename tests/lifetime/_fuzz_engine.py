"""An eager engine that overwrites pool memory the way graph replays may.

On the CUDA engine a lent parameter-gradient buffer lives in pool memory that graphs captured
before its backward may overwrite at replay (gograph's rule, ``LentGrads``): before such a replay,
gograph copies out every lent buffer something still holds. The plain eager engine never
overwrites anything but a pass's own static buffers, so a missing copy-out goes unseen there.
:class:`ScribblingEagerEngine` makes it seen: right before it replays a graph captured as sequence
number ``s`` (after gograph's own checks and copy-outs ran), it fills every parameter-gradient
static buffer of a backward captured at ``s`` or later with NaN -- memory gograph itself says
that replay may overwrite. A ``.grad`` still aliasing such a buffer then shows NaN, and the
values oracle reports it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gograph.engines import BACKWARD, KIND_NAMES, EagerEngine

__all__ = ["ScribblingEagerEngine"]


class ScribblingEagerEngine(EagerEngine):
    """The eager engine, scribbling over parameter-gradient buffers a replay may overwrite.
    Call :meth:`watch` with the graphed callables of a build once it returned."""

    def __init__(self, pool_model: bool = False, isolate_outputs: bool = False) -> None:
        super().__init__(pool_model=pool_model, isolate_outputs=isolate_outputs)
        self._seq: dict[tuple[int, int], int] = {}
        self._watched: dict[int, weakref.ref[Any]] = {}  # pass id -> its graphed callable
        self.scribbled = 0

    def watch(self, graphed: Sequence[Any]) -> None:
        kinds = {name: kind for kind, name in KIND_NAMES.items()}
        for g in graphed:
            for c in g.build_stats.captures:
                self._seq[(c.pass_id, kinds[c.kind])] = c.seq
            self._watched[g.pass_id] = weakref.ref(g)

    def replay(self, pass_id: int, kind: int) -> None:
        ref = self._watched.get(pass_id)
        g = ref() if ref is not None else None
        seq = self._seq.get((pass_id, kind))
        if g is not None and not g.is_reset and seq is not None:  # a reset pass's replay is refused: it runs nothing
            self._scribble(seq)
        super().replay(pass_id, kind)

    def _scribble(self, seq: int) -> None:
        for ref in self._watched.values():
            g = ref()
            if g is None or g.is_reset:
                continue
            lent_at = self._seq.get((g.pass_id, BACKWARD))
            if lent_at is None or lent_at < seq:
                continue
            for buf in g.static_grad_inputs[g.len_user_args :]:
                if buf is not None:
                    buf.data.fill_(torch.nan)  # .data: no version bump, as a graph's kernel writes
                    self.scribbled += 1
