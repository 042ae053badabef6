"""Tensor-parallel layers with their collectives inside the graphed callable, and the runs that
train them graphed and eagerly on one rank.

Megatron-LM's wiring over one process group (``None``: the default group):

* :class:`ColumnParallelLinear` -- the input enters the tensor-parallel region (identity
  forward, all-reduce of its grad backward), the output features are split over the ranks;
* :class:`RowParallelLinear` -- the input features are split, the partial products are summed
  (all-reduce forward, identity backward) and the replicated bias added;
* :class:`TPBlock` -- ``x + dropout(fc2(tp_dropout(gelu(fc1(x)))))``, fc1 column- and fc2
  row-parallel. ``tp_dropout`` draws its mask from the rank's tensor-parallel generator
  (:class:`TPGenerator`, seeded per rank as Megatron's model-parallel RNG tracker is); the outer
  dropout draws from the default generator (the same on every rank).

Graph-safe random numbers: on the CUDA engine the tensor-parallel generator is registered with
the engine (``gograph.CudaEngine(device, generators=[gen])``), so each capture carries its
offset and each replay advances it; torch's default generator is carried without registration.
The eager engine needs nothing: its replays re-run the callable, which draws from the same
generators as eager code. Every collective works on a fresh tensor, as a capture needs.

Weights are cut from one dense initialisation (a CPU generator with a fixed seed), so every rank
holds its shard of the same model. :func:`train_tp` trains a graphed and an eager copy of the
same blocks on one rank and reports what the tests compare.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import gograph

from rank_world import RankContext, digest

D, FFN, ROWS, BLOCKS, STEPS = 16, 32, 8, 2, 3
DROPOUT = 0.25
TP_SEED_OFFSET = 2718  # Megatron-LM's model-parallel seed = seed + 2718 + tensor-parallel rank


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; the grad is summed over the tensor-parallel group backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce (sum) forward over the tensor-parallel group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def dense_linear(d_in: int, d_out: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(weight [d_out, d_in], bias [d_out]) drawn as ``nn.Linear`` draws them, from ``gen``."""
    bound = 1.0 / math.sqrt(d_in)
    return (torch.rand(d_out, d_in, generator=gen) * 2 - 1) * bound, (torch.rand(d_out, generator=gen) * 2 - 1) * bound


class ColumnParallelLinear(torch.nn.Module):
    """``y_shard = x @ W_shard^T + b_shard``: this rank's rows of the dense weight."""

    def __init__(self, weight: Tensor, bias: Tensor, group: Any = None) -> None:
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        n = weight.shape[0] // size
        self.group = group
        self.weight = torch.nn.Parameter(weight[rank * n : (rank + 1) * n].clone())
        self.bias = torch.nn.Parameter(bias[rank * n : (rank + 1) * n].clone())

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(_CopyToRegion.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """``y = all_reduce(x_shard @ W_shard^T) + b``: this rank's columns of the dense weight."""

    def __init__(self, weight: Tensor, bias: Tensor, group: Any = None) -> None:
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        n = weight.shape[1] // size
        self.group = group
        self.weight = torch.nn.Parameter(weight[:, rank * n : (rank + 1) * n].clone())
        self.bias = torch.nn.Parameter(bias.clone())

    def forward(self, x: Tensor) -> Tensor:
        return _ReduceFromRegion.apply(F.linear(x, self.weight), self.group) + self.bias


class TPGenerator:
    """A rank's tensor-parallel RNG: its own generator, seeded ``seed + 2718 + rank``."""

    def __init__(self, device: torch.device, seed: int = 1234) -> None:
        self.seed = seed + TP_SEED_OFFSET + dist.get_rank()
        self.generator = torch.Generator(device=device)
        self.reset()

    def reset(self) -> None:
        self.generator.manual_seed(self.seed)


def tp_dropout(x: Tensor, p: float, generator: torch.Generator) -> Tensor:
    """Dropout whose mask comes from ``generator`` (inside the tensor-parallel region)."""
    keep = torch.rand(x.shape, device=x.device, dtype=x.dtype, generator=generator) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


class TPBlock(torch.nn.Module):
    """``x + dropout(fc2(tp_dropout(gelu(fc1(x)))))``; fc1 column-, fc2 row-parallel."""

    def __init__(self, seed: int, tp_gen: TPGenerator, group: Any = None, p: float = DROPOUT) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1 = ColumnParallelLinear(*dense_linear(D, FFN, gen), group)
        self.fc2 = RowParallelLinear(*dense_linear(FFN, D, gen), group)
        self.tp_gen, self.p = tp_gen, p

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc1(x))
        if self.p:
            h = tp_dropout(h, self.p, self.tp_gen.generator)
        return x + F.dropout(self.fc2(h), self.p, self.training)


# ---------------------------------------------------------------------------------------------
# One rank's run: graphed against eager
# ---------------------------------------------------------------------------------------------
def rng_state(device: torch.device) -> Tensor:
    """The default generator's state on ``device``."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def seed_all(device: torch.device, tp_gen: TPGenerator, seed: int = 99) -> None:
    """The default generator (the same on every rank) and this rank's TP generator, reset."""
    torch.manual_seed(seed)
    tp_gen.reset()


def engine_for(device: torch.device, tp_gen: TPGenerator) -> gograph.Engine:
    """The CUDA engine carrying the TP generator, or the eager engine (nothing to register)."""
    if device.type == "cuda":
        return gograph.CudaEngine(device, generators=[tp_gen.generator])
    return gograph.EagerEngine()


def make_blocks(device: torch.device, tp_gen: TPGenerator, p: float = DROPOUT, count: int = BLOCKS) -> list[TPBlock]:
    return [TPBlock(seed, tp_gen, p=p).to(device) for seed in range(count)]


def count_all_reduce(counter: list[int]) -> Callable[[], None]:
    """Counts calls of ``dist.all_reduce`` from Python (the region functions' calls) into
    ``counter[0]``; returns the function that restores it."""
    real = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    return lambda: setattr(dist, "all_reduce", real)


def sgd_step(params: Sequence[Tensor], lr: float = 0.1) -> None:
    """``p -= lr * p.grad``, then the grads dropped: plain SGD and ``zero_grad()``, without
    ``torch.optim``, which imports torch._dynamo (2 s of CPU in the test process, which trains
    only these blocks)."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
            p.grad = None


def train_steps(model: Callable[[Tensor], Tensor], params: Sequence[Tensor], data: Sequence[Tensor]) -> list[Tensor]:
    """SGD steps of ``mse(model(x), 0)``; the losses (clones)."""
    losses = []
    for x in data:
        loss = model(x).square().mean()
        loss.backward()
        sgd_step(params)
        losses.append(loss.detach().clone())
    return losses


def chain(blocks: Sequence[Callable[[Tensor], Tensor]]) -> Callable[[Tensor], Tensor]:
    def run(x: Tensor) -> Tensor:
        for b in blocks:
            x = b(x)
        return x

    return run


def train_tp(device: torch.device, rank: int, p: float = DROPOUT) -> dict[str, Any]:
    """This rank's TP blocks trained graphed and eagerly from the same seeds: losses and
    parameters (equal?), the generators' end states, Python-level all-reduce calls during
    training, the shapes of the shards and static buffers, and what ``reset()`` left."""
    return leak_checked(_train_tp, device, rank, p)


def _train_tp(device: torch.device, rank: int, p: float) -> dict[str, Any]:
    tp_gen = TPGenerator(device)
    eager, graphed = make_blocks(device, tp_gen, p), make_blocks(device, tp_gen, p)
    gen = torch.Generator().manual_seed(5)
    samples = tuple((torch.randn(ROWS, D, generator=gen).to(device).requires_grad_(i > 0),) for i in range(BLOCKS))
    engine, pool = engine_for(device, tp_gen), gograph.graph_pool_handle()
    tp_before = tp_gen.generator.get_state().clone()
    callables = gograph.make_graphed_callables(tuple(graphed), samples, engine=engine, pool=pool)
    out: dict[str, Any] = {"rank": rank, "engine": engine.name}
    out["graphing_kept_tp_state"] = torch.equal(tp_before, tp_gen.generator.get_state())
    data = [torch.randn(ROWS, D, generator=gen).to(device) for _ in range(STEPS)]
    runs = {
        name: _train_counted(blocks, data, tp_gen, device) for name, blocks in (("eager", eager), ("graphed", graphed))
    }
    out["calls"] = {name: run["calls"] for name, run in runs.items()}
    for key in ("losses", "params", "rng", "tp_state"):  # lists of tensors
        a, b = runs["eager"][key], runs["graphed"][key]
        out[f"{key}_equal"] = len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
    out["losses_change"] = not torch.equal(runs["graphed"]["losses"][0], runs["graphed"]["losses"][-1])
    out["tp_state"] = runs["graphed"]["tp_state"][0]
    out["tp_advanced"] = not torch.equal(out["tp_state"], runs["graphed"]["tp_seeded"])
    out["params"] = digest(runs["graphed"]["params"])
    out["replicated"] = digest([b.fc2.bias for b in graphed])
    out["shapes"] = _shapes(graphed, callables)
    out.update(release(list(callables), engine, pool, data[0]))
    return out


def _train_counted(
    blocks: Sequence[TPBlock], data: Sequence[Tensor], tp_gen: TPGenerator, device: torch.device
) -> dict[str, Any]:
    """:func:`train_steps` from fresh seeds, counting Python's all-reduce calls; the losses,
    the parameters, the generators' end states and the count."""
    seed_all(device, tp_gen)
    seeded = tp_gen.generator.get_state().clone()
    counter = [0]
    restore = count_all_reduce(counter)
    try:
        losses = train_steps(chain(blocks), [q for b in blocks for q in b.parameters()], data)
    finally:
        restore()
    return {
        "losses": losses,
        "params": [q.detach().clone() for b in blocks for q in b.parameters()],
        "rng": [rng_state(device).clone()],
        "tp_state": [tp_gen.generator.get_state().clone()],
        "tp_seeded": seeded,
        "calls": counter[0],
    }


def _shapes(blocks: Sequence[TPBlock], callables: Sequence[gograph.GraphedModule]) -> dict[str, Any]:
    b = blocks[0]
    first = callables[0].forward
    return {
        "fc1.weight": tuple(b.fc1.weight.shape),
        "fc2.weight": tuple(b.fc2.weight.shape),
        "fc2.bias": tuple(b.fc2.bias.shape),
        "static_output": tuple(first.static_outputs[0].shape),
        "static_input": tuple(first.static_input_surface[0].shape),
    }


def release(callables: list[Any], engine: gograph.Engine, pool: Any, x: Tensor) -> dict[str, Any]:
    """Resets every graphed callable (modules or GraphedCallables; the list is emptied): the
    pool references left, and the error a call of the first one raises after the reset (None
    when it does not raise)."""
    first = callables[0]
    _reset_all(callables)
    callables.clear()
    left: dict[str, Any] = {"pool_refs_left": engine.pool_refs(pool), "call_after_reset": None}
    try:
        first(x)
    except RuntimeError as e:
        left["call_after_reset"] = str(e)
    return left


def leak_checked(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)``'s result with the pass records and graphs left once everything it made is
    gone (``passes_left``, ``graphs_left``: live counts above those before it). The counts
    before are taken without a collection (0.2 s in a test process): every run ends with one,
    the rank world collects after each run, and the test fixture before each test."""
    passes, graphs = gograph.live_passes(), gograph.live_graphs()
    out = run(*args)
    gc.collect()
    out["passes_left"] = gograph.live_passes() - passes
    out["graphs_left"] = gograph.live_graphs() - graphs
    return out


def _reset_all(callables: Sequence[Any]) -> None:
    for c in callables:  # a loop variable in the caller would keep the last one alive
        c.reset()


def train_tp_order(device: torch.device, rank: int, chunks: int = 3, microbatches: int = 4) -> dict[str, Any]:
    """TP blocks as the virtual chunks of a Megatron-LM interleaved pipeline rank (one block a
    chunk, ``_order`` from ``gograph.megatron_order`` for pipeline rank 0 of 2), graphed and eager through the same
    schedule for 2 iterations: chunk outputs, chunk input grads and parameters (equal?), the TP
    generator's end state, and what ``reset()`` left."""
    return leak_checked(_train_tp_order, device, rank, chunks, microbatches)


def _train_tp_order(device: torch.device, rank: int, chunks: int, microbatches: int) -> dict[str, Any]:
    tp_gen = TPGenerator(device)
    order = gograph.megatron_order(2, 0, chunks, microbatches)
    eager, mods = make_blocks(device, tp_gen, count=chunks), make_blocks(device, tp_gen, count=chunks)
    gen = torch.Generator().manual_seed(6)
    samples = tuple((torch.randn(ROWS, D, generator=gen).to(device).requires_grad_(),) for _ in range(len(order) // 2))
    engine, pool = engine_for(device, tp_gen), gograph.graph_pool_handle()
    graphed = gograph.make_graphed_callables(
        tuple(mods),
        samples,
        num_warmup_iters=2,
        _order=order,
        _num_layers_per_chunk=[1] * chunks,
        engine=engine,
        pool=pool,
    )
    runs: dict[str, Any] = {}
    for name, call in (
        ("eager", lambda i, x: eager[i // microbatches](x)),
        ("graphed", lambda i, x: graphed[i](x)),
    ):
        seed_all(device, tp_gen)
        runs[name] = _pipeline_iterations(order, chunks, microbatches, call, eager if name == "eager" else mods, device)
        runs[name]["tp_state"] = tp_gen.generator.get_state().clone()
    out: dict[str, Any] = {"rank": rank, "order": order, "passes": len(graphed)}
    for key in ("outputs", "grads", "params"):
        a, b = runs["eager"][key], runs["graphed"][key]
        out[f"{key}_equal"] = len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
    out["tp_state_equal"] = torch.equal(runs["eager"]["tp_state"], runs["graphed"]["tp_state"])
    out["tp_state"] = runs["graphed"]["tp_state"]
    out.update(release(list(graphed), engine, pool, samples[0][0]))
    return out


def _pipeline_iterations(
    order: Sequence[int],
    chunks: int,
    microbatches: int,
    call: Callable[[int, Tensor], Tensor],
    blocks: Sequence[TPBlock],
    device: torch.device,
    iterations: int = 2,
) -> dict[str, list[Tensor]]:
    """``iterations`` SGD iterations of the schedule (te_models.run_pipeline, chunks chained):
    every chunk output and chunk input grad in (chunk, microbatch) order, and the parameters."""
    from te_models import run_pipeline

    params = [q for b in blocks for q in b.parameters()]
    gen = torch.Generator().manual_seed(8)
    keys = [(c, m) for c in range(chunks) for m in range(microbatches)]
    outputs: list[Tensor] = []
    grads: list[Tensor] = []
    for _ in range(iterations):
        inputs = {k: torch.randn(ROWS, D, generator=gen).to(device).requires_grad_() for k in keys}
        dys = {k: torch.randn(ROWS, D, generator=gen).to(device) for k in keys}
        got: dict[tuple[int, int], Tensor] = {}
        values = run_pipeline(order, [1] * chunks, microbatches, call, inputs, dys, True, grads=got)
        outputs += [values[k] for k in keys]
        grads += [got[k] for k in keys if k in got]
        sgd_step(params)
    return {"outputs": outputs, "grads": grads, "params": [q.detach().clone() for q in params]}


def train_tp_on_rank(ctx: RankContext, p: float) -> dict[str, Any]:
    """The rank function: :func:`train_tp` in a spawned rank of a real group."""
    return train_tp(ctx.device, ctx.rank, p)


# ---------------------------------------------------------------------------------------------
# Checking a rank's results (in the test process)
# ---------------------------------------------------------------------------------------------
def reset_problems(row: dict[str, Any]) -> list[str]:
    """What :func:`release` found wrong: anything left, or a call after reset that did not raise
    the reset error."""
    out = []
    left = {k: row[k] for k in ("passes_left", "graphs_left", "pool_refs_left") if row[k] > 0}
    if left:
        out.append(f"reset left {left}")
    if "was reset" not in (row["call_after_reset"] or ""):
        out.append(f"a call after reset() raised {row['call_after_reset']!r}, not the reset error")
    return out


def problems(row: dict[str, Any], engine: str, size: int) -> list[str]:
    """What is wrong with one rank's :func:`train_tp` result in a group of ``size``: graphed
    training not bitwise equal to eager (losses, parameters, generators), the TP generator not
    used, the wrong engine, wrong shard or static-buffer shapes, anything left after reset."""
    want = {"losses_equal", "params_equal", "rng_equal", "tp_state_equal", "losses_change", "tp_advanced"}
    out = [f"{k} is False" for k in sorted(want) if not row[k]]
    if row["engine"] != engine:
        out.append(f"graphed on the {row['engine']} engine")
    shapes = {
        "fc1.weight": (FFN // size, D),
        "fc2.weight": (D, FFN // size),
        "fc2.bias": (D,),
        "static_output": (ROWS, D),
        "static_input": (ROWS, D),
    }
    if row["shapes"] != shapes:
        out.append(f"shapes {row['shapes']}, expected {shapes}")
    return out + reset_problems(row)
