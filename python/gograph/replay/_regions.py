"""Which sample args share memory: with each other (one tensor passed to several callables, views
of one tensor, one tensor twice in a callable's args) or with a parameter.

torch makes each sample its graph's static input, so a sample shared by two graphs is one buffer
both read, and a copy-in for the second silently changes what the first one's pending backward
reads. The core's planner (``separate`` in internal/lifetime) decides, by the passes' lifetimes in
the schedule and whether each leaf requires grad, which leaves of a shared region keep their
sample and which get a clone; this module only measures the overlaps (``_reuse.sample_regions`` reads them as facts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["Region", "overlapping"]

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
