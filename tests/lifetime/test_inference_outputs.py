"""Inference warmup outputs die at once, under every schedule.

A pass without a backward (built under ``torch.no_grad()``, or whose outputs need no grad: an
eval layer with frozen weights) must not keep its warmup outputs alive until the schedule's
backward steps: with capture-time hooks or ``_order`` warmup runs in the schedule's order, and an
earlier pass's inference output would otherwise still be alive when the next pass's forward
starts. Each forward's output is recorded with a weakref; a ``forward_pre_hooks`` capture-time
hook collects garbage and records which earlier outputs are alive.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gograph

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Recorded(torch.nn.Linear):
    """A Linear(8, 8) that records a weakref to each output it returns (in a shared list)."""

    def __init__(self, seed: int, log: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__(8, 8)
        torch.manual_seed(seed)
        torch.nn.init.normal_(self.weight)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        self.log.append(weakref.ref(y))
        return y


def _alive_at_each_forward(log: list[weakref.ref[torch.Tensor]], seen: list[list[bool]]) -> Callable[[Any], None]:
    def hook(module: Any) -> None:
        gc.collect()
        seen.append([r() is not None for r in log])

    return hook


def _build(shape: str, device: str, ordered: bool, hooks: bool) -> tuple[list[list[bool]], tuple[Any, ...]]:
    log: list[weakref.ref[torch.Tensor]] = []
    seen: list[list[bool]] = []
    mods = [Recorded(i, log).to(device) for i in range(3)]
    if shape == "eval_frozen":  # an eval layer whose weights need no grad: eager gives outputs without grad
        for m in mods:
            m.eval().requires_grad_(False)
    elif shape == "mixed":  # two frozen eval layers before a training one
        for m in mods[:2]:
            m.eval().requires_grad_(False)
    inputs = [torch.randn(4, 8, device=device, requires_grad=shape == "mixed" and i == 2) for i in range(3)]
    options: dict[str, Any] = {"num_warmup_iters": 2}
    if hooks:
        options["capture_time_hooks"] = [{"forward_pre_hooks": {0: _alive_at_each_forward(log, seen)}}] * 3
    if ordered:  # an inference _order lists forwards only (TransformerEngine's rule)
        order = [1, 2, 3] if shape in ("eval_frozen", "no_grad") else [1, 2, 3, -3, -2, -1]
        options.update(_order=order, _num_layers_per_chunk=[1, 1, 1])
    grad = torch.no_grad() if shape == "no_grad" else contextlib.nullcontext()
    with grad:
        graphed = gograph.make_graphed_callables(tuple(mods), tuple((x,) for x in inputs), **options)
    return seen, graphed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["eval_frozen", "no_grad", "mixed"])
@pytest.mark.parametrize("ordered", [False, True], ids=["default", "_order"])
def test_inference_warmup_outputs_are_dead_before_the_next_forward(shape: str, ordered: bool, device: str) -> None:
    if ordered and shape == "mixed":
        pytest.skip("_order takes the modules all in train or all in eval mode (TransformerEngine's rule)")
    seen, graphed = _build(shape, device, ordered, hooks=True)
    warmup = seen[:6]  # 2 iterations x 3 forwards, then the captures' hooks
    assert len(warmup) == 6
    for k, alive in enumerate(warmup):
        inference = [i for i in range(len(alive)) if not (shape == "mixed" and i % 3 == 2)]
        leaked = [i for i in inference if alive[i]]
        assert not leaked, f"forward {k}: warmup outputs {leaked} of inference passes still alive ({alive})"
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_training_warmup_outputs_live_until_their_backward(device: str) -> None:
    """The other half of the rule: a training pass's output is alive until its backward ran."""
    log: list[weakref.ref[torch.Tensor]] = []
    seen: list[list[bool]] = []
    mods = [Recorded(i, log).to(device) for i in range(2)]
    hooks = [{"forward_pre_hooks": {0: _alive_at_each_forward(log, seen)}}] * 2
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in range(2))
    graphed = gograph.make_graphed_callables(tuple(mods), samples, num_warmup_iters=1, capture_time_hooks=hooks)
    assert seen[1] == [True]  # the first pass's output waits for its backward, after the second forward
    for g in graphed:
        g.reset()
    gc.collect()
    assert not any(r() is not None for r in log), "warmup or capture outputs outlived the build and reset"
