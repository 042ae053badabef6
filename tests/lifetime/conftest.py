"""The lifetime fuzzer's pytest setup: the ``fuzz`` marker, and a frozen heap so the liveness
oracle's garbage collections only walk what a case made."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import pytest
import torch

log = logging.getLogger(__name__)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fuzz: a property-based fuzzer (hypothesis); GOGRAPH_FUZZ_CASES, GOGRAPH_FUZZ_SEED"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Per fuzz test that ran: how many cases drew each feature, and how many of those were
    built and trained (the rest: a documented refusal or an injected fault)."""
    for rep in (*terminalreporter.stats.get("passed", ()), *terminalreporter.stats.get("failed", ())):
        if getattr(rep, "when", None) != "call":
            continue
        for name, counts in rep.user_properties:
            if name == "fuzz_feature_counts" and counts:
                parts = [f"{f} {d} (built {b}, {100 * b // max(d, 1)}%)" for f, (d, b) in counts.items()]
                terminalreporter.write_line(f"{rep.nodeid.rsplit('::', 1)[-1]} feature counts: {'; '.join(parts)}")


def _warm_up(device: torch.device) -> None:
    """A few cases of every program shape: what torch and hypothesis make lazily on first use
    (modules, registrations, caches: ~100k objects) exists before the heap is frozen."""
    from _fuzz_case import run_case
    from _fuzz_config import Case, Layer, Pipeline

    for case in (
        Case(layers=(Layer("mlp"), Layer("kwargs", from_prev=True), Layer("nested"), Layer("loss", from_prev=True))),
        Case(layers=(Layer("linear"), Layer("multi", from_prev=True)), chain_buffers=True, autograd_grad=True),
        Case(layers=(Layer("block"), Layer("kwblock")), pipeline=Pipeline(1, 0, 2, (1, 1)), reuse=True, hooks=True),
        Case(layers=(Layer("dropout"), Layer("fn")), debug_replay_order=True, evaluate=True, fault=(1, "forward", 1)),
        # a weight-only backward, captured with no warmup iteration before it
        Case(layers=(Layer("linear", input_grad=False),), num_warmup_iters=0, set_to_none=False),
    ):
        try:
            run_case(case, device)  # what it finds, the tests report
        except Exception as e:
            log.info("lifetime fuzzer warm-up case raised %r", e)


@pytest.fixture(scope="module")
def frozen_heap() -> Iterator[None]:
    """``gc.freeze()`` after a warm-up on the CPU: a full collection then costs about a
    millisecond, not ~50 ms (a case collects at least once)."""
    _warm_up(torch.device("cpu"))
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(scope="module")
def frozen_heap_cuda(frozen_heap: None) -> None:
    """The same warm-up on the GPU, frozen too. It also makes the cuBLAS workspaces of the
    streams a case uses (the default stream's, for the calling thread's and autograd's handles,
    and the capture stream's): torch keeps them for the process, so they exist before any case
    measures reserved memory."""
    if torch.cuda.is_available():
        _warm_up(torch.device("cuda", torch.cuda.current_device()))
        gc.collect()
        gc.freeze()
