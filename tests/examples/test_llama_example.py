"""examples/llama_layers.py: HF transformers Llama decoder layers graphed and trained bitwise
equal to eager (skipped without transformers, which is only the example's dependency)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="examples/llama_layers.py needs HF transformers (pip install transformers)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "llama_layers.py")


def _run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "parameters bitwise equal to eager training: True" in p.stdout
    assert "gograph memory report: 3 pass(es), 6 graph(s)" in p.stdout
    return p.stdout


@pytest.mark.parametrize("chain", [False, True], ids=["plain", "chain_buffers"])
def test_llama_layers_on_the_eager_engine(chain: bool) -> None:
    out = _run("--cpu", "--layers", "3", "--steps", "2", *(["--chain"] if chain else []))
    assert "on the CPU eager engine" in out


@pytest.mark.cuda
@pytest.mark.parametrize("chain", [False, True], ids=["plain", "chain_buffers"])
def test_llama_layers_on_the_gpu(cuda_device, chain: bool) -> None:
    out = _run("--layers", "3", "--steps", "3", *(["--chain"] if chain else []))
    assert "step time: graphed" in out
