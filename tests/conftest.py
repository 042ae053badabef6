"""Shared pytest setup for gograph.

* ``cuda`` marker: the test needs a GPU. It is skipped, with the reason, unless torch sees CUDA
  *and* gograph loaded the cuda flavor of its core.
* every test checks that it leaves no pass record behind (``gograph.live_passes()`` back to its
  value before the test, after a garbage collection).
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

try:
    import gograph
except ImportError:  # running from a source checkout without PYTHONPATH=python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    import gograph

import torch


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a GPU: torch.cuda.is_available() is False"
    if not gograph.cuda_available():
        return f"needs the cuda flavor of the gograph core: {gograph.cuda_unavailable_reason()}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cuda: needs an NVIDIA GPU and the cuda flavor of the gograph core (skipped otherwise)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _cuda_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.gograph_call_passed = report.passed  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def no_leaked_passes(request: pytest.FixtureRequest):
    """Fails a passing test that leaves pass records (or graphs) alive in the core once its
    objects are gone. (Counts may also drop below the baseline: a failed earlier test's
    traceback can release its objects late.)"""
    gc.collect()
    passes, graphs = gograph.live_passes(), gograph.live_graphs()
    yield
    if not getattr(request.node, "gograph_call_passed", False):
        return
    gc.collect()
    assert gograph.live_passes() <= passes, "the test leaked gograph pass records"
    assert gograph.live_graphs() <= graphs, "the test leaked graphs"


@pytest.fixture
def eager_engine() -> gograph.EagerEngine:
    """A fresh eager engine (its pool reference counts start at zero)."""
    return gograph.EagerEngine()


@pytest.fixture
def cuda_device() -> torch.device:
    reason = _cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def no_tf32():
    """fp32 matmuls without TF32, so graphed and eager results can be compared bitwise."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
