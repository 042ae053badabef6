"""build_support/prereqs.py and the Makefile's use of it: a missing prerequisite (Go, a C
compiler, a supported CPython, a venv made by the PYTHON you set) stops `make` with one line
before anything is downloaded or built; on a machine without a GPU it points at torch's CPU
wheels (TORCH_INDEX_URL)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from build_support import prereqs

ROOT = Path(__file__).resolve().parents[2]


def fake_go(folder: Path, version: str) -> Path:
    """A ``go`` that answers ``go env GOVERSION`` with ``version``."""
    folder.mkdir(parents=True, exist_ok=True)
    go = folder / "go"
    go.write_text(f"#!/bin/sh\necho {version}\n")
    go.chmod(0o755)
    return go


def test_an_old_go_is_named_with_what_to_do(tmp_path: Path) -> None:
    go = fake_go(tmp_path, "go1.19.8")
    with pytest.raises(prereqs.PrereqError, match=r"needs go >= 1\.26; .*/go is go1\.19\.8: install a newer Go"):
        prereqs.find_go(str(go))


def test_a_new_enough_go_is_found(tmp_path: Path) -> None:
    go = fake_go(tmp_path, "go1.26.3")
    assert prereqs.find_go(str(go)) == str(go)


def test_no_go_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("GO", raising=False)
    with pytest.raises(prereqs.PrereqError, match=r"needs the Go toolchain \(go >= 1\.26\) on PATH"):
        prereqs.find_go()


def test_a_missing_c_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(prereqs.PrereqError, match=r"needs a C compiler for cgo \(CC=no-such-cc is not found\)"):
        prereqs.check_c_compiler()


@pytest.mark.parametrize(
    ("version", "ok"), [((3, 9, 18), False), ((3, 10, 0), True), ((3, 13, 1), True), ((3, 14, 0), False)]
)
def test_supported_pythons(version: tuple[int, ...], ok: bool) -> None:
    if ok:
        prereqs.check_python(version, "python")
    else:
        with pytest.raises(prereqs.PrereqError, match=r"needs CPython 3\.10-3\.13, but python is"):
            prereqs.check_python(version, "python")


def _venv(tmp_path: Path, version: str) -> Path:
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {version}\n")
    return venv


def test_a_venv_of_another_cpython_is_refused_with_what_to_do(tmp_path: Path) -> None:
    venv = _venv(tmp_path, "3.12.1")
    prereqs.check_venv(str(venv), (3, 12), "python3.12")
    with pytest.raises(prereqs.PrereqError, match=r"made with CPython 3\.12, but PYTHON=python3\.11 is 3\.11: remove"):
        prereqs.check_venv(str(venv), (3, 11), "python3.11")
    prereqs.check_venv(str(tmp_path / "none"), (3, 11), "python3.11")  # no venv yet: nothing to compare


def test_the_cpu_wheels_are_suggested_before_a_download_without_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prereqs, "gpu_present", lambda: False)
    monkeypatch.delenv("TORCH_INDEX_URL", raising=False)
    note = prereqs.torch_note(str(tmp_path / "new-venv"))
    assert note is not None and f"TORCH_INDEX_URL={prereqs.CPU_TORCH_INDEX}" in note
    assert prereqs.torch_note(str(_venv(tmp_path, "3.12.1"))) is None  # torch is there already
    monkeypatch.setenv("TORCH_INDEX_URL", prereqs.CPU_TORCH_INDEX)
    assert prereqs.torch_note(str(tmp_path / "new-venv")) is None
    monkeypatch.setattr(prereqs, "gpu_present", lambda: True)
    monkeypatch.delenv("TORCH_INDEX_URL")
    assert prereqs.torch_note(str(tmp_path / "new-venv")) is None


# ---------------------------------------------------------------------------------------------
# The Makefile: one line, before anything is downloaded
# ---------------------------------------------------------------------------------------------
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make(tmp_path: Path, *args: str, path: str) -> subprocess.CompletedProcess[str]:
    venv = tmp_path / "venv-of-test"
    env = dict(os.environ, PATH=path)
    # Nothing of an enclosing make (`make test-pythons` passes LEAN_FROM, PYTEST_ARGS, ... down
    # through MAKEFLAGS) may reach the make under test.
    for name in ("GO", "PYTHON", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "LEAN_FROM", "PYTEST_ARGS"):
        env.pop(name, None)
    return subprocess.run(
        ["make", "-n", "--no-print-directory", f"VENV={venv}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _path_with(folder: Path) -> str:
    """PATH with ``folder`` first and no Go: the system folders (cc, make, sh) only."""
    return os.pathsep.join([str(folder), os.path.dirname(sys.executable), "/usr/bin", "/bin"])


@needs_make
def test_make_demo_with_an_old_go_stops_in_one_line_before_any_download(tmp_path: Path) -> None:
    fake_go(tmp_path / "bin", "go1.19.8")
    p = _make(tmp_path, f"PYTHON={sys.executable}", "demo", path=_path_with(tmp_path / "bin"))
    assert p.returncode != 0
    assert p.stdout == ""  # nothing would run: no venv, no torch download
    lines = [line for line in p.stderr.splitlines() if "***" in line]
    assert len(lines) == 1 and "needs go >= 1.26" in lines[0] and "go1.19.8" in lines[0], p.stderr
    assert not (tmp_path / "venv-of-test").exists()


@needs_make
def test_make_demo_without_go_stops_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    p = _make(tmp_path, f"PYTHON={sys.executable}", "demo", path=_path_with(tmp_path / "bin"))
    assert p.returncode != 0 and p.stdout == ""
    assert "needs the Go toolchain (go >= 1.26) on PATH" in p.stderr


@needs_make
def test_make_refuses_a_python_that_did_not_make_the_venv(tmp_path: Path) -> None:
    fake_go(tmp_path / "bin", "go1.26.0")
    venv = tmp_path / "venv-of-test"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("version = 3.9.0\n")
    p = _make(tmp_path, f"PYTHON={sys.executable}", "demo", path=_path_with(tmp_path / "bin"))
    assert p.returncode != 0 and p.stdout == ""
    assert f"was made with CPython 3.9, but PYTHON={sys.executable}" in p.stderr
    assert "rm -rf" in p.stderr


@needs_make
def test_make_passes_torch_index_url_and_shows_progress(tmp_path: Path) -> None:
    fake_go(tmp_path / "bin", "go1.26.0")
    url = prereqs.CPU_TORCH_INDEX
    p = _make(tmp_path, f"PYTHON={sys.executable}", f"TORCH_INDEX_URL={url}", "venv", path=_path_with(tmp_path / "bin"))
    assert p.returncode == 0, p.stderr
    (torch_line,) = [line for line in p.stdout.splitlines() if '"torch==' in line]
    assert f"--index-url {url}" in torch_line and " -q " not in torch_line and "--progress-bar on" in torch_line
