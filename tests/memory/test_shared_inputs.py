"""The guard on static inputs that several graphed callables share (gograph.replay._shared_inputs), on
the eager engine: a mask passed as one sample to every layer is one static buffer, as in torch.
New contents copied in while another layer's backward is still to run would change what that
backward reads (silently wrong gradients on torch's CUDA graphs; an in-place version error deep in
autograd on an eager replay): gograph raises SharedInputError before copying, and accepts the
same contents (same tensor, or compared equal), and new contents once the backwards ran. (The CUDA
counterpart is in test_shared_samples_cuda.py.)"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch

import gograph
from gograph.replay import _shared_inputs

from helpers import Masked

FEATURES = 8
ROWS = 4


def _mask(seed: int) -> torch.Tensor:
    return (torch.rand(ROWS, FEATURES, generator=torch.Generator().manual_seed(seed)) > 0.3).float()


def _masked() -> tuple[tuple[Any, ...], list[Masked]]:
    """Three graphed Masked layers whose mask samples are one tensor, and eager copies of them.
    (Not a fixture: pytest's fixture cache would keep the graphed layers alive past the leak
    check; they go with the test's frame.)"""
    layers = [Masked(i) for i in range(3)]
    ref = copy.deepcopy(layers)
    x = torch.randn(ROWS, FEATURES, requires_grad=True)
    sample = _mask(0)
    graphed = gograph.make_graphed_callables(tuple(layers), tuple((x, sample) for _ in range(3)))
    assert all(g.forward.static_input_surface[1] is sample for g in graphed)
    return graphed, ref


@pytest.fixture
def compares(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the guard's content comparisons (each one a device sync on the GPU)."""
    seen: list[int] = []
    real = _shared_inputs.SharedInput._check_same

    def counted(self: Any, *args: Any) -> None:
        seen.append(1)
        real(self, *args)

    monkeypatch.setattr(_shared_inputs.SharedInput, "_check_same", counted)
    return seen


def _step(calls: Any, masks: list[torch.Tensor], seed: int) -> None:
    h = torch.randn(ROWS, FEATURES, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    for c, m in zip(calls, masks):
        h = c(h, m)
    h.square().sum().backward()


def _grads_equal(graphed: tuple[Any, ...], ref: list[Masked]) -> bool:
    return all(torch.equal(a.fc.weight.grad, b.fc.weight.grad) for a, b in zip(graphed, ref))


def test_other_contents_while_a_backward_waits_raise() -> None:
    graphed, _ = _masked()
    first, second = _mask(1), _mask(2)
    h = graphed[0](torch.randn(ROWS, FEATURES, requires_grad=True), first)
    with pytest.raises(gograph.SharedInputError, match=r"graphed callable 1 .* graphed callable 0 .*backward"):
        graphed[1](h, second)
    assert torch.equal(graphed[0].forward.static_input_surface[1], first)  # nothing copied


def test_one_mask_for_every_layer_is_copied_without_comparing(compares: list[int]) -> None:
    graphed, ref = _masked()
    for seed in (3, 4):  # a new mask each step: the backwards of the step before have run
        mask = _mask(seed)
        for calls in (graphed, ref):
            _step(calls, [mask] * 3, seed)
    assert _grads_equal(graphed, ref)
    assert compares == []


def test_equal_contents_in_other_tensors_are_compared_and_accepted(
    compares: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    graphed, ref = _masked()
    mask = _mask(5)
    with caplog.at_level("INFO", logger="gograph"):
        for calls in (graphed, ref):
            _step(calls, [mask.clone() for _ in range(3)], 6)
    assert _grads_equal(graphed, ref)
    assert len(compares) == 2  # layers 1 and 2: layer 0's backward (then 1's) waits
    assert sum("compares the contents" in r.getMessage() for r in caplog.records) == 1


def test_a_mask_changed_in_place_is_compared(compares: list[int]) -> None:
    graphed, _ = _masked()
    mask = _mask(7)
    h = graphed[0](torch.randn(ROWS, FEATURES, requires_grad=True), mask)
    mask.mul_(1.0)  # a new version, the same contents
    h = graphed[1](h, mask)
    assert len(compares) == 1
    mask.mul_(0.0)
    with pytest.raises(gograph.SharedInputError):
        graphed[2](h, mask)


def test_new_contents_once_the_backwards_ran_train_like_eager() -> None:
    graphed, ref = _masked()
    for calls in (graphed, ref):
        for seed in (8, 9):  # two micro-batches, each with its own mask
            _step(calls, [_mask(seed)] * 3, seed)
    assert _grads_equal(graphed, ref)


def test_a_forward_that_never_runs_backward_does_not_block() -> None:
    graphed, _ = _masked()
    h = torch.randn(ROWS, FEATURES, requires_grad=True)
    for g in graphed:
        h = g(h, _mask(14))
    del h  # the step was dropped: no backward will read the buffer
    gc.collect()
    with torch.no_grad():  # inference makes no autograd node to wait for
        graphed[0](torch.randn(ROWS, FEATURES), _mask(15))
    _step(graphed, [_mask(16)] * 3, 17)


class Counting(torch.nn.Module):
    """Writes one of its inputs in place (a step counter): its graph then changes the shared
    buffer on every replay, without a version bump the guard could see."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        steps.add_(1)
        return self.fc(x)


@pytest.mark.parametrize(
    ("module", "warmup", "guarded"), [(Masked, 1, True), (Counting, 1, False), (Masked, 0, True), (Counting, 0, False)]
)
def test_inputs_written_in_place_keep_a_plain_copy(module: type, warmup: int, guarded: bool) -> None:
    """A leaf the forward writes in place keeps a plain copy-in; the others are guarded. Without
    warmup the capture's forward tells which (version counters move in a capture too)."""
    x = torch.randn(ROWS, FEATURES, requires_grad=True)
    sample = torch.zeros(ROWS, FEATURES)
    graphed = gograph.make_graphed_callables(
        tuple(module(i) for i in range(2)), tuple((x, sample) for _ in range(2)), num_warmup_iters=warmup
    )
    assert [g.forward.shared_inputs for g in graphed] == [frozenset({1}) if guarded else frozenset()] * 2


def test_memory_report_lists_the_guarded_inputs() -> None:
    graphed, _ = _masked()
    report = gograph.memory_report(graphed)
    assert [p.shared_inputs for p in report.passes] == [["input[1]"]] * 3
    assert [p.separated_inputs for p in report.passes] == [[], ["input[0]"], ["input[0]"]]
    assert "3 input(s) read by other passes too (copy-ins guarded)" in str(report)


def test_a_reset_callable_no_longer_waits() -> None:
    graphed, _ = _masked()
    h = graphed[0](torch.randn(ROWS, FEATURES, requires_grad=True), _mask(18))
    graphed[0].forward.reset()  # its backward can no longer run
    graphed[1](h.detach().requires_grad_(), _mask(19))  # other contents: nothing waits for the buffer
