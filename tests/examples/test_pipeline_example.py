"""examples/pipeline_example.py runs: on the CPU eager engine here, on the GPU with the marker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pipeline_example.py")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, env=env, timeout=600)


def _check(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "graphed 8 forward passes: 24 captures" in out
    assert out.count("max |grad - eager grad|") >= 1
    assert "gograph memory report: 8 pass(es), 24 graph(s)" in out
    assert "replay-order guard on" in out
    assert "after reset(): 0 graphs left in the core" in out


def test_pipeline_example_on_the_eager_engine():
    p = _run("--cpu", "--steps", "2")
    _check(p)
    assert "on the CPU eager engine" in p.stdout
    assert "shared storages:" in p.stdout  # _reuse_graph_input_output_buffers shares buffers


@pytest.mark.cuda
def test_pipeline_example_on_the_gpu(cuda_device):
    p = _run("--steps", "3")
    _check(p)
    assert "on CUDA (" in p.stdout
    assert "reserved" in p.stdout and "24 CUDA graphs" in p.stdout
