"""CPU smoke run of the multi-GPU checks: ``scripts/multigpu-run.sh --cpu-smoke``.

Two processes under torchrun, gloo backend, gograph's eager engine: the tensor-parallel MLP (with
and without dropout from a per-rank generator), DDP over graphed blocks, data-parallel gradient
reduction inside the graphed backward, and the reset-then-destroy_process_group teardown, end to
end. The GPU run of the same code is ``bash scripts/multigpu-run.sh`` on a 2-GPU machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "multigpu-run.sh")
EXPECTED = ["tp_mlp", "tp_mlp_dropout", "ddp", "dp_ingraph"]
LIMIT_S = 240  # the script bounds torchrun itself (--timeout); this bounds the whole subprocess


def _skip_reason() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend"
    for tool in ("bash", "timeout"):
        if shutil.which(tool) is None:
            return f"needs {tool} on PATH"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_multigpu_cpu_smoke(tmp_path):
    env = dict(os.environ)
    env.update(OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        proc = subprocess.run(
            ["bash", SCRIPT, "--cpu-smoke", "--timeout", str(LIMIT_S - 30)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the cpu smoke run did not finish within {LIMIT_S} s:\n{e.stdout or ''}\n{e.stderr or ''}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"multigpu-run.sh --cpu-smoke exited {proc.returncode}:\n{out[-6000:]}"

    summary = json.loads((tmp_path / "multigpu-summary.json").read_text())
    assert summary["passed"] is True
    assert summary["env"]["mode"] == "cpu" and summary["env"]["world_size"] == 2
    assert summary["env"]["backend"] == "gloo"
    assert [t["name"] for t in summary["tests"]] == EXPECTED
    for test in summary["tests"]:
        assert test["passed"], test
        assert len(test["ranks"]) == 2
        for rank in test["ranks"]:
            assert rank["steps"] == 10
            assert rank["checks"]["losses_bitwise_equal"] and rank["checks"]["params_bitwise_equal"]
            assert rank["checks"]["graphed_on_eager_engine"]
    tp = summary["tests"][0]["ranks"][0]["checks"]
    assert tp["tp_matches_dense_forward"] and tp["tp_matches_dense_backward"]
    assert summary["tests"][1]["ranks"][1]["checks"]["tp_generator_advanced_like_eager"]
    assert all(r["checks"]["replicas_in_sync"] for r in summary["tests"][2]["ranks"])
    teardown = summary["teardown"]
    assert teardown["passed"]
    assert [r["destroy_returned"] for r in teardown["ranks"]] == [True, True]
    assert all(r["live_graphs_left"] <= 0 and r["reset"] > 0 for r in teardown["ranks"])
    for name in [*EXPECTED, "teardown"]:
        assert f"PASS {name}" in out


def test_parallel_layers_single_process_match_dense(monkeypatch):
    """The tensor-parallel blocks with a group of one process are the dense block exactly."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    sys.path.insert(0, os.path.join(ROOT, "tests", "multigpu"))
    from parallel_layers import DenseMLPBlock, TPMLPBlock

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        block = TPMLPBlock(8, 16, torch.Generator().manual_seed(0))
        dense = DenseMLPBlock(*block.dense)
        x = torch.randn(4, 8, requires_grad=True)
        xd = x.detach().clone().requires_grad_(True)
        out, ref = block(x), dense(xd)
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
        out.sum().backward()
        ref.sum().backward()
        assert torch.allclose(x.grad, xd.grad, rtol=1e-6, atol=1e-6)
        assert torch.allclose(block.fc1.weight.grad, dense.fc1.weight.grad, rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()
