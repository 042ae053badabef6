"""Flavor selection of the Go core (gograph.core._native)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gograph
from gograph.core import _native

PYTHON_DIR = os.path.dirname(os.path.dirname(gograph.__file__))


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = PYTHON_DIR + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e, timeout=300
    )


def test_exactly_one_flavor_is_loaded():
    assert _native.flavor in ("cpu", "cuda")
    assert _native.core.flavor() == _native.flavor
    assert gograph.flavor == _native.flavor
    loaded = [m for m in sys.modules if m.startswith(("gograph._core_cpu.", "gograph._core_cuda."))]
    packages = {m.split(".")[1] for m in loaded}
    assert packages == {f"_core_{_native.flavor}"}


def test_availability_and_reason_agree():
    if gograph.cuda_available():
        assert gograph.cuda_unavailable_reason() is None
    else:
        reason = gograph.cuda_unavailable_reason()
        assert isinstance(reason, str) and len(reason) > 10


def test_disable_env_forces_cpu_flavor():
    p = _run(
        """
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        import gograph
        print("FLAVOR", gograph.flavor, gograph.cuda_available())
        print("REASON", gograph.cuda_unavailable_reason())
    """,
        GOGRAPH_DISABLE_CUDA="1",
    )
    assert p.returncode == 0, p.stderr
    assert "FLAVOR cpu False" in p.stdout
    assert "GOGRAPH_DISABLE_CUDA" in p.stdout.split("REASON", 1)[1]
    assert "loaded the cpu flavor" in p.stdout  # the choice is logged on the "gograph" logger


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the probe on a machine without a GPU")
def test_probe_names_the_cause_without_a_driver():
    reason = _native.probe_driver()
    assert reason is not None
    assert any(w in reason for w in ("libcuda", "cuInit", "no devices", "cuDeviceGetCount"))
    assert not gograph.cuda_available()
    assert gograph.cuda_unavailable_reason() == reason


def test_core_contract_basics():
    core = _native.core
    assert isinstance(core.core_version(), str) and core.core_version()
    if _native.flavor == "cpu":
        with pytest.raises(RuntimeError):
            core.begin_capture(1234, 0)  # no CUDA in the cpu flavor
    assert isinstance(gograph.live_graphs(), int)
    assert isinstance(gograph.live_passes(), int)
    assert isinstance(gograph.__version__, str) and gograph.__version__
