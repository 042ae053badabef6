"""Models shared by the torch-parity tests (CPU and CUDA)."""

from __future__ import annotations

import weakref

import torch


class DictBlock(torch.nn.Module):
    """Takes a dict of tensors (a pytree sample arg): relu(linear(x) + shift), then dropout."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(p)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.drop(torch.relu(self.lin(inputs["x"]) + inputs["shift"]))


class TailBlock(torch.nn.Module):
    def __init__(self, width: int, out: int, p: float) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(p)
        self.lin2 = torch.nn.Linear(width, out)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.drop(torch.relu(self.lin1(h))))


def two_blocks(width: int, out: int, p: float, device: torch.device | str, seed: int = 0):
    torch.manual_seed(seed)
    return DictBlock(width, p).to(device), TailBlock(width, out, p).to(device)


class OutputRecorder(torch.nn.Module):
    """Records a weakref to every output and, at each call, how many earlier outputs are alive:
    a way to see when make_graphed_callables lets warmup activations go."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.refs: list[weakref.ref] = []
        self.alive_at_call: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive_at_call.append(sum(r() is not None for r in self.refs))
        out = torch.relu(self.lin(x))
        self.refs.append(weakref.ref(out))
        return out
