"""Warnings at the user's call site: the first frame outside the gograph package.

``warnings.warn(..., stacklevel=N)`` with a fixed N points at the right line only from one
call path; gograph's warnings come from several depths (a build, a plan, a replay), so the
level is counted from the stack. Python 3.12's ``skip_file_prefixes`` does the same, but
gograph supports 3.10.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

__all__ = ["warn_user"]

#: gograph's own folder (this file is in its support/ folder).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: gograph's context managers run their bodies through contextlib's frames.
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR) or path == _CONTEXTLIB


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside gograph (and
    the ``contextlib`` frames of its context managers), so
    the warning names the user's line and the default filter shows it once per such line."""
    level = 2  # the caller of warn_user
    frame = sys._getframe(1)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
