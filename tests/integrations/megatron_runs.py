"""Runs of bench/megatron_train.py (Megatron-Core's GPT trained as megatron.training trains it) in
child processes, for the Megatron tests: Megatron's parallel state, the TransformerEngine names its
graph path imports and the CPU redirections stay out of the pytest process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "bench" / "megatron_train.py"


def _import_megatron_package() -> None:
    """Imports Megatron-Core's ``megatron``, a namespace package, with bench/ off sys.path: any
    ``megatron.py`` on the path shadows a namespace package -- bench/megatron.py too, once a test
    put bench/ on the path. Once imported, ``megatron.core`` resolves through its ``__path__``."""
    if "megatron" in sys.modules:
        return
    bench = str(ROOT / "bench")
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != bench]
    try:
        import megatron  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = saved


def megatron_skip_reason() -> str | None:
    """Why Megatron-Core tests cannot run here, or None."""
    _import_megatron_package()
    found = False
    if hasattr(sys.modules.get("megatron"), "__path__"):  # the package, not a module shadowing it
        try:
            found = importlib.util.find_spec("megatron.core") is not None
        except (ImportError, ValueError):
            found = False
    if not found:
        return "needs Megatron-Core: pip install megatron-core==0.19.2 (CPython >= 3.12)"
    return None


needs_megatron = pytest.mark.skipif(megatron_skip_reason() is not None, reason=megatron_skip_reason() or "")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def train(tmp_path: Path, *args: str, ranks: int = 1, timeout: float = 300) -> list[list[dict[str, Any]]]:
    """Trains the arms of ``args`` (megatron_train.py's options) on ``ranks`` pipeline ranks;
    returns per rank the saved traces, one per arm."""
    out = tmp_path / "traces.pt"
    if ranks == 1:
        cmd = [sys.executable, str(TRAIN), *args, "--out", str(out)]
    else:
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd = [sys.executable, *launch, str(TRAIN), *args, "--pp", str(ranks), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    paths = [out] if ranks == 1 else [Path(f"{out}.rank{r}") for r in range(ranks)]
    return [torch.load(p) for p in paths]


def differences(ref: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """bench/megatron_train.py's bit-for-bit comparison of two traces."""
    return list(_megatron_train().differences(ref, other))


def _megatron_train() -> Any:
    """bench/megatron_train.py, loaded from its path (bench/ holds a megatron.py, which must not
    come before Megatron-Core's namespace package on sys.path)."""
    name = "_gograph_bench_megatron_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TRAIN)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def assert_trains_like_eager(traces: list[dict[str, Any]]) -> None:
    """Every arm's losses, per-step main grads and final parameters equal eager's, bit for bit,
    and the comparison can fail: training moved the parameters and the grads are not zero."""
    eager, *others = traces
    assert eager["arm"] == "eager"
    assert len(eager["main_grads"]) >= 2 and any(g.abs().sum() > 0 for g in eager["main_grads"][-1].values())
    for other in others:
        diffs = differences(eager, other)
        assert not diffs, f"the {other['arm']} arm differs from eager: {diffs}"
