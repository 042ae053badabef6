"""The engines a graphed callable runs on (public): :class:`CudaEngine`, :class:`EagerEngine`,
:class:`EagerPool`, the :class:`Engine` base, and the pass kinds. Defined in
:mod:`gograph.runtime.engines` (whose ``__all__`` lists them); this module is their public path."""

from __future__ import annotations

from .runtime import engines as _engines
from .runtime.engines import *  # noqa: F403 (the public names, as runtime/engines.py lists them)

__all__ = list(_engines.__all__)
