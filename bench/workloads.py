"""Training workloads shared by the memory and step-time benchmarks (bench/footprint.py,
bench/steptime.py).

Each workload builds its layers (one graphed callable per layer), the sample args a maker graphs
them with, a batch per training step, and the step itself: the forward through every pass, the
loss and its backward. The same step runs eager layers, torch's graphed layers and gograph's, so
the arms differ only in what graphing adds.

* ``chain``: 8 per-layer MLPs 4096 -> 4096 -> 4096 (GELU), 8192 rows, bf16.
* ``blocks``: 12 pre-norm transformer blocks (causal SDPA, MLP 4x), hidden 1024, 8 x 1024 tokens, bf16.
* ``pipeline``: one rank of Megatron-LM's interleaved 1F1B schedule (bench/pipeline.py's
  scenario): 4 virtual chunks x 2 layers, 8 microbatches, ``x + fc2(gelu(fc1(ln(x))))``, hidden
  1024, 4096 rows, bf16; graphed with ``_order`` (64 passes), each chunk's input a fresh tensor
  that requires grad (what the rank receives), each chunk backward a fresh output grad; grads
  accumulate over the 8 microbatches of a step.
* ``stack``: 32 per-layer Linear(256) + ReLU, 64 rows, fp32: launch-bound (step time only).
* ``stack_dropout``: the stack with Dropout(0.1) after each ReLU (every pass has an RNG companion,
  so every replay also orders the stream and replays the companion).

``--small`` sizes (tests, CPU smoke runs) keep the structure with tiny tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import gograph
from gograph import megatron_order

Step = Callable[[Sequence[Callable[..., Any]], "Batch"], None]


@dataclass
class Batch:
    """One training step's data: the first layer's input(s) and, for the pipeline, the output
    grads of each chunk backward.

    A batch made with ``recv=True`` has no inputs up front: input k (the pipeline's chunk input
    k; the chain's and blocks' one input) is *received* right before its forward (drawn from
    ``gen`` then, in schedule order, the same in every arm), into ``into[k]`` when given (a
    graph's static input: Megatron-LM's receive into the graph's buffer, or a data loader's copy
    into it, which makes the replay's copy-in a no-op) or a fresh tensor, and dropped after its
    backward (a pipeline has then sent its grad)."""

    inputs: list[Tensor]
    grads: list[Tensor] = field(default_factory=list)
    gen: torch.Generator | None = None  # recv: where received data comes from
    into: dict[int, Tensor] = field(default_factory=dict)  # recv: chunk input k lands in into[k]
    pool: CallerPool | None = None  # the caller's tensors in a pool of their own (CallerPool)

    def receive(self, k: int, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = True) -> Tensor:
        """Input k: pre-made, or received now (see the class docstring), on ``gen``'s device."""
        if self.gen is None:
            return self.inputs[k]
        device = self.gen.device
        target = self.into.get(k)
        if target is None:
            with CallerPool.routing(self.pool):
                return torch.randn(shape, generator=self.gen, device=device, dtype=dtype).requires_grad_(requires_grad)
        with torch.no_grad():  # in place, as a receive is: randn is empty().normal_(), same draws
            target.normal_(generator=self.gen)
        return target


class CallerPool:
    """A memory pool of its own for what a step allocates outside the layers: the batch (inputs,
    the pipeline's output grads, received inputs) and the loss with its backward down to the last
    layer's incoming grad (the footprint bench's eager ``pools=1`` arm).

    That is the structure graphed training has, whatever the graphing library: the layers'
    memory is the graph pool, the caller's tensors are in the default pool, and neither pool can
    use the other's free blocks (a graph pool block handed to a caller's tensor would be
    overwritten by the next replay). Eager training with this split is a floor for graphed
    training with the loss outside the graphs, as ``copies=1`` is for a graph's copies.

    While routing, every allocation goes to the pool whatever its thread or stream (torch's
    ``_cuda_beginAllocateToPool``): the loss's backward runs on autograd's device thread. CUDA
    only; the pool lives as long as the process."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the bench's pools=1 needs a CUDA device, got {device}")
        self.device = device.index if device.index is not None else torch.cuda.current_device()
        self.id = torch.cuda.graph_pool_handle()

    def begin(self) -> None:
        torch._C._cuda_beginAllocateToPool(self.device, self.id)

    def end(self) -> None:
        torch._C._cuda_endAllocateToPool(self.device, self.id)

    @staticmethod
    @contextlib.contextmanager
    def routing(pool: CallerPool | None) -> Iterator[None]:
        """Allocations inside go to ``pool`` (none: the default pool, nothing changes)."""
        if pool is None:
            yield
            return
        pool.begin()
        try:
            yield
        finally:
            pool.end()

    def loss_backward(self, x: Tensor) -> None:
        """``loss_of(x).backward()`` with the loss's forward and backward in this pool: routing
        ends when ``x``'s grad is made (a hook on ``x``, on autograd's thread), so the layers'
        backward allocates in the layers' pool."""
        routed = [True]

        def stop(_grad: Tensor | None = None) -> None:
            if routed[0]:
                routed[0] = False
                self.end()

        self.begin()
        try:
            loss = loss_of(x)
            x.register_hook(stop)
            loss.backward()
        finally:
            stop()


class MLP(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width)
        self.fc2 = torch.nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class WithLoss(torch.nn.Module):
    """A layer followed by the workloads' loss (``--arms ...+loss_in_graph=1``): graphed as one
    callable, the loss's temporaries live in the graph pool with the backward graphs'."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return loss_of(self.layer(x))


def loss_of(x: Tensor) -> Tensor:
    """The loss of every default-schedule workload (a 0-dim output is a loss already)."""
    return x if x.dim() == 0 else x.float().square().mean()


class Block(torch.nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)); x + mlp(ln2(x)), causal SDPA."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PipeLayer(torch.nn.Module):
    """x + fc2(gelu(fc1(layernorm(x)))) (bench/pipeline.py's layer)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class LinearReLU(torch.nn.Module):
    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.p = dropout

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.fc(x))
        return F.dropout(x, self.p, self.training) if self.p else x


@dataclass
class Workload:
    """A workload: how to build it and run one training step over its graphed callables."""

    name: str
    n_layers: int
    input_shape: tuple[int, ...]
    dtype: torch.dtype
    make_layer: Callable[[], torch.nn.Module]
    # pipeline only: Megatron order, layers per chunk, microbatches
    order: list[int] | None = None
    layers_per_chunk: int = 1
    microbatches: int = 1

    @property
    def chunks(self) -> int:
        return self.n_layers // self.layers_per_chunk

    @property
    def passes(self) -> int:
        return self.n_layers * self.microbatches

    def build(self, device: torch.device, seed: int = 0) -> list[torch.nn.Module]:
        torch.manual_seed(seed)
        return [self.make_layer().to(device=device, dtype=self.dtype) for _ in range(self.n_layers)]

    def sample_args(self, device: torch.device, share_chained: bool | str = False) -> tuple[tuple[Tensor, ...], ...]:
        """One tuple per pass. Without an order layer 0 sees data (no grad) and every later layer
        an activation (requires grad); in the pipeline every pass's input requires grad. With
        ``share_chained`` the passes that take the previous layer's output (every layer but a
        chunk's first) share one sample tensor: with ``chain_buffers`` their samples are only read
        by warmup (the graphs read the previous layer's output), as gograph's docs recommend.
        ``share_chained="all"`` (no order) makes that shared sample a view of layer 0's (layer 0's
        sample is its static input; the view costs no memory)."""

        def one(rg: bool) -> tuple[Tensor, ...]:
            return (torch.randn(self.input_shape, device=device, dtype=self.dtype).requires_grad_(rg),)

        if self.order is None:
            first = one(False)
            shared = (first[0].detach().requires_grad_(True),) if share_chained == "all" else one(True)
            return tuple(first if i == 0 else shared if share_chained else one(True) for i in range(self.n_layers))
        shared = one(True)
        L = self.layers_per_chunk
        return tuple(shared if share_chained and p % L else one(True) for p in range(self.passes))

    def graph_kwargs(self) -> dict[str, Any]:
        if self.order is None:
            return {}
        return {"_order": self.order, "_num_layers_per_chunk": self.layers_per_chunk}

    def batch(self, gen: torch.Generator, device: torch.device, recv: bool = False) -> Batch:
        """A step's data; ``recv`` (pipeline): chunk inputs received at their forward (Batch)."""

        def rnd(rg: bool) -> Tensor:
            return torch.randn(self.input_shape, generator=gen, device=device, dtype=self.dtype).requires_grad_(rg)

        if self.order is None:
            return Batch([], gen=gen) if recv else Batch([rnd(False)])
        n = self.chunks * self.microbatches
        if recv:
            return Batch([], [rnd(False) for _ in range(n)], gen=gen)
        return Batch([rnd(True) for _ in range(n)], [rnd(False) for _ in range(n)])

    def static_inputs(self, calls: Sequence[Any]) -> dict[int, Tensor]:
        """Input k -> the static input of the graphed pass that reads it (first_passes), where a
        ``recv`` batch can receive it (``calls``: what make_graphed_callables returned)."""
        graphed = [c if isinstance(c, gograph.GraphedCallable) else c.forward for c in calls]
        return {k: graphed[p].static_input_surface[0] for k, p in self.first_passes().items()}

    def first_passes(self) -> dict[int, int]:
        """Input k -> the pass that reads it: the pipeline's chunk input k, its chunk's first
        layer; the default schedule's one input, layer 0."""
        if self.order is None:
            return {0: 0}
        L, M = self.layers_per_chunk, self.microbatches
        return {c * M + m: c * L * M + m * L for c in range(self.chunks) for m in range(M)}

    def step(self, calls: Sequence[Callable[..., Any]], batch: Batch) -> None:
        """Forward through every pass and backward (grads accumulate in ``.grad``)."""
        if self.order is None:
            x = batch.receive(0, self.input_shape, self.dtype, requires_grad=False)
            for call in calls:
                x = call(x)
            if batch.pool is None:
                loss_of(x).backward()
            else:
                batch.pool.loss_backward(x)
            return
        self._pipeline_step(calls, batch)

    def _pipeline_step(self, calls: Sequence[Callable[..., Any]], batch: Batch) -> None:
        """The order once: chunk c's forward of microbatch m runs its layers (pass
        ``c*L*M + m*L + l``, TransformerEngine's indexing), its backward takes a fresh grad."""
        assert self.order is not None
        L, M = self.layers_per_chunk, self.microbatches
        fwd = [0] * self.chunks
        bwd = [0] * self.chunks
        outs: dict[tuple[int, int], Tensor] = {}
        received: dict[int, Tensor] = {}
        for e in self.order:
            c = abs(e) - 1
            if e > 0:
                m = fwd[c]
                fwd[c] += 1
                x = received[c * M + m] = batch.receive(c * M + m, self.input_shape, self.dtype)
                for li in range(L):
                    x = calls[c * L * M + m * L + li](x)
                outs[(c, m)] = x
            else:
                m = bwd[c]
                bwd[c] += 1
                outs.pop((c, m)).backward(batch.grads[c * M + m])
                received.pop(c * M + m).grad = None  # sent to the previous rank (dropped here)

    def static_copies(self, calls: Sequence[Callable[..., Any]]) -> list[Callable[..., Any]]:
        """Eager calls that also make the copies any CUDA graph needs (the ``eager:copies=1``
        arm, the floor of graphed training): the first layer of each chain (chunk) reads a copy
        of its input (a graph's static input: a second tensor beside the caller's, live until
        the backward), and the last layer's incoming grad is copied before its backward (a
        graph's static grad-output buffer)."""
        first = {p for p in range(len(calls)) if p % self.layers_per_chunk == 0} if self.order else {0}
        last = {p for p in range(len(calls)) if p % self.layers_per_chunk == self.layers_per_chunk - 1}
        if self.order is None:
            last = {len(calls) - 1}

        def wrapped(p: int, call: Callable[..., Any]) -> Callable[..., Any]:
            def run(x: Tensor) -> Tensor:
                out = call(x.clone() if p in first else x)
                if p in last and out.requires_grad:
                    out.register_hook(lambda g: g.clone())
                return out

            return run

        return [wrapped(p, c) for p, c in enumerate(calls)]

    def eager_calls(self, layers: Sequence[torch.nn.Module]) -> list[Callable[..., Any]]:
        """The per-pass callables of the eager arm (the pipeline's passes reuse their layer)."""
        if self.order is None:
            return list(layers)
        L, M = self.layers_per_chunk, self.microbatches
        return [layers[(p // (L * M)) * L + p % L] for p in range(self.passes)]


def workload(name: str, small: bool = False) -> Workload:
    """The workload ``name`` (chain, blocks, pipeline, stack, stack_dropout), tiny with ``small``."""
    if name == "chain":
        w = 32 if small else 4096
        return Workload("chain", 8, (16 if small else 8192, w), torch.bfloat16, lambda: MLP(w))
    if name == "blocks":
        h, heads = (32, 4) if small else (1024, 16)
        return Workload(
            "blocks", 4 if small else 12, (2, 16, h) if small else (8, 1024, h), torch.bfloat16, lambda: Block(h, heads)
        )
    if name == "pipeline":
        h = 32 if small else 1024
        return Workload(
            "pipeline",
            8,
            (16 if small else 4096, h),
            torch.bfloat16,
            lambda: PipeLayer(h),
            order=megatron_order(4, 0, 4, 8),
            layers_per_chunk=2,
            microbatches=8,
        )
    if name == "stack":
        return Workload("stack", 32, (64, 256), torch.float32, lambda: LinearReLU(256))
    if name == "stack_dropout":
        return Workload("stack_dropout", 32, (64, 256), torch.float32, lambda: LinearReLU(256, 0.1))
    raise ValueError(f"unknown workload {name!r} (chain, blocks, pipeline, stack, stack_dropout)")


WORKLOADS = ("chain", "blocks", "pipeline", "stack", "stack_dropout")


def param_digest(layers: Sequence[torch.nn.Module]) -> str:
    """A hash of every parameter's bytes: equal digests mean bitwise-equal parameters."""
    import hashlib

    h = hashlib.sha256()
    for layer in layers:
        for p in layer.parameters():
            h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]
