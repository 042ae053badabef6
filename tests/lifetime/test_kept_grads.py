"""A kept ``.grad`` keeps its address and its values, as eager's AccumulateGrad keeps them.

With ``zero_grad(set_to_none=False)`` (Megatron, DeepSpeed, apex, any captured optimizer step) a
parameter's ``.grad``, once it exists, is the same tensor at the same ``data_ptr()`` for the rest
of training; with ``set_to_none=True`` it is, within a step, across the micro-batches that
accumulate into it. An optimizer that reads the grads through references taken at step 1 (what a
captured ``optimizer.step()`` does) must then train bitwise like eager.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import gograph

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _model(device: str) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)).to(device)


def _layers(device: str) -> list[torch.nn.Module]:
    torch.manual_seed(1)
    return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).to(device) for _ in range(3)]


def _batches(n: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, 8, generator=g).to(device) for _ in range(n)]


def _step(calls: Sequence[Callable[..., Any]], x: torch.Tensor) -> None:
    for c in calls:
        x = c(x)
    x.square().sum().backward()


def _check_same_grads(params: list[torch.nn.Parameter], first: dict[int, tuple[torch.Tensor, int]], when: str) -> None:
    """Every ``.grad`` is the tensor, at the address, recorded at its first backward (recorded now
    when there is none). A function of its own: no local outlives it to hold an old ``.grad``
    past ``zero_grad(set_to_none=True)``."""
    for k, p in enumerate(params):
        assert p.grad is not None
        was = first.setdefault(k, (p.grad, p.grad.data_ptr()))
        assert p.grad is was[0], f"{when}: .grad of parameter {k} is another tensor"
        assert p.grad.data_ptr() == was[1], f"{when}: .grad of parameter {k} moved"


def _train_and_watch(
    calls: Sequence[Callable[..., Any]], params: list[torch.nn.Parameter], set_to_none: bool, micro: int, steps: int
) -> list[torch.Tensor]:
    """SGD over ``steps`` steps of ``micro`` micro-batches; asserts that every ``.grad`` keeps the
    tensor and address it had at its first backward (for the rest of training when grads are
    kept, within each step when they are dropped). Returns the parameters after training."""
    opt = torch.optim.SGD(params, lr=0.05)
    xs = iter(_batches(steps * micro, str(params[0].device)))
    first: dict[int, tuple[torch.Tensor, int]] = {}
    for step in range(steps):
        for mb in range(micro):
            _step(calls, next(xs))
            _check_same_grads(params, first, f"step {step} micro-batch {mb}")
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            first.clear()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("micro", [1, 2, 3])
@pytest.mark.parametrize("set_to_none", [False, True], ids=["kept", "set_to_none"])
@pytest.mark.parametrize("chain", [False, True], ids=["default", "chain_buffers"])
def test_grads_keep_address_and_values(device: str, micro: int, set_to_none: bool, chain: bool, no_tf32: Any) -> None:
    layers = _layers(device)
    ref = copy.deepcopy(layers)
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=i > 0),) for i in range(3))
    graphed = gograph.make_graphed_callables(tuple(layers), samples, chain_buffers=chain)
    params = [p for m in layers for p in m.parameters()]
    got = _train_and_watch(graphed, params, set_to_none, micro, steps=4)
    want = _train_and_watch(ref, [p for m in ref for p in m.parameters()], set_to_none, micro, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for m in layers:
        m.reset()


class CachedSGD:
    """SGD that takes references to the grads at its first step and reads them there ever after,
    as a ``torch.cuda.graph`` captured around ``optimizer.step()`` or a fused optimizer with cached
    tensor lists does."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        self.params, self.lr = params, lr
        self.grads: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self) -> None:
        if self.grads is None:
            self.grads = [p.grad for p in self.params]  # type: ignore[misc]
        for p, g in zip(self.params, self.grads):
            p.add_(g, alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad.zero_()  # type: ignore[union-attr]


def _cached_training(model: torch.nn.Module, micro: int, steps: int) -> list[torch.Tensor]:
    opt = CachedSGD(list(model.parameters()), lr=0.1)
    xs = iter(_batches(steps * micro, str(next(model.parameters()).device)))
    for _ in range(steps):
        for _ in range(micro):
            _step([model], next(xs))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("micro", [1, 3])
def test_cached_grad_references_train_like_eager(micro: int) -> None:
    model = _model("cpu")
    ref = copy.deepcopy(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8, requires_grad=True),))
    got, want = _cached_training(model, micro, 5), _cached_training(ref, micro, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    model.reset()


def _captured_step_training(model: torch.nn.Module, micro: int, steps: int, set_to_none: bool) -> list[torch.Tensor]:
    """The pattern of PyTorch's CUDA-graphs docs: two eager optimizer steps first (their
    ``zero_grad`` in the mode given: with ``set_to_none=True`` the grads the capture reads are the
    ones a backward made after ``None``), the optimizer warmed up on a side stream, then
    ``optimizer.step()`` captured in a ``torch.cuda.graph`` and replayed every step (grads kept in
    place from then on)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    xs = iter(_batches((steps + 3) * micro, "cuda"))
    for _ in range(2):
        for _ in range(micro):
            _step([model], next(xs))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    for _ in range(micro):
        _step([model], next(xs))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opt.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    opt.zero_grad(set_to_none=False)  # the graph reads these .grad tensors: they must stay
    for _ in range(steps):
        for _ in range(micro):
            _step([model], next(xs))
        graph.replay()
        opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.cuda
@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("set_to_none", [False, True], ids=["kept", "set_to_none_before_capture"])
def test_captured_optimizer_step_trains_like_eager(
    cuda_device: torch.device, micro: int, set_to_none: bool, no_tf32: Any
) -> None:
    model = _model("cuda")
    ref = copy.deepcopy(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8, device=cuda_device, requires_grad=True),))
    got = _captured_step_training(model, micro, 4, set_to_none)
    want = _captured_step_training(ref, micro, 4, set_to_none)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    model.reset()


def _lends(model: torch.nn.Sequential) -> list[bool]:
    """Per step of three (grads dropped after each): whether ``.grad`` was the static buffer."""
    static = model.forward.static_grad_inputs[model.forward.len_user_args]  # type: ignore[union-attr]
    out = []
    for x in _batches(3, "cpu"):
        _step([model], x)
        out.append(model[0].weight.grad.data_ptr() == static.data_ptr())  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(("lend", "want"), [(None, [False, True, True]), (True, [True] * 3), (False, [False] * 3)])
def test_lend_param_grads_says_when_grads_are_lent(lend: bool | None, want: list[bool]) -> None:
    model = _model("cpu")
    gograph.make_graphed_callables(model, (torch.randn(4, 8, requires_grad=True),), lend_param_grads=lend)
    assert _lends(model) == want
    model.reset()


def test_lend_param_grads_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="lend_param_grads must be None .* True .* or False"):
        gograph.make_graphed_callables(_model("cpu"), (torch.randn(4, 8),), lend_param_grads="yes")  # type: ignore[typeddict-item]
