"""Build-tree helpers for setup.py: removing a core flavor the build skips, and the ``go`` shim
that lets gopy build from ``vendor/``.

* A flavor skipped by this build (``GOGRAPH_CUDA=0``, or no ``cuda.h``) must not ship from an
  earlier build: ``pip install .`` packs ``build/lib*/``, where a previous build left the CUDA
  flavor's extension and its generated wrappers.
* gopy 0.4.10 runs ``go build -mod=mod``, which ignores ``vendor/`` and asks the module proxy;
  the shim, first on PATH while gopy runs, passes ``-mod=vendor`` instead, so an sdist (which
  carries ``vendor/``) builds with no network.
"""

from __future__ import annotations

import stat
from pathlib import Path

__all__ = ["FLAVOR_FILES", "remove_flavor", "write_go_shim"]

#: What a built flavor package holds besides its ``__init__.py``: gopy's extension and wrappers.
FLAVOR_FILES = ("_gographcore*.so", "gographcore.py", "go.py")


def remove_flavor(package_dir: Path) -> list[Path]:
    """Removes a flavor's built files from ``package_dir`` (its ``__init__.py`` stays); returns
    what was removed."""
    removed = []
    if package_dir.is_dir():
        for pattern in FLAVOR_FILES:
            for f in sorted(package_dir.glob(pattern)):
                f.unlink()
                removed.append(f)
    return removed


_SHIM = """#!/bin/sh
# Written by gograph's setup.py: gopy runs `go build -mod=mod`; this tree builds from vendor/.
for a in "$@"; do
  shift
  if [ "$a" = "-mod=mod" ]; then a="-mod=vendor"; fi
  set -- "$@" "$a"
done
exec "{go}" "$@"
"""


def write_go_shim(folder: Path, real_go: str) -> Path:
    """Writes ``folder/go``, which runs ``real_go`` with ``-mod=mod`` replaced by ``-mod=vendor``."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "go"
    shim.write_text(_SHIM.format(go=real_go))
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return shim
