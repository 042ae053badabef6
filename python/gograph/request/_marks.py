"""Marks that let the argument checks recognise gograph's own objects without importing them
(the checks sit below the modules that define those objects)."""

from __future__ import annotations

from typing import Any

__all__ = ["GraphedMark"]


class GraphedMark:
    """Base class of :class:`gograph.GraphedCallable`: ``isinstance(x, GraphedMark)`` is how
    :mod:`gograph.request._args` refuses graphing a graphed callable again. ``original_forward`` and
    ``original_forward_is_method`` are what a module's forward was before it was graphed;
    ``is_reset`` whether its graphs were released; ``label`` how messages name it."""

    __slots__ = ()
    label: str
    original_forward: Any
    original_forward_is_method: bool

    @property
    def is_reset(self) -> bool:
        raise NotImplementedError
