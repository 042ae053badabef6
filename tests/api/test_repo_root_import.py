"""``import gograph`` from the repository root, where the Go folder ``gograph/`` comes first on
``sys.path``: it must load the real package, not an empty namespace package."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_from_the_repository_root_finds_the_package() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import gograph, gograph.memory; print(gograph.__file__); print(callable(gograph.make_graphed_callables))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    init, ok = out.stdout.split()
    assert ok == "True"
    assert os.path.dirname(init) != os.path.join(ROOT, "gograph")  # the Python package, not the Go folder
