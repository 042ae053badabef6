"""What building gograph needs, checked before anything is downloaded or compiled.

``make`` runs this with the interpreter it will build with (``PYTHON``), before it creates
``.venv`` (which downloads torch) or builds the extension; ``setup.py`` calls :func:`check_build`
before compiling. A missing prerequisite is one line saying what to do, not a traceback::

    python build_support/prereqs.py [--venv .venv] [--python-given] [--torch-note]

Exit status 1 and the message on stdout when something is missing; notes (e.g. that a machine
without an NVIDIA GPU can take torch's CPU wheels) go to stderr. Plain Python 3.6+ syntax, so
that an interpreter too old for gograph can still say that it is.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The CPython versions gograph builds for (one extension per minor version).
PYTHONS = ((3, 10), (3, 13))
#: torch's index of CPU-only wheels (no CUDA libraries: ~200 MB instead of ~5 GB).
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


class PrereqError(Exception):
    """A missing or unsuitable prerequisite; the message says what to do."""


def _dotted(v: Tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def go_mod_version(root: str = HERE) -> Tuple[int, ...]:
    """The Go version ``go.mod`` asks for (major, minor)."""
    with open(os.path.join(root, "go.mod")) as f:
        for line in f:
            if line.startswith("go "):
                return tuple(int(x) for x in line.split()[1].split(".")[:2])
    return (1, 26)


def check_python(version: Tuple[int, ...] = tuple(sys.version_info[:3]), exe: str = sys.executable) -> None:
    lo, hi = PYTHONS
    if not lo <= tuple(version[:2]) <= hi:
        raise PrereqError(
            "gograph needs CPython {}-{}, but {} is {}: set PYTHON to a supported interpreter "
            "(e.g. PYTHON=python3.12 make demo)".format(_dotted(lo), _dotted(hi), exe, _dotted(version))
        )


def find_go(go: Optional[str] = None, root: str = HERE) -> str:
    """The ``go`` command (``$GO``, else ``go`` on PATH) if it is new enough for go.mod."""
    want = go_mod_version(root)
    name = go or os.environ.get("GO") or "go"
    path = shutil.which(name)
    if path is None:
        raise PrereqError(
            "building gograph needs the Go toolchain (go >= {}) on PATH: install it from go.dev/dl "
            "(distribution packages are often older), then retry".format(_dotted(want))
        )
    out = subprocess.run([path, "env", "GOVERSION"], check=False, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    text = out.stdout.decode(errors="replace").strip()
    have = tuple(int(x) for x in re.findall(r"\d+", text)[:2]) if text.startswith("go") else ()
    if not have:
        raise PrereqError(
            "building gograph needs go >= {}; `{} env GOVERSION` printed {!r}: install Go from go.dev/dl "
            "and put it first on PATH".format(_dotted(want), path, text)
        )
    if have < want:
        raise PrereqError(
            "building gograph needs go >= {}; {} is {}: install a newer Go from go.dev/dl and put it "
            "first on PATH".format(_dotted(want), path, text)
        )
    return path


def check_c_compiler() -> None:
    cc = os.environ.get("CC", "").split()
    if cc and shutil.which(cc[0]):
        return
    if not cc and any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        return
    what = "CC={} is not found".format(os.environ["CC"]) if cc else "no cc, gcc or clang on PATH"
    raise PrereqError(
        "building gograph needs a C compiler for cgo ({}): install gcc (apt-get install gcc) or set CC, "
        "then retry".format(what)
    )


def check_build(go: Optional[str] = None) -> str:
    """Go and a C compiler, as the build needs them; returns the ``go`` command."""
    path = find_go(go)
    check_c_compiler()
    return path


def venv_python_version(venv: str) -> Optional[Tuple[int, ...]]:
    """The (major, minor) of the interpreter ``venv`` was made with (its ``pyvenv.cfg``)."""
    try:
        with open(os.path.join(venv, "pyvenv.cfg")) as f:
            for line in f:
                key, _, value = line.partition("=")
                if key.strip() in ("version", "version_info"):
                    return tuple(int(x) for x in value.strip().split(".")[:2])
    except OSError:
        return None
    return None


def check_venv(venv: str, version: Tuple[int, ...] = tuple(sys.version_info[:2]), exe: str = sys.executable) -> None:
    """A ``PYTHON`` given explicitly must be the interpreter the existing venv was made with:
    otherwise make would build for the venv's CPython and stamp it as ``PYTHON``'s."""
    have = venv_python_version(venv)
    if have is not None and have != tuple(version[:2]):
        raise PrereqError(
            "{} was made with CPython {}, but PYTHON={} is {}: remove it (rm -rf {}) to set it up again "
            "with {}, or use VENV=.venv-{} to keep both".format(
                venv, _dotted(have), exe, _dotted(version[:2]), venv, _dotted(version[:2]), _dotted(version[:2])
            )
        )


def gpu_present() -> bool:
    """An NVIDIA driver and device on this machine (the device nodes, or nvidia-smi)."""
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def torch_note(venv: str) -> Optional[str]:
    """Before torch is downloaded into a new venv on a machine without an NVIDIA GPU: the CPU
    wheels' index, unless one was chosen already."""
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")) or os.environ.get("TORCH_INDEX_URL") or gpu_present():
        return None
    return (
        "note: no NVIDIA GPU found; torch with its CUDA libraries is ~5 GB. For torch's CPU wheels "
        "(~200 MB): TORCH_INDEX_URL={} make ...".format(CPU_TORCH_INDEX)
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", help="the venv make uses (checked against this interpreter)")
    parser.add_argument("--python-given", action="store_true", help="PYTHON was set by the caller")
    parser.add_argument("--no-build", action="store_true", help="check the interpreter only (no Go, no C)")
    parser.add_argument("--torch-note", action="store_true", help="say when torch's CPU wheels would do")
    args = parser.parse_args(argv)
    try:
        check_python()
        if args.venv and args.python_given:
            check_venv(args.venv)
        if not args.no_build:
            check_build()
    except PrereqError as e:
        print(e)
        return 1
    note = torch_note(args.venv) if args.venv and args.torch_note else None
    if note:
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
