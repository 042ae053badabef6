"""Models and a pipeline driver for the TransformerEngine-extension tests (tests/te/)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class _DelayedMatmul(torch.autograd.Function):
    """y = x @ w.T whose backward computes only dx and leaves (x, dy) for backward_dw()."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, owner: DelayedLinear) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.owner = owner
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, weight = ctx.saved_tensors
        ctx.owner._stash.append((x, dy))
        return dy @ weight, None, None


class DelayedLinear(torch.nn.Module):
    """A plain module implementing the delayed weight-gradient protocol (need_backward_dw /
    backward_dw), the way TransformerEngine's modules do with delay_wgrad_compute: the backward
    computes the input grad; backward_dw() accumulates the weight grad into ``weight.grad``
    (which must exist, like TransformerEngine's main_grad)."""

    def __init__(self, features: int, delay: bool = True, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(features, features, generator=g) / features**0.5)
        self.bias = torch.nn.Parameter(torch.randn(features, generator=g) / features)
        self.delay = delay
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.dw_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            return _DelayedMatmul.apply(x, self.weight, self) + self.bias
        return x @ self.weight.t() + self.bias

    def need_backward_dw(self) -> bool:
        return self.delay

    def backward_dw(self) -> None:
        x, dy = self._stash.pop(0)
        self.dw_calls += 1
        with torch.no_grad():
            self.weight.grad.add_(dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class AddOrAssignLinear(DelayedLinear):
    """A delayed layer whose ``backward_dw()`` assigns ``weight.grad`` when it is None and adds
    into it otherwise: the common hand-written pattern (AccumulateGrad's rule)."""

    def backward_dw(self) -> None:
        x, dy = self._stash.pop(0)
        self.dw_calls += 1
        with torch.no_grad():
            dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            if self.weight.grad is None:
                self.weight.grad = dw
            else:
                self.weight.grad.add_(dw)


class AssignLinear(DelayedLinear):
    """A delayed layer whose ``backward_dw()`` always assigns ``weight.grad`` a new tensor, as
    TransformerEngine's Linear does without ``fuse_wgrad_accumulation``."""

    def backward_dw(self) -> None:
        x, dy = self._stash.pop(0)
        self.dw_calls += 1
        with torch.no_grad():
            self.weight.grad = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class Block(torch.nn.Module):
    """x + tanh(lin(x)): a residual layer, input, output and grads of one signature."""

    def __init__(self, features: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(features, features)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(features, features, generator=g) / features**0.5)
            self.lin.bias.copy_(torch.randn(features, generator=g) / features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class ScaledBlock(Block):
    """A block with keyword arguments: x * scale (+ bias) through the residual layer."""

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = x * scale
        if bias is not None:
            h = h + bias
        return h + torch.tanh(self.lin(h))


def init_grads(*modules: torch.nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = torch.zeros_like(p)


def run_pipeline(
    order: Sequence[float],
    layers: Sequence[int],
    microbatches: int,
    call: Callable[[int, torch.Tensor], torch.Tensor],
    inputs: dict[tuple[int, int], torch.Tensor],
    dys: dict[tuple[int, int], torch.Tensor],
    chain: bool,
    wgrad: Callable[[int], None] | None = None,
    grads: dict[tuple[int, int], torch.Tensor] | None = None,
) -> dict[tuple[int, int], torch.Tensor]:
    """Runs one iteration of a pipeline schedule (TransformerEngine's _order) on one rank.

    ``call(pass, x)`` runs pass ``prefix[c]*M + m*layers[c] + l`` (layer l of chunk c,
    microbatch m). A chunk's layers are chained; with ``chain``, chunk c+1 takes chunk c's
    output as its input (detached, like a pipeline receive) and chunk c's backward takes the
    grad of that input. What crosses a chunk boundary is copied when it is produced, as a
    pipeline send copies it out: a graphed callable's outputs and input grads are static
    buffers that later replays (and, with buffer reuse, later passes) overwrite -- with reuse,
    TransformerEngine assumes an input grad is sent before the next first-layer backward.
    Returns clones of each chunk's output per (chunk, microbatch); ``grads`` receives clones of
    each chunk input's grad, taken right after its backward."""
    chunks = len(layers)
    prefix = [sum(layers[:c]) for c in range(chunks)]
    fwd, bwd = [0] * chunks, [0] * chunks
    outs: dict[tuple[int, int], torch.Tensor] = {}
    values: dict[tuple[int, int], torch.Tensor] = {}
    recv: dict[tuple[int, int], torch.Tensor] = {}
    sent: dict[tuple[int, int], torch.Tensor] = {}
    for e in order:
        if e > 0:
            c = int(e) - 1
            m = fwd[c]
            fwd[c] += 1
            if chain and c > 0:
                x = outs[(c - 1, m)].detach().clone().requires_grad_()
                recv[(c, m)] = x
            else:
                x = inputs[(c, m)]
            for li in range(layers[c]):
                x = call(prefix[c] * microbatches + m * layers[c] + li, x)
            outs[(c, m)] = x
            values[(c, m)] = x.detach().clone()
        elif float(e).is_integer():
            c = -int(e) - 1
            m = bwd[c]
            bwd[c] += 1
            dy = sent.pop((c, m)) if chain and c < chunks - 1 else dys[(c, m)]
            outs.pop((c, m)).backward(dy)
            x = recv.pop((c, m)) if chain and c > 0 else inputs[(c, m)]
            if chain and c > 0:
                sent[(c - 1, m)] = x.grad.clone()  # the pipeline send of the input grad
            if grads is not None and x.grad is not None:
                grads[(c, m)] = x.grad.clone()
        else:
            c = int(-e - 0.5) - 1
            assert wgrad is not None
            wgrad(prefix[c] * microbatches + (bwd[c] - 1) * layers[c])
    return values
