"""Models and helpers shared by the tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch


def make_mlp(
    seed: int = 0,
    d_in: int = 8,
    d_hidden: int = 16,
    d_out: int = 4,
    dropout: float = 0.0,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU()]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers += [torch.nn.Linear(d_hidden, d_hidden), torch.nn.Tanh(), torch.nn.Linear(d_hidden, d_out)]
    return torch.nn.Sequential(*layers).to(device)


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy of an (ungraphed) model, for eager reference runs."""
    return copy.deepcopy(model)


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def grads_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    for p, q in zip(a.parameters(), b.parameters()):
        if (p.grad is None) != (q.grad is None):
            return False
        if p.grad is not None and not torch.equal(p.grad, q.grad):
            return False
    return True


def learn_dropped_grads(model: torch.nn.Module, *args: torch.Tensor) -> None:
    """One step whose grads are dropped (``zero_grad(set_to_none=True)``): a graphed callable of
    the default schedule lends its parameter-grad buffers to ``.grad`` only once it has seen the
    caller drop its grads, from the backward after the next replay on."""
    model(*args).sum().backward()
    model.zero_grad(set_to_none=True)


def batches(
    n: int, shape: tuple[int, ...], seed: int = 1, device: torch.device | str = "cpu", requires_grad: bool = False
) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=g).to(device).requires_grad_(requires_grad) for _ in range(n)]


class Masked(torch.nn.Module):
    """``tanh(fc(x)) * mask``: a layer that takes a mask (no grad) beside its activation."""

    def __init__(self, seed: int, features: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(features, features)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * mask


class ChainLayer(torch.nn.Module):
    """``dropout(act(fc(x)))`` of width ``features``: one layer of the chained-layer tests."""

    def __init__(
        self,
        seed: int,
        features: int,
        dropout: float = 0.0,
        act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(features, features)
        self.drop = torch.nn.Dropout(dropout)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.act(self.fc(x)))


class WithLoss(torch.nn.Module):
    """The last layer followed by the loss, graphed as one callable (README's recommendation):
    ``forward(x, target)`` returns ``mse_loss(layer(x).float(), target)``."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(x).float(), target)
