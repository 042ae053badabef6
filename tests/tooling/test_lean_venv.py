"""build_support/lean_venv.py, which `make test-pythons` uses to give each extra CPython's venv
torch without another copy of its CUDA libraries: which of torch's requirements it installs, and
that it links only what the venv lacks (an entry of the venv's own, such as the cu12 runtime's
headers the build reads, stays its own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from build_support import lean_venv

pytest.importorskip("packaging")

# torch 2.11.0's Requires-Dist on Linux, as its wheel's METADATA has them.
TORCH_REQUIRES = [
    "filelock",
    "typing-extensions>=4.10.0",
    "setuptools<82",
    "sympy>=1.13.3",
    "cuda-toolkit[cublas,cudart]==13.0.2; platform_system == 'Linux'",
    "cuda-bindings<14,>=13.0.3; platform_system == 'Linux'",
    "nvidia-cudnn-cu13==9.19.0.56; platform_system == 'Linux'",
    "nvidia_nccl_cu13==2.28.9; platform_system == 'Linux'",
    "triton==3.6.0; platform_system == 'Linux'",
    "pywin32; platform_system == 'Windows'",
    "optree>=0.13.0; extra == 'optree'",
]


def test_keeps_what_the_cpu_tests_need_and_drops_the_shared_libraries() -> None:
    kept = lean_venv.kept_requirements(TORCH_REQUIRES)
    names = [line.split("<")[0].split(">")[0].split(";")[0] for line in kept]
    assert names == ["filelock", "typing-extensions", "setuptools", "sympy", "cuda-bindings"]


def test_links_only_the_entries_the_venv_lacks(tmp_path: Path) -> None:
    shared = tmp_path / "full" / "nvidia"
    for name in ("cu13", "cudnn", "cuda_runtime"):
        (shared / name / "lib").mkdir(parents=True)
    own = tmp_path / "lean" / "nvidia"
    (own / "cuda_runtime" / "include").mkdir(parents=True)  # the venv's own cu12 runtime

    assert lean_venv.link_missing(shared, own) == ["cu13", "cudnn"]
    assert (own / "cu13").resolve() == (shared / "cu13").resolve()
    assert not (own / "cuda_runtime").is_symlink()
    assert lean_venv.link_missing(shared, own) == []  # a second run changes nothing


def test_refuses_a_full_venv_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="make venv"):
        lean_venv.full_venv_torch(tmp_path / "no-venv")
