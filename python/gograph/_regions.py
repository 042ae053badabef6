"""Which sample args share memory: with each other (one tensor passed to several callables, views
of one tensor, one tensor twice in a callable's args) or with a parameter.

torch makes each sample its graph's static input, so a sample shared by two graphs is one buffer
both read, and a copy-in for the second silently changes what the first one's pending backward
reads. The core's planner (``separate`` in internal/lifetime) decides, by the passes' lifetimes in
the schedule and whether each leaf requires grad, which leaves of a shared region keep their
sample and which get a clone; this module only measures the overlaps, as facts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from ._state import PassState

__all__ = ["Region", "sample_regions"]

#: (region number from 1, or 0 for memory shared with nothing; the region overlaps a parameter)
Region = tuple[int, bool]

_Span = tuple[str, int, int, int, tuple[int, int] | None]  # device, first byte, end, order, leaf


def _span(t: Tensor, order: int, leaf: tuple[int, int] | None) -> _Span | None:
    """The bytes ``t`` can address, from its first element to one past its last (None: none, or
    not a strided tensor whose address can be read)."""
    if t.layout is not torch.strided or t.numel() == 0 or t.device.type == "meta":
        return None
    try:
        start = t.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (a functional or fake wrapper)
        return None
    if start == 0:  # nothing allocated behind it
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (str(t.device), start, start + extent * t.element_size(), order, leaf)


def sample_regions(states: Sequence[PassState]) -> dict[tuple[int, int], Region]:
    """Per (pass index, input leaf): the region of memory its sample shares with other input
    leaves or parameters (of the graphed modules, and any ``nn.Parameter`` passed as a sample),
    numbered from 1 in address order, and whether a parameter is in it. Leaves that share
    nothing are absent. Byte ranges that overlap (or are equal) are one region; views of one
    tensor that do not overlap are not."""
    spans: list[_Span] = []
    params: dict[int, Tensor] = {}
    for st in states:
        for j, t in enumerate(st.flat_args):
            s = _span(t, len(spans), (st.index, j))
            if s is not None:
                spans.append(s)
            if isinstance(t, torch.nn.Parameter):  # some module's weights, graphed or not
                params[id(t)] = t
        params.update((id(p), p) for p in st.params)
    for p in params.values():
        s = _span(p, len(spans), None)
        if s is not None:
            spans.append(s)
    spans.sort()
    out: dict[tuple[int, int], Region] = {}
    group: list[_Span] = []
    region, end = 0, 0
    for s in spans:
        if group and (s[0] != group[0][0] or s[1] >= end):
            region = _close(group, region, out)
            group = []
        end = max(end, s[2]) if group else s[2]
        group.append(s)
    _close(group, region, out)
    return out


def _close(group: list[_Span], region: int, out: dict[tuple[int, int], Region]) -> int:
    """Numbers ``group`` (overlapping spans) if it has two members and an input leaf among them."""
    leaves = [g[4] for g in group if g[4] is not None]
    if len(group) < 2 or not leaves:
        return region
    region += 1
    param = len(leaves) < len(group)
    for leaf in leaves:
        out[leaf] = (region, param)
    return region
