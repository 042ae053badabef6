"""PyTorch's own make_graphed_callables tests (test/test_cuda.py, bodies unchanged) pass against
gograph, as they pass against torch on the same machine.

The cases live in torch_make_graphed_callables_cases.py and run in a child process: PyTorch's
test utilities freeze the backend flags of the process that imports them. As PyTorch runs them,
each case runs with a fresh non-default stream current (the log shows the stream of every call),
and, in the leak-check runs, under PyTorch's CUDA memory leak check. Each run must end green with
every case run: the four cases PyTorch expects to pass are counted on their own and must pass;
the three expected failures are PyTorch's own (the autocast cache, and the unused input that is
not allowed), whatever the drop-in does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gograph

CASES = Path(__file__).with_name("torch_make_graphed_callables_cases.py")
# "test_x (__main__.TestCuda.test_x) ... ok": warnings a case prints may come between the two
OUTCOME = re.compile(
    r"^(test_\S+) \([^)\n]*\) \.\.\. .*?(ok|expected failure|FAIL|ERROR|unexpected success|skipped[^\n]*)$",
    re.M | re.S,
)
#: PyTorch's cases: test_graph_make_graphed_callables (2 parametrizations), its
#: parameterless_nograd_module sibling (4) and same_pool (1); 3 are PyTorch's expected failures.
CASES_RUN, EXPECTED_FAILURES = 7, 3
#: The cases PyTorch expects to pass: each must pass.
MUST_PASS = {
    "test_graph_make_graphed_callables_parameterless_nograd_module_with_amp_cache_disabled_allow_unused_input",
    "test_graph_make_graphed_callables_parameterless_nograd_module_without_amp_allow_unused_input",
    "test_graph_make_graphed_callables_parameterless_nograd_module_without_amp_not_allow_unused_input",
    "test_graph_make_graphed_callables_same_pool",
}
STREAM = re.compile(r"^make_graphed_callables on (the default|a non-default) stream", re.M)


def _run_cases(maker: str, leak_check: bool) -> tuple[int, str]:
    package_root = str(Path(gograph.__file__).resolve().parent.parent)
    env = dict(os.environ, GOGRAPH_UPSTREAM=maker, PYTORCH_TEST_CUDA_MEM_LEAK_CHECK=str(int(leak_check)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, str(CASES), "-v"], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.cuda
@pytest.mark.parametrize("leak_check", [False, True], ids=["plain", "leak_check"])
@pytest.mark.parametrize("maker", ["gograph", "torch"])
def test_torch_make_graphed_callables_tests_pass(cuda_device: torch.device, maker: str, leak_check: bool) -> None:
    pytest.importorskip("expecttest", reason="PyTorch's test utilities need expecttest (pip install expecttest)")
    rc, log = _run_cases(maker, leak_check)
    print(log)  # the streams and outcomes, for the run's log (pytest -s, or the report of a failure)
    outcomes = dict(OUTCOME.findall(log))
    assert f"make_graphed_callables: {'gograph.graphs' if maker == 'gograph' else 'torch.cuda.graphs'}" in log
    assert len(outcomes) == CASES_RUN and f"Ran {CASES_RUN} tests" in log, log[-4000:]
    passed = {name for name, how in outcomes.items() if how == "ok"}
    assert passed == MUST_PASS, f"PyTorch's passing cases that did not pass: {MUST_PASS - passed}\n{log[-4000:]}"
    assert list(outcomes.values()).count("expected failure") == EXPECTED_FAILURES, outcomes
    assert rc == 0, log[-4000:]
    streams = STREAM.findall(log)
    assert streams and set(streams) == {"a non-default"}, f"calls by stream: {streams}"
