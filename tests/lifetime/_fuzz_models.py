"""The callables the lifetime fuzzer graphs: tiny layers of every shape of callable gograph takes.

Every forward reports what it returned (and, for the MLP, its hidden activation) to the
:data:`TRACKER` so the liveness oracle can hold weak references to it. Each callable keeps every
tensor it makes to at most two consumers (a grad summed from two contributions is bitwise the same
in either order; from three it need not be), so graphed and eager training stay comparable bit for
bit.

Kinds (``KINDS``):

* ``linear``, ``mlp``, ``dropout``: modules of one input and one output;
* ``fn``: a plain function (no parameters);
* ``multi``: a module returning a tuple of two outputs;
* ``nested``: a module returning ``(a, {"s": b, "mask": m})``, ``m`` needing no grad;
* ``kwargs``: ``forward(x, *, scale, bias)``, graphed with ``sample_kwargs``;
* ``unused``: ``forward(x, unused)`` whose second input (requiring grad) reaches no output;
* ``delayed``: a layer with a delayed weight gradient (TransformerEngine's
  ``need_backward_dw()`` / ``backward_dw()`` protocol), its weight grad accumulated into a
  persistent ``main_grad`` as Megatron-LM's layers do;
* ``dw_accum``, ``dw_assign``: the same layer whose ``backward_dw()`` writes ``weight.grad``:
  assigning it when it is None and adding into it otherwise (the common hand-written pattern), or
  always assigning a new tensor (TransformerEngine's Linear without ``fuse_wgrad_accumulation``);
* ``loss``: the loss, a 0-dim output (only as the last callable).

``mode`` (``MODES``) is ``train``, ``eval``, ``nograd`` (the forward body runs under
``torch.no_grad()``: an inference callable next to training ones) or ``frozen`` (training mode,
parameters that need no grad).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _fuzz_live import TRACKER
from torch import Tensor

__all__ = [
    "DELAYED_KINDS",
    "FEATURES",
    "GRAD_WRITING_KINDS",
    "KINDS",
    "MODES",
    "PIPELINE_KINDS",
    "ROWS",
    "DelayedBlock",
    "make_callable",
    "make_layer",
]

FEATURES = 8
ROWS = 4
MODES = ("train", "eval", "nograd", "frozen")
KINDS = (
    "linear",
    "mlp",
    "dropout",
    "fn",
    "multi",
    "nested",
    "kwargs",
    "unused",
    "delayed",
    "dw_accum",
    "dw_assign",
    "loss",
)
#: Layers of a pipeline (``_order``): one tensor in, one tensor of the same signature out.
PIPELINE_KINDS = ("block", "dropblock", "kwblock", "delayed", "dw_accum", "dw_assign", "fn")
#: The kinds with a delayed weight gradient, and those of them whose ``backward_dw()`` writes
#: ``weight.grad`` (the others' writes ``main_grad``).
DELAYED_KINDS = ("delayed", "dw_accum", "dw_assign")
GRAD_WRITING_KINDS = ("dw_accum", "dw_assign")


def _linear(seed: int, bias: bool = True) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(FEATURES, FEATURES, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(FEATURES, FEATURES, generator=g) / FEATURES**0.5)
        if bias:
            lin.bias.copy_(torch.randn(FEATURES, generator=g) / FEATURES)
    return lin


class _Fuzzed(torch.nn.Module):
    """Base of the fuzzed modules: ``owner`` is the callable's index (what the tracker files its
    outputs under), ``no_grad_body`` runs the body under ``torch.no_grad()``."""

    def __init__(self, owner: int, no_grad_body: bool) -> None:
        super().__init__()
        self.owner = owner
        self.no_grad_body = no_grad_body

    @contextlib.contextmanager
    def body(self) -> Iterator[None]:
        if self.no_grad_body:
            with torch.no_grad():
                yield
        else:
            yield

    def report(self, out: Any, *internals: Tensor) -> Any:
        TRACKER.record(self.owner, out, internals)
        return out


class Linear(_Fuzzed):
    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        self.lin = _linear(seed)

    def forward(self, x: Tensor) -> Tensor:
        with self.body():
            return self.report(self.lin(x))


class MLP(_Fuzzed):
    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        self.fc1, self.fc2 = _linear(seed), _linear(seed + 1)

    def forward(self, x: Tensor) -> Tensor:
        with self.body():
            h = torch.tanh(self.fc1(x))
            return self.report(self.fc2(h), h)


class Dropout(_Fuzzed):
    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        self.lin = _linear(seed)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        with self.body():
            return self.report(self.drop(torch.tanh(self.lin(x))))


class Multi(_Fuzzed):
    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        self.lin = _linear(seed)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        with self.body():
            a = self.lin(x)
            return self.report((a, torch.sigmoid(a)))


class Nested(_Fuzzed):
    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        self.lin = _linear(seed)

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        with self.body():
            a = self.lin(x)
            return self.report((a, {"s": torch.tanh(a) * 0.5, "mask": (x > 0).to(x.dtype)}))


class Kwargs(_Fuzzed):
    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        self.lin = _linear(seed)

    def forward(self, x: Tensor, *, scale: Tensor, bias: Tensor) -> Tensor:
        with self.body():
            h = x * scale + bias
            return self.report(h + torch.tanh(self.lin(h)))


class Unused(_Fuzzed):
    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        self.lin = _linear(seed)

    def forward(self, x: Tensor, unused: Tensor) -> Tensor:
        with self.body():
            return self.report(torch.tanh(self.lin(x)))


class Loss(_Fuzzed):
    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        self.lin = _linear(seed)

    def forward(self, x: Tensor) -> Tensor:
        with self.body():
            return self.report(self.lin(x).square().mean())


class _DelayedMatmul(torch.autograd.Function):
    """``x @ w.T`` whose backward computes only the input grad and leaves ``(x, dy)`` for
    ``backward_dw()`` (TransformerEngine's delay_wgrad_compute)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, owner: Delayed) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.owner = owner
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        x, weight = ctx.saved_tensors
        ctx.owner.stash.append((x, dy))
        return dy @ weight, None, None


class Delayed(_Fuzzed):
    """``delayed(x) + bias``: the weight's grad comes from ``backward_dw()``, which adds it into
    ``main_grad`` (a persistent buffer, as Megatron-LM's ``weight.main_grad``); the bias gets its
    grad from the backward."""

    def __init__(self, owner: int, seed: int, no_grad_body: bool = False) -> None:
        super().__init__(owner, no_grad_body)
        lin = _linear(seed)
        self.weight, self.bias = lin.weight, lin.bias
        self.main_grad = torch.zeros_like(self.weight.detach())
        self.stash: list[tuple[Tensor, Tensor]] = []

    def _apply(self, fn: Any, recurse: bool = True) -> Delayed:
        # main_grad is a plain attribute (as Megatron-LM's): .to(device) moves it with the weight
        super()._apply(fn, recurse)
        self.main_grad = fn(self.main_grad)
        return self

    def delayed(self, x: Tensor) -> Tensor:
        return _DelayedMatmul.apply(x, self.weight, self) + self.bias

    def forward(self, x: Tensor) -> Tensor:
        with self.body():
            return self.report(self.delayed(x))

    def need_backward_dw(self) -> bool:
        return True

    def backward_dw(self) -> None:
        x, dy = self.stash.pop(0)
        with torch.no_grad():
            self.main_grad.add_(dy.reshape(-1, FEATURES).t() @ x.reshape(-1, FEATURES))


class DelayedBlock(Delayed):
    """A residual pipeline layer with a delayed weight gradient: ``x + tanh(delayed(x))``."""

    def forward(self, x: Tensor) -> Tensor:
        with self.body():
            return self.report(x + torch.tanh(self.delayed(x)))


def _weight_grad(self: Delayed) -> Tensor:
    x, dy = self.stash.pop(0)
    return dy.reshape(-1, FEATURES).t() @ x.reshape(-1, FEATURES)


class DwAccum(Delayed):
    """``backward_dw()`` assigns ``weight.grad`` when it is None and adds into it otherwise."""

    def backward_dw(self) -> None:
        with torch.no_grad():
            dw = _weight_grad(self)
            if self.weight.grad is None:
                self.weight.grad = dw
            else:
                self.weight.grad.add_(dw)


class DwAssign(Delayed):
    """``backward_dw()`` always assigns ``weight.grad`` a new tensor."""

    def backward_dw(self) -> None:
        with torch.no_grad():
            self.weight.grad = _weight_grad(self)


class DwAccumBlock(DwAccum, DelayedBlock):
    """The residual pipeline layer of ``dw_accum``."""


class DwAssignBlock(DwAssign, DelayedBlock):
    """The residual pipeline layer of ``dw_assign``."""


class Block(_Fuzzed):
    """A residual pipeline layer ``x + drop(tanh(lin(x * scale)))``: ``scale`` a keyword argument
    for ``kwblock``, dropout for ``dropblock``."""

    def __init__(self, owner: int, seed: int, dropout: float = 0.0) -> None:
        super().__init__(owner, False)
        self.lin = _linear(seed)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: Tensor, *, scale: Tensor | None = None) -> Tensor:
        h = x if scale is None else x * scale
        return self.report(h + self.drop(torch.tanh(self.lin(h))))


def _function(owner: int, no_grad_body: bool) -> Callable[..., Tensor]:
    def fuzz_fn(x: Tensor) -> Tensor:
        with torch.no_grad() if no_grad_body else contextlib.nullcontext():
            out = torch.tanh(x) * 2.0
        TRACKER.record(owner, out, ())
        return out

    return fuzz_fn


_MODULES: dict[str, type[_Fuzzed]] = {
    "linear": Linear,
    "mlp": MLP,
    "dropout": Dropout,
    "multi": Multi,
    "nested": Nested,
    "kwargs": Kwargs,
    "unused": Unused,
    "delayed": Delayed,
    "dw_accum": DwAccum,
    "dw_assign": DwAssign,
    "loss": Loss,
}
_DELAYED_BLOCKS: dict[str, type[Delayed]] = {
    "delayed": DelayedBlock,
    "dw_accum": DwAccumBlock,
    "dw_assign": DwAssignBlock,
}


def make_callable(kind: str, owner: int, seed: int, mode: str) -> Any:
    """A callable of ``kind`` (``KINDS``) in ``mode`` (``MODES``), for a build's position
    ``owner``."""
    if kind == "fn":
        return _function(owner, mode == "nograd")
    module = _MODULES[kind](owner, seed, no_grad_body=mode == "nograd")
    module.train(mode != "eval")
    if mode == "frozen":
        module.requires_grad_(False)
    return module


def make_layer(kind: str, owner: int, seed: int) -> Any:
    """A pipeline layer of ``kind`` (``PIPELINE_KINDS``), in training mode."""
    if kind == "fn":
        return _function(owner, False)
    if kind in _DELAYED_BLOCKS:
        return _DELAYED_BLOCKS[kind](owner, seed)
    return Block(owner, seed, dropout=0.5 if kind == "dropblock" else 0.0)
