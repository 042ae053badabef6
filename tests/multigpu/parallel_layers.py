"""Small tensor-parallel and data-parallel building blocks for the multi-GPU checks.

Megatron-style tensor parallelism over one process group (``group=None`` is the world):

* :class:`CopyToTensorParallelRegion` -- identity forward, all-reduce of the gradient backward
  (Megatron's ``copy_to_tensor_model_parallel_region``: the input of a column-parallel linear);
* :class:`ReduceFromTensorParallelRegion` -- all-reduce forward, identity backward (Megatron's
  ``reduce_from_tensor_model_parallel_region``: the output of a row-parallel linear);
* :class:`ColumnParallelLinear`, :class:`RowParallelLinear` and :class:`TPMLPBlock`
  (``x + fc2(dropout(gelu(fc1(x))))`` with fc1 column-parallel and fc2 row-parallel; dropout,
  inside the tensor-parallel region, draws from a per-rank generator given to the block).

Data parallelism with the gradient reduction *inside* the layer:

* :class:`AllReduceGradient` -- identity forward; backward divides the gradient by the world size
  and all-reduces it (what DDP does per bucket, here per parameter, so that a graphed layer's
  backward graph contains the data-parallel reduction);
* :class:`DPLinearBlock` -- ``x + W2 gelu(W1 x)`` whose parameters go through it.

Plain blocks (:class:`MLPBlock`) are used under ``torch.nn.parallel.DistributedDataParallel``.

All collectives are issued on the current stream of the caller, as a graph capture needs:
ProcessGroupNCCL orders its NCCL stream after the current stream and the current stream after the
collective, so inside a capture the all-reduce becomes part of the graph. Every collective works
on a fresh tensor (``clone``): no autograd buffer is modified in place.

Weights are cut from one dense initialisation (made from a CPU generator with a fixed seed), so
every rank holds its shard of the same model and the tensor-parallel model can be checked against
the dense one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def world(group: Any = None) -> tuple[int, int]:
    """(rank, size) of ``group`` (the world when None)."""
    return dist.get_rank(group), dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------
# Tensor-parallel region functions
# ---------------------------------------------------------------------------------------------
class CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; the gradient is summed over the tensor-parallel group backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        out = grad.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce (sum) forward over the tensor-parallel group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_tp_region(x: Tensor, group: Any = None) -> Tensor:
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tp_region(x: Tensor, group: Any = None) -> Tensor:
    return ReduceFromTensorParallelRegion.apply(x, group)


class AllReduceGradient(torch.autograd.Function):
    """Identity forward; backward: ``all_reduce(grad / world_size)`` over the data-parallel group
    (DDP's averaging, per parameter, inside whatever graph captures the backward)."""

    @staticmethod
    def forward(ctx: Any, p: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        out = grad.contiguous() / dist.get_world_size(ctx.group)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def tp_dropout(x: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """Dropout whose mask is drawn from ``generator`` (a tensor-parallel RNG: a separate
    generator seeded per rank, as Megatron's model-parallel RNG tracker keeps)."""
    if p <= 0.0:
        return x
    keep = torch.rand(x.shape, device=x.device, dtype=x.dtype, generator=generator) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


# ---------------------------------------------------------------------------------------------
# Dense reference weights
# ---------------------------------------------------------------------------------------------
def dense_linear_weights(d_in: int, d_out: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(weight [d_out, d_in], bias [d_out]) as nn.Linear initialises them, from ``gen`` (CPU)."""
    bound = 1.0 / math.sqrt(d_in)
    w = (torch.rand(d_out, d_in, generator=gen) * 2 - 1) * bound
    b = (torch.rand(d_out, generator=gen) * 2 - 1) * bound
    return w, b


# ---------------------------------------------------------------------------------------------
# Tensor-parallel layers
# ---------------------------------------------------------------------------------------------
class ColumnParallelLinear(torch.nn.Module):
    """``y_shard = x @ W_shard^T + b_shard``: the output features are split over the group; the
    input enters the tensor-parallel region (gradient all-reduced backward)."""

    def __init__(self, weight: Tensor, bias: Tensor, group: Any = None) -> None:
        super().__init__()
        rank, size = world(group)
        d_out = weight.shape[0]
        if d_out % size:
            raise ValueError(f"output features {d_out} not divisible by the group size {size}")
        n = d_out // size
        self.group = group
        self.weight = torch.nn.Parameter(weight[rank * n : (rank + 1) * n].clone())
        self.bias = torch.nn.Parameter(bias[rank * n : (rank + 1) * n].clone())

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """``y = all_reduce(x_shard @ W_shard^T) + b``: the input features are split over the group;
    the partial products are summed (forward all-reduce) and the replicated bias added."""

    def __init__(self, weight: Tensor, bias: Tensor, group: Any = None) -> None:
        super().__init__()
        rank, size = world(group)
        d_in = weight.shape[1]
        if d_in % size:
            raise ValueError(f"input features {d_in} not divisible by the group size {size}")
        n = d_in // size
        self.group = group
        self.weight = torch.nn.Parameter(weight[:, rank * n : (rank + 1) * n].clone())
        self.bias = torch.nn.Parameter(bias.clone())

    def forward(self, x: Tensor) -> Tensor:
        return reduce_from_tp_region(F.linear(x, self.weight), self.group) + self.bias


class TPMLPBlock(torch.nn.Module):
    """``x + fc2(dropout(gelu(fc1(x))))``, fc1 column-parallel, fc2 row-parallel; dropout draws
    from ``generator`` inside the tensor-parallel region."""

    def __init__(
        self,
        d: int,
        f: int,
        gen: torch.Generator,
        group: Any = None,
        dropout: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        w1, b1 = dense_linear_weights(d, f, gen)
        w2, b2 = dense_linear_weights(f, d, gen)
        self.fc1 = ColumnParallelLinear(w1, b1, group)
        self.fc2 = RowParallelLinear(w2, b2, group)
        self.dropout = dropout
        self.generator = generator
        self.dense = (w1, b1, w2, b2)  # for the dense reference check (CPU tensors, not state)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc1(x))
        h = tp_dropout(h, self.dropout, self.generator)
        return x + self.fc2(h)


class DenseMLPBlock(torch.nn.Module):
    """The unsplit :class:`TPMLPBlock` (no dropout): the reference of the tensor-parallel math."""

    def __init__(self, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(w1.shape[1], w1.shape[0])
        self.fc2 = torch.nn.Linear(w2.shape[1], w2.shape[0])
        with torch.no_grad():
            self.fc1.weight.copy_(w1)
            self.fc1.bias.copy_(b1)
            self.fc2.weight.copy_(w2)
            self.fc2.bias.copy_(b2)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


# ---------------------------------------------------------------------------------------------
# Data-parallel layers
# ---------------------------------------------------------------------------------------------
class MLPBlock(torch.nn.Module):
    """``x + fc2(gelu(fc1(x)))`` with plain linears (for DDP)."""

    def __init__(self, d: int, f: int, gen: torch.Generator) -> None:
        super().__init__()
        w1, b1 = dense_linear_weights(d, f, gen)
        w2, b2 = dense_linear_weights(f, d, gen)
        self.fc1 = torch.nn.Linear(d, f)
        self.fc2 = torch.nn.Linear(f, d)
        with torch.no_grad():
            self.fc1.weight.copy_(w1)
            self.fc1.bias.copy_(b1)
            self.fc2.weight.copy_(w2)
            self.fc2.bias.copy_(b2)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class DPLinearBlock(MLPBlock):
    """:class:`MLPBlock` whose parameters' gradients are averaged over the data-parallel group
    inside the backward (:class:`AllReduceGradient`)."""

    def __init__(self, d: int, f: int, gen: torch.Generator, group: Any = None) -> None:
        super().__init__(d, f, gen)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        g = self.group
        w1, b1 = AllReduceGradient.apply(self.fc1.weight, g), AllReduceGradient.apply(self.fc1.bias, g)
        w2, b2 = AllReduceGradient.apply(self.fc2.weight, g), AllReduceGradient.apply(self.fc2.bias, g)
        return x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
