"""Put torch into a second test venv without another copy of its CUDA libraries.

``make test-pythons`` runs the CPU test suite on every supported CPython, each in its own venv.
torch's Linux wheel pulls ~2.7 GB of CUDA libraries (``nvidia-*``, ``cuda-toolkit``) and ~0.6 GB
of triton per venv, which ran a CI machine out of disk. The CUDA libraries are the same files for
every CPython (``py3-none`` wheels), and the CPU tests never load triton, so this script installs
into the venv it runs in:

- the torch of the full venv (``.venv``, made by ``make venv``), the same version exactly,
  because the linked libraries are the ones that version was built against;
- torch's other requirements, less the CUDA libraries and triton;
- a symlink for every entry of the full venv's ``nvidia/`` folder the venv lacks, so that
  ``import torch`` finds libcudart, cuBLAS and the rest where torch's RPATH looks for them.

Run it with the second venv's python, after that venv's other packages are in (an entry a
package of its own installed, such as ``nvidia-cuda-runtime-cu12``'s headers, stays its own)::

    .venv-3.10/bin/python build_support/lean_venv.py --full-venv .venv

The second venv then depends on the full one: remove it when you remove ``.venv``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import subprocess
import sys
import sysconfig
from pathlib import Path

log = logging.getLogger("lean_venv")

# Distributions shared through the links (CPython-independent data) or left out (triton: no CPU
# test compiles a kernel). Prefixes of normalized names.
SHARED_OR_SKIPPED = ("nvidia-", "cuda-toolkit", "triton")

_FULL_VENV_QUERY = (
    "import json, sysconfig, importlib.metadata as m; "
    "print(json.dumps({'torch': m.version('torch'), 'requires': m.requires('torch'), "
    "'site': sysconfig.get_paths()['purelib']}))"
)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def full_venv_torch(full_venv: Path) -> tuple[str, list[str], Path]:
    """The torch version installed in ``full_venv``, its requirements (``Requires-Dist`` lines)
    and that venv's site-packages folder."""
    python = full_venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{full_venv} has no bin/python: run `make venv` first")
    out = subprocess.run([str(python), "-c", _FULL_VENV_QUERY], check=True, capture_output=True)
    found = json.loads(out.stdout)
    return found["torch"], found["requires"] or [], Path(found["site"])


def kept_requirements(requires: list[str]) -> list[str]:
    """torch's requirements this platform needs, less the shared and skipped distributions."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    kept = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name).startswith(SHARED_OR_SKIPPED):
            continue
        kept.append(str(req))
    return kept


def link_missing(shared: Path, own: Path) -> list[str]:
    """Symlink each entry of ``shared`` that ``own`` lacks; returns the linked names."""
    own.mkdir(parents=True, exist_ok=True)
    linked = []
    for entry in sorted(shared.iterdir()):
        target = own / entry.name
        if not target.exists() and not target.is_symlink():
            target.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
            linked.append(entry.name)
    return linked


def main(argv: list[str] | None = None) -> int:
    """Install the lean torch into the running venv; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-venv", type=Path, required=True, help="venv with the full torch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    version, requires, full_site = full_venv_torch(args.full_venv)
    shared = full_site / "nvidia"
    if not shared.is_dir():
        raise SystemExit(f"{full_site} has no nvidia/ folder: is {args.full_venv}'s torch a CUDA build?")
    _pip("packaging")
    importlib.invalidate_caches()  # installed after this process started
    # The requirements first, torch without its own last: pip then has no unmet requirement of
    # torch's to warn about while it resolves.
    kept = kept_requirements(requires)
    if kept:
        _pip(*kept)
    _pip("--no-deps", f"torch=={version}")
    own_site = Path(sysconfig.get_paths()["purelib"])
    linked = link_missing(shared, own_site / "nvidia")
    log.info("torch %s; linked nvidia/{%s} from %s", version, ",".join(linked), shared)
    subprocess.run([sys.executable, "-c", "import torch; torch.ones(2).sum()"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
