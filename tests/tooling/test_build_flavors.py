"""build_support/flavors.py and setup.py's use of it: a build that skips the CUDA flavor
(``GOGRAPH_CUDA=0``) removes what an earlier build left of it, so ``pip install .`` in a used
checkout cannot ship a stale extension; and the ``go`` shim that lets gopy build from ``vendor/``
(an sdist) without the module proxy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from build_support import flavors

ROOT = Path(__file__).resolve().parents[2]
STALE = ("_gographcore.cpython-312-x86_64-linux-gnu.so", "gographcore.py", "go.py")


def _plant(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("")
    for name in STALE:
        (folder / name).write_text("stale")


def test_remove_flavor_keeps_only_the_package(tmp_path: Path) -> None:
    _plant(tmp_path / "_core_cuda")
    removed = flavors.remove_flavor(tmp_path / "_core_cuda")
    assert sorted(p.name for p in removed) == sorted(STALE)
    assert [p.name for p in (tmp_path / "_core_cuda").iterdir()] == ["__init__.py"]
    assert flavors.remove_flavor(tmp_path / "missing") == []


def test_the_go_shim_builds_from_vendor(tmp_path: Path) -> None:
    real = tmp_path / "real-go"
    real.write_text('#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n')
    real.chmod(0o755)
    shim = flavors.write_go_shim(tmp_path / "bin", str(real))
    out = subprocess.run(
        [str(shim), "build", "-mod=mod", "-buildmode=c-shared", "-o", "a b.so", "."],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split("\n")[:-1] == ["[build]", "[-mod=vendor]", "[-buildmode=c-shared]", "[-o]", "[a b.so]", "[.]"]


def _tree(tmp_path: Path) -> Path:
    """What setup.py reads to start a build (its helpers, go.mod, the package folders)."""
    tree = tmp_path / "src"
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "go.mod"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "build_support", tree / "build_support", ignore=shutil.ignore_patterns("__pycache__"))
    pkg = tree / "python" / "gograph"
    for sub in ("", "_core_cpu", "_core_cuda"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "py.typed").write_text("")
    return tree


@pytest.mark.parametrize("inplace", [False, True])
def test_gograph_cuda_0_removes_an_earlier_cuda_flavor(tmp_path: Path, inplace: bool) -> None:
    tree = _tree(tmp_path)
    build_lib = tree / "build" / "lib"
    _plant(build_lib / "gograph" / "_core_cuda")
    _plant(tree / "python" / "gograph" / "_core_cuda")
    fake = tmp_path / "bin"
    fake.mkdir()
    # Go new enough for the checks; anything else it is asked fails, which ends the build early.
    (fake / "go").write_text('#!/bin/sh\n[ "$1 $2" = "env GOVERSION" ] && { echo go1.26.0; exit 0; }\nexit 3\n')
    (fake / "go").chmod(0o755)
    env = dict(os.environ, GOGRAPH_CUDA="0", PATH=os.pathsep.join([str(fake), os.environ["PATH"]]))
    cmd = [sys.executable, "setup.py", "build_ext", f"--build-lib={build_lib}", *(["--inplace"] if inplace else [])]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0  # the fake go cannot build the cpu flavor; the removal came first
    assert "(the cuda flavor is not built)" in p.stdout, p.stdout + p.stderr
    assert [f.name for f in (build_lib / "gograph" / "_core_cuda").iterdir()] == ["__init__.py"]
    in_source = sorted(f.name for f in (tree / "python" / "gograph" / "_core_cuda").iterdir())
    assert in_source == (["__init__.py"] if inplace else sorted(["__init__.py", *STALE]))
