"""Rank side of the DDP tests: DistributedDataParallel over gograph's per-layer graphed callables,
trained beside an eager DDP reference on the same rank, with the same data and seeds.

Each rank trains both models for ``STEPS`` SGD steps on its own data (different on every rank)
and reports digests of the parameters and the last step's grads, so the test process can check
them against the reference and across ranks bit for bit.

Which eager reference is bitwise-comparable matters with more than two ranks. After its first
iteration DDP rebuilds its buckets in the order gradients became ready, and gloo's ring
all-reduce over 4 ranks sums an element in an order that depends on its position in its bucket.
A graphed layer is one autograd node, whose parameter grads become ready together (weight, then
bias), where an eager ``Linear`` readies its bias before its weight: on 4 ranks plain eager DDP
differs from the graphed run -- and from any model that folds each layer into one autograd
node -- by ~1e-8 from the second step on. So a config names its reference:

* ``one_node``: every layer of the reference folded into one autograd Function
  (:class:`OneNodeLayer`), the shape of a graphed layer; both DDPs with their defaults;
* ``find_unused``: plain eager layers; both DDPs with ``find_unused_parameters=True``, under
  which DDP does not rebuild its buckets (the order is the parameters' on both sides).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import gograph

from rank_world import RankContext, digest

D, HIDDEN, BATCH, LAYERS, STEPS = 16, 32, 8, 3, 3
BUCKET_CAP_MB = 0.008  # ~2000 floats: the 3 layers' 3.3k parameters in two buckets
PLACEMENTS = ("graph_then_wrap", "wrap_then_graph")


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """One training run. ``placement``: graph the layers then wrap the model in DDP, or wrap
    then graph ``ddp.module``'s layers; ``accum``: micro-batches per step, all but the last
    under ``no_sync()``; ``own_stream``: DDP constructed under a side stream given to the
    engine and training on a non-default stream (Megatron's setup; no-op on CPU)."""

    placement: str = "graph_then_wrap"
    reference: str = "one_node"
    set_to_none: bool = True
    bucket_view: bool = False
    chain: bool = False
    accum: int = 1
    own_stream: bool = False

    def __str__(self) -> str:
        flags = [self.placement, f"ref={self.reference}", f"set_to_none={self.set_to_none}"]
        flags += [f"bucket_view={self.bucket_view}", f"chain={self.chain}", f"accum={self.accum}"]
        return " ".join(flags + (["own_stream"] if self.own_stream else []))


class Block(torch.nn.Module):
    """``x + fc2(gelu(fc1(x)))``: one per-layer callable."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(D, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / p.shape[-1] ** 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class _OneNode(torch.autograd.Function):
    """A layer as one autograd node: forward runs it on detached inputs, backward takes the
    grads of its input and parameters with ``torch.autograd.grad`` (as a graphed callable's
    backward does), so the parameters' grads become ready together, in parameter order."""

    @staticmethod
    def forward(ctx: Any, layer: torch.nn.Module, x: Tensor, *params: Tensor) -> Tensor:  # type: ignore[override]
        with torch.enable_grad():
            xd = x.detach().requires_grad_(x.requires_grad)
            out = layer(xd)
        ctx.inner, ctx.params = (xd, out), params
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (xd, out), params = ctx.inner, ctx.params
        del ctx.inner
        inputs = ((xd,) if xd.requires_grad else ()) + tuple(params)
        grads = torch.autograd.grad(out, inputs, grad)
        dx = grads[0] if xd.requires_grad else None
        return (None, dx, *grads[len(grads) - len(params) :])


class OneNodeLayer(torch.nn.Module):
    """``layer`` folded into one autograd node (the eager reference of a graphed layer)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return _OneNode.apply(self.layer, x, *self.layer.parameters())


# ---------------------------------------------------------------------------------------------
# Building the two models
# ---------------------------------------------------------------------------------------------
def _layers(ctx: RankContext) -> list[torch.nn.Module]:
    return [Block(seed).to(ctx.device) for seed in range(LAYERS)]


def wrap(ctx: RankContext, model: torch.nn.Module, cfg: DDPConfig, side: Any) -> DDP:
    """DDP around ``model``, constructed under ``side`` when given (CUDA)."""
    kwargs: dict[str, Any] = {
        "gradient_as_bucket_view": cfg.bucket_view,
        "find_unused_parameters": cfg.reference == "find_unused",
        "bucket_cap_mb": BUCKET_CAP_MB,
    }
    if ctx.cuda:
        kwargs["device_ids"] = [ctx.device.index]
    with on_stream(ctx, side):
        return DDP(model, **kwargs)


def graph_layers(ctx: RankContext, layers: Sequence[torch.nn.Module], cfg: DDPConfig, side: Any) -> dict[str, Any]:
    """Graphs ``layers`` (one callable each, one pool), on an engine of their own: the engine,
    pool and callables, to check and release afterwards."""
    gen = torch.Generator().manual_seed(7)
    samples = tuple(
        (torch.randn(BATCH, D, generator=gen).to(ctx.device).requires_grad_(i > 0),) for i in range(len(layers))
    )
    engine = gograph.CudaEngine(ctx.device, stream=side) if ctx.cuda else gograph.EagerEngine()
    pool = gograph.graph_pool_handle()
    gograph.make_graphed_callables(
        tuple(layers), samples, num_warmup_iters=2, engine=engine, pool=pool, chain_buffers=cfg.chain
    )
    return {"engine": engine, "pool": pool, "callables": [m.forward for m in layers]}


def build_graphed(ctx: RankContext, cfg: DDPConfig, side: Any) -> tuple[DDP, dict[str, Any]]:
    """The graphed model in DDP, in ``cfg.placement`` order."""
    layers = _layers(ctx)
    if cfg.placement == "graph_then_wrap":
        graphed = graph_layers(ctx, layers, cfg, side)
        return wrap(ctx, torch.nn.Sequential(*layers), cfg, side), graphed
    ddp = wrap(ctx, torch.nn.Sequential(*layers), cfg, side)
    return ddp, graph_layers(ctx, list(ddp.module), cfg, side)


def build_reference(ctx: RankContext, cfg: DDPConfig, side: Any) -> DDP:
    layers = _layers(ctx)
    if cfg.reference == "one_node":
        layers = [OneNodeLayer(m) for m in layers]
    return wrap(ctx, torch.nn.Sequential(*layers), cfg, side)


def side_stream(ctx: RankContext, cfg: DDPConfig) -> Any:
    """The side stream DDP is constructed under and the engine captures on (CUDA), or None.
    Wrapping before graphing needs it on CUDA: DDP's grad accumulators keep the stream they
    were made on, and a backward capture on another stream must not sync with it."""
    if ctx.cuda and (cfg.own_stream or cfg.placement == "wrap_then_graph"):
        return torch.cuda.Stream(ctx.device)
    return None


@contextlib.contextmanager
def on_stream(ctx: RankContext, stream: Any) -> Iterator[None]:
    """``torch.cuda.stream(stream)``, ordered after the current stream's work and before what
    follows it; a no-op on CPU or without a stream."""
    if stream is None or not ctx.cuda:
        yield
        return
    before = torch.cuda.current_stream(ctx.device)
    stream.wait_stream(before)
    with torch.cuda.stream(stream):
        yield
    before.wait_stream(stream)


# ---------------------------------------------------------------------------------------------
# Training and comparing
# ---------------------------------------------------------------------------------------------
def rank_batches(ctx: RankContext, cfg: DDPConfig) -> list[list[tuple[Tensor, Tensor]]]:
    """Per step, ``cfg.accum`` (input, target) micro-batches: this rank's own data."""
    gen = torch.Generator().manual_seed(1000 + ctx.rank)

    def draw() -> Tensor:
        return torch.randn(BATCH, D, generator=gen).to(ctx.device)

    return [[(draw(), draw()) for _ in range(cfg.accum)] for _ in range(STEPS)]


def train(ctx: RankContext, ddp: DDP, cfg: DDPConfig, work: Any) -> dict[str, Any]:
    """``STEPS`` SGD steps; the losses, the last step's grads (digest and how many distinct
    storages hold them: a bucket view shares its bucket's) and the parameters' digest."""
    data = rank_batches(ctx, cfg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses: list[Tensor] = []
    grads: dict[str, Any] = {}
    with on_stream(ctx, work):
        for step, micro in enumerate(data):
            for i, (x, y) in enumerate(micro):
                with ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                    loss = F.mse_loss(ddp(x), y)
                    loss.backward()
                losses.append(loss.detach().clone())
            if step == len(data) - 1:
                held = [p.grad for p in ddp.parameters() if p.grad is not None]
                grads = {"digest": digest(held), "count": len(held), "storages": _storages(held)}
            opt.step()
            opt.zero_grad(set_to_none=cfg.set_to_none)
    ctx.sync()
    return {"losses": losses, "grads": grads, "params": digest(list(ddp.parameters()))}


def _storages(tensors: Sequence[Tensor]) -> int:
    return len({t.untyped_storage().data_ptr() for t in tensors})


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def run_config(ctx: RankContext, cfg: DDPConfig) -> dict[str, Any]:
    """One config on this rank: both models trained, then the graphed callables reset."""
    gc.collect()
    base = (gograph.live_passes(), gograph.live_graphs())
    side = side_stream(ctx, cfg)
    work = torch.cuda.Stream(ctx.device) if ctx.cuda and cfg.own_stream else None
    init = digest([p for m in _layers(ctx) for p in m.parameters()])
    graphed, g = build_graphed(ctx, cfg, side)
    reference = build_reference(ctx, cfg, side)
    got, ref = train(ctx, graphed, cfg, work), train(ctx, reference, cfg, work)
    out = {
        "config": str(cfg),
        "params": got["params"],
        "ref_params": ref["params"],
        "max_diff": max_diff(graphed, reference),
        "moved": got["params"] != init,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"])),
        "grads": got["grads"],
        "ref_grads": ref["grads"],
        "engine": g["engine"].name,
    }
    del graphed, reference
    out.update(release(g, base))
    return out


def release(graphed: dict[str, Any], base: tuple[int, int]) -> dict[str, int]:
    """Resets the callables of ``graph_layers``, drops them, and says what is left: pool
    references, and pass records and graphs above ``base`` (live counts before the build)."""
    _reset_all(graphed.pop("callables"))
    left = {"pool_refs_left": graphed["engine"].pool_refs(graphed["pool"])}
    graphed.clear()
    gc.collect()
    left["passes_left"] = gograph.live_passes() - base[0]
    left["graphs_left"] = gograph.live_graphs() - base[1]
    return left


def _reset_all(callables: Sequence[gograph.GraphedCallable]) -> None:
    for c in callables:  # a loop variable in the caller would keep the last one alive
        c.reset()


def train_configs(ctx: RankContext, configs: Sequence[DDPConfig]) -> list[dict[str, Any]]:
    """The rank function: every config in turn."""
    return [run_config(ctx, cfg) for cfg in configs]


# ---------------------------------------------------------------------------------------------
# Data parallelism inside the graphs
# ---------------------------------------------------------------------------------------------
class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward ``all_reduce(grad / world size)``: DDP's averaging per
    parameter, inside whatever captures the backward."""

    @staticmethod
    def forward(ctx: Any, p: Tensor) -> Tensor:  # type: ignore[override]
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        out = grad.contiguous() / dist.get_world_size()
        dist.all_reduce(out)
        return out


class InGraphDPBlock(Block):
    """:class:`Block` whose parameter grads are averaged over the ranks in its own backward."""

    def forward(self, x: Tensor) -> Tensor:
        w1, b1, w2, b2 = (
            _AllReduceGrad.apply(p) for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        )
        return x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _sgd(layers: Sequence[torch.nn.Module], data: Sequence[tuple[Tensor, Tensor]]) -> tuple[list[Tensor], str]:
    """SGD steps of the layers in sequence, no DDP: the losses and the parameters' digest."""
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in data:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, digest(list(model.parameters()))


def train_in_graph_dp(ctx: RankContext) -> dict[str, Any]:
    """:class:`InGraphDPBlock` layers trained graphed and eagerly on this rank's data (no DDP:
    the all-reduces are inside the backward graphs): digests and equalities, and what the
    graphed callables' reset left."""
    gc.collect()
    base = (gograph.live_passes(), gograph.live_graphs())
    eager = [InGraphDPBlock(seed).to(ctx.device) for seed in range(LAYERS)]
    layers = [InGraphDPBlock(seed).to(ctx.device) for seed in range(LAYERS)]
    g = graph_layers(ctx, layers, DDPConfig(chain=True), None)
    data = [micro[0] for micro in rank_batches(ctx, DDPConfig())]
    got = {"eager": _sgd(eager, data), "graphed": _sgd(layers, data)}
    out = {
        "engine": g["engine"].name,
        "params": got["graphed"][1],
        "ref_params": got["eager"][1],
        "losses_equal": all(torch.equal(a, b) for a, b in zip(got["eager"][0], got["graphed"][0])),
    }
    del eager, layers
    out.update(release(g, base))
    return out


# ---------------------------------------------------------------------------------------------
# Checking the ranks' results (in the test process)
# ---------------------------------------------------------------------------------------------
def problems(configs: Sequence[DDPConfig], per_rank: Sequence[Sequence[dict[str, Any]]], engine: str) -> list[str]:
    """What is wrong with every rank's results of ``train_configs(configs)``: parameters,
    losses or last grads not bitwise equal to the reference's, nothing trained, a callable not
    on ``engine``, anything left after reset, ranks that disagree. Empty when all is well."""
    out: list[str] = []
    for i, cfg in enumerate(configs):
        rows = [results[i] for results in per_rank]
        out += [f"[{cfg}] {p}" for p in _config_problems(cfg, rows, engine)]
    return out


def _config_problems(cfg: DDPConfig, rows: Sequence[dict[str, Any]], engine: str) -> list[str]:
    out: list[str] = []
    for r, row in enumerate(rows):
        if row["engine"] != engine:
            out.append(f"rank {r}: graphed on the {row['engine']} engine")
        if row["params"] != row["ref_params"]:
            out.append(f"rank {r}: parameters differ from the {cfg.reference} reference (max {row['max_diff']:.3g})")
        if not row["losses_equal"]:
            out.append(f"rank {r}: losses differ from the reference's")
        if row["grads"] != row["ref_grads"]:
            out.append(f"rank {r}: last step's grads {row['grads']} but the reference's {row['ref_grads']}")
        if not row["moved"]:
            out.append(f"rank {r}: the parameters did not change (nothing trained)")
        left = {k: row[k] for k in ("passes_left", "graphs_left", "pool_refs_left") if row[k] > 0}
        if left:
            out.append(f"rank {r}: reset left {left}")
    if len({row["params"] for row in rows}) != 1:
        out.append("ranks ended with different parameters")
    return out


def in_graph_dp_problems(rows: Sequence[dict[str, Any]], engine: str) -> list[str]:
    """What is wrong with every rank's :func:`train_in_graph_dp` result."""
    out: list[str] = []
    for r, row in enumerate(rows):
        if row["engine"] != engine:
            out.append(f"rank {r}: graphed on the {row['engine']} engine")
        if row["params"] != row["ref_params"] or not row["losses_equal"]:
            out.append(f"rank {r}: graphed training differs from eager (losses equal: {row['losses_equal']})")
        left = {k: row[k] for k in ("passes_left", "graphs_left", "pool_refs_left") if row[k] > 0}
        if left:
            out.append(f"rank {r}: reset left {left}")
    if len({row["params"] for row in rows}) != 1:
        out.append("ranks ended with different parameters")
    return out
