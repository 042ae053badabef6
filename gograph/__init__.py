"""Not the Python package: this folder is the Go core's exported surface (the gopy facade).

Python run from the repository root finds this folder first (the current directory leads
``sys.path``). Without this file it would be imported as an empty namespace package, and
``gograph.make_graphed_callables`` would fail with an AttributeError. Instead this shim loads the
real package -- an installed gograph if there is one, else the source tree's ``python/gograph`` --
and puts it in ``sys.modules`` in its own place, so ``import gograph`` means the same everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _real_init() -> str:
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        init = os.path.join(folder, "gograph", "__init__.py")
        if folder != _ROOT and os.path.isfile(init):
            return init
    source = os.path.join(_ROOT, "python", "gograph", "__init__.py")
    if os.path.isfile(source):
        return source
    raise ImportError(
        f"gograph: {os.path.dirname(os.path.abspath(__file__))} holds the Go sources, not the Python "
        "package, and no gograph package was found: install it (pip install .) or run with PYTHONPATH=python"
    )


def _load() -> None:
    init = _real_init()
    spec = importlib.util.spec_from_file_location("gograph", init, submodule_search_locations=[os.path.dirname(init)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gograph"] = module  # the import statement returns what sys.modules holds
    spec.loader.exec_module(module)


_load()
