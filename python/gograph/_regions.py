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
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from ._state import PassState

__all__ = ["Region", "overlapping", "sample_regions"]

#: (region number from 1, or 0 for memory shared with nothing; the region overlaps a parameter)
Region = tuple[int, bool]

K = TypeVar("K")
_Span = tuple[str, int, int, int]  # device, first byte, end, order


def _span(t: Tensor, order: int) -> _Span | None:
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
    return (str(t.device), start, start + extent * t.element_size(), order)


def overlapping(tensors: Sequence[tuple[K, Tensor]]) -> list[list[K]]:
    """The keys of ``tensors`` grouped by memory: tensors whose byte ranges overlap (or are
    equal) are one group, views of one tensor that do not overlap are not. Only groups of two
    or more, in address order; tensors without readable storage share nothing."""
    spans: list[tuple[_Span, K]] = []
    for key, t in tensors:
        s = _span(t, len(spans))
        if s is not None:
            spans.append((s, key))
    spans.sort(key=lambda sk: sk[0])
    groups: list[list[K]] = []
    group: list[K] = []
    device, end = "", 0
    for (dev, first, stop, _), key in spans:
        if group and (dev != device or first >= end):
            groups.append(group)
            group = []
        end = max(end, stop) if group else stop
        device = dev
        group.append(key)
    groups.append(group)
    return [g for g in groups if len(g) >= 2]


def sample_regions(states: Sequence[PassState]) -> dict[tuple[int, int], Region]:
    """Per (pass index, input leaf): the region of memory its sample shares with other input
    leaves or parameters (of the graphed modules, and any ``nn.Parameter`` passed as a sample),
    numbered from 1 in address order, and whether a parameter is in it. Leaves that share
    nothing are absent. Byte ranges that overlap (or are equal) are one region; views of one
    tensor that do not overlap are not."""
    tensors: list[tuple[tuple[int, int] | None, Tensor]] = []
    params: dict[int, Tensor] = {}
    for st in states:
        for j, t in enumerate(st.flat_args):
            tensors.append(((st.index, j), t))
            if isinstance(t, torch.nn.Parameter):  # some module's weights, graphed or not
                params[id(t)] = t
        params.update((id(p), p) for p in st.params)
    tensors.extend((None, p) for p in params.values())
    out: dict[tuple[int, int], Region] = {}
    region = 0
    for group in overlapping(tensors):
        leaves = [leaf for leaf in group if leaf is not None]
        if not leaves:
            continue
        region += 1
        param = len(leaves) < len(group)
        for leaf in leaves:
            out[leaf] = (region, param)
    return out
