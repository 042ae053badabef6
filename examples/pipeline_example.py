"""A Megatron-style interleaved pipeline, graphed with gograph, and its memory report.

What Megatron-LM does with TransformerEngine's ``make_graphed_callables`` on one pipeline rank,
here on one device:

* the model is split into *chunks* (virtual pipeline stages) of transformer-like layers; every
  layer is its own callable, and every (chunk, microbatch, layer) forward is its own graphed pass;
* ``_order`` is the rank's interleaved schedule: ``c`` runs chunk c's forward for its next
  microbatch, ``-c`` its backward, ``-(c+0.5)`` its delayed weight gradient (``backward_dw``);
  warmup and capture run exactly that order, and so does every training step;
* the layers' output projection delays its weight gradient (TransformerEngine's
  ``delay_wgrad_compute``: the backward computes the input grad only, ``backward_dw()`` the
  weight grad), so each pass gets a third, weight-gradient graph;
* ``_reuse_graph_input_output_buffers`` lets passes whose buffers are never live at the same
  time in the schedule share them;
* the replay-order guard is on: the schedule replays in capture order, so it never fires;
* every graphed callable is ``reset()`` before teardown, and the core is checked to hold no
  graphs afterwards.

Chunks are chained as pipeline stages are: chunk c+1 receives a copy of chunk c's output (a
pipeline "recv"), and chunk c's backward gets the grad of that copy. The result is checked
against the same model run eagerly through the same schedule.

    PYTHONPATH=python .venv/bin/python examples/pipeline_example.py            # GPU if available
    PYTHONPATH=python .venv/bin/python examples/pipeline_example.py --cpu      # eager engine
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import gograph

# A 4-chunk interleaved schedule over 2 microbatches: all forwards of microbatch 0, the first
# chunks of microbatch 1, then backwards (each followed by its chunk's weight gradient)
# interleaved with the remaining forwards -- the shape of Megatron's interleaved 1F1B.
ORDER: list[float] = [
    1,
    2,
    3,
    4,
    1,
    2,
    -4,
    -4.5,
    3,
    -3,
    -3.5,
    4,
    -2,
    -2.5,
    -4,
    -4.5,
    -1,
    -1.5,
    -3,
    -3.5,
    -2,
    -2.5,
    -1,
    -1.5,
]
CHUNKS, MICROBATCHES = 4, 2
LAYERS_PER_CHUNK = [1, 1, 1, 1]  # TransformerEngine: weight-gradient entries need one layer per chunk


# ---------------------------------------------------------------------------------------------
# The model: layers whose output projection delays its weight gradient
# ---------------------------------------------------------------------------------------------
class _DgradOnly(torch.autograd.Function):
    """y = x @ w.T whose backward computes only dx and leaves (x, dy) for backward_dw()."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, owner: DelayedWgradLinear) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.owner = owner
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, weight = ctx.saved_tensors
        ctx.owner.stash.append((x, dy))
        return dy @ weight, None, None


class DelayedWgradLinear(torch.nn.Module):
    """A linear layer with TransformerEngine's delayed weight-gradient protocol
    (``need_backward_dw()`` / ``backward_dw()``): its weight grad is accumulated into
    ``weight.grad`` by ``backward_dw()``, like TransformerEngine's ``main_grad``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(d_out))
        self.stash: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DgradOnly.apply(x, self.weight, self) + self.bias

    def need_backward_dw(self) -> bool:
        return True

    def backward_dw(self) -> None:
        x, dy = self.stash.pop(0)
        with torch.no_grad():
            self.weight.grad.add_(dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class Layer(torch.nn.Module):
    """A pre-norm MLP block (the MLP half of a transformer layer)."""

    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, ffn)
        self.fc2 = DelayedWgradLinear(ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


# ---------------------------------------------------------------------------------------------
# One training step through the schedule (what Megatron's pipeline schedule does per rank)
# ---------------------------------------------------------------------------------------------
def pass_index(chunk: int, micro: int, layer: int) -> int:
    """TransformerEngine's indexing of forward passes (and of sample_args / returned callables)."""
    prefix = sum(LAYERS_PER_CHUNK[:chunk])
    return prefix * MICROBATCHES + micro * LAYERS_PER_CHUNK[chunk] + layer


def run_schedule(
    call: Callable[[int, torch.Tensor], torch.Tensor],
    wgrad: Callable[[int], None],
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
) -> list[float]:
    """One step: runs ORDER; returns the loss of each microbatch.

    Activations and grads cross chunk boundaries as they cross pipeline stages: copied out when
    they are produced (the "send"), since a graphed callable's outputs and input grads are
    static buffers that later replays -- and, with buffer reuse, later passes -- overwrite."""
    fwd, bwd = [0] * CHUNKS, [0] * CHUNKS
    outs: dict[tuple[int, int], torch.Tensor] = {}  # chunk outputs, for their backward
    act_sent: dict[tuple[int, int], torch.Tensor] = {}  # activations sent to the next chunk
    recv: dict[tuple[int, int], torch.Tensor] = {}  # ... as received by it (leaves)
    grad_sent: dict[tuple[int, int], torch.Tensor] = {}  # grads sent back to the previous chunk
    losses: dict[int, torch.Tensor] = {}
    for e in ORDER:
        if e > 0:  # forward of chunk c, its next microbatch
            c = int(e) - 1
            m = fwd[c]
            fwd[c] += 1
            x = inputs[m] if c == 0 else recv.setdefault((c, m), act_sent.pop((c - 1, m)).requires_grad_())
            for layer in range(LAYERS_PER_CHUNK[c]):
                x = call(pass_index(c, m, layer), x)
            if c == CHUNKS - 1:
                losses[m] = F.mse_loss(x, targets[m])
            else:
                outs[(c, m)] = x
                act_sent[(c, m)] = x.detach().clone()
        elif float(e).is_integer():  # backward of chunk c
            c = -int(e) - 1
            m = bwd[c]
            bwd[c] += 1
            if c == CHUNKS - 1:
                losses[m].backward()
            else:
                outs.pop((c, m)).backward(grad_sent.pop((c, m)))
            if c > 0:
                grad_sent[(c - 1, m)] = recv.pop((c, m)).grad.clone()
        else:  # weight gradient of chunk c's latest backward
            c = int(-e - 0.5) - 1
            for layer in range(LAYERS_PER_CHUNK[c]):
                wgrad(pass_index(c, bwd[c] - 1, layer))
    return [float(losses[m].detach()) for m in range(MICROBATCHES)]


def zero_grads(params: Sequence[torch.nn.Parameter]) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # backward_dw accumulates into .grad
        else:
            p.grad.zero_()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="use the eager engine on the CPU even with a GPU")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=None, help="model width (default 1024 on GPU, 64 on CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per microbatch (default 2048 / 32)")
    ap.add_argument("--no-reuse", action="store_true", help="without _reuse_graph_input_output_buffers")
    ap.add_argument("--progress", action="store_true", help="progress bar while capturing (needs tqdm)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log each capture (INFO on 'gograph')")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(message)s")

    use_cuda = not a.cpu and torch.cuda.is_available() and gograph.cuda_available()
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    d = a.hidden or (1024 if use_cuda else 64)
    tokens = a.tokens or (2048 if use_cuda else 32)
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # graphed and eager results compared closely
        torch.backends.cudnn.allow_tf32 = False
    print(
        f"gograph {gograph.__version__}: {CHUNKS} chunks x {LAYERS_PER_CHUNK[0]} layer, {MICROBATCHES} "
        f"microbatches, hidden {d}, {tokens} tokens/microbatch, on "
        f"{'CUDA (' + torch.cuda.get_device_name(device) + ')' if use_cuda else 'the CPU eager engine'}"
        + ("" if use_cuda or a.cpu else f" [no GPU: {gograph.cuda_unavailable_reason()}]")
    )

    torch.manual_seed(0)
    layers = [Layer(d, 4 * d).to(device) for _ in range(sum(LAYERS_PER_CHUNK))]
    reference = copy.deepcopy(layers)  # the same model, run eagerly through the same schedule
    params = [p for m in layers for p in m.parameters()]
    ref_params = [p for m in reference for p in m.parameters()]
    zero_grads(params)  # backward_dw needs .grad to exist (Megatron: main_grad)

    # One sample arg tuple per forward pass, in TransformerEngine's pass order. The first chunk's
    # input is data (no grad); every other pass receives activations.
    sample_args = []
    for c in range(CHUNKS):
        for _m in range(MICROBATCHES):
            for layer in range(LAYERS_PER_CHUNK[c]):
                first = c == 0 and layer == 0
                sample_args.append((torch.randn(tokens, d, device=device, requires_grad=not first),))
    base_graphs = gograph.live_graphs()

    graphed = gograph.make_graphed_callables(
        tuple(layers),
        tuple(sample_args),
        _order=ORDER,
        _num_layers_per_chunk=LAYERS_PER_CHUNK,
        _reuse_graph_input_output_buffers=not a.no_reuse,
        debug_replay_order=True,
        progress=a.progress,
    )
    del sample_args
    print(
        f"graphed {len(graphed)} forward passes: {len(graphed[0].build_stats.captures)} captures "
        f"(forward, backward and weight gradient per pass), {gograph.live_graphs() - base_graphs} CUDA graphs"
    )

    opt = torch.optim.SGD(params, lr=0.05)
    ref_opt = torch.optim.SGD(ref_params, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for step in range(a.steps):
        inputs = [torch.randn(tokens, d, generator=gen).to(device) for _ in range(MICROBATCHES)]
        targets = [torch.randn(tokens, d, generator=gen).to(device) for _ in range(MICROBATCHES)]
        zero_grads(params)
        zero_grads(ref_params)
        losses = run_schedule(lambda i, x: graphed[i](x), lambda i: graphed[i].backward_dw(), inputs, targets)
        ref_losses = run_schedule(
            lambda i, x: reference[_layer_of(i)](x), lambda i: _ref_wgrad(reference, i), inputs, targets
        )
        grad_diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(params, ref_params))
        opt.step()
        ref_opt.step()
        print(
            f"step {step}: losses {', '.join(f'{v:.5f}' for v in losses)} "
            f"(eager {', '.join(f'{v:.5f}' for v in ref_losses)}), max |grad - eager grad| {grad_diff:.2e}"
        )
        tol = 1e-4 if use_cuda else 1e-6
        if grad_diff > tol or any(abs(x - y) > tol for x, y in zip(losses, ref_losses)):
            raise SystemExit(f"graphed and eager results differ by more than {tol}")

    print()
    print(gograph.memory_report(graphed))

    # Teardown: reset every graphed callable (each releases exactly its graphs and pool share).
    held = torch.cuda.memory_allocated(device) if use_cuda else 0
    for g in graphed:
        g.reset()
    graphed = ()
    gc.collect()
    left = gograph.live_graphs() - base_graphs
    # What stays allocated is the model, its eager twin, their grads and the last step's data.
    print(
        f"\nafter reset(): {left} graphs left in the core"
        + (
            f", reset() returned {(held - torch.cuda.memory_allocated(device)) / 2**20:.1f} MiB of "
            f"graph memory, {torch.cuda.memory_allocated(device) / 2**20:.1f} MiB still allocated "
            "(models, grads, data)"
            if use_cuda
            else ""
        )
    )
    if left:
        raise SystemExit("graphs leaked")


def _layer_of(i: int) -> int:
    """The layer (callable) of forward pass i (TransformerEngine's indexing inverted)."""
    for c in range(CHUNKS):
        n = LAYERS_PER_CHUNK[c] * MICROBATCHES
        if i < n:
            return sum(LAYERS_PER_CHUNK[:c]) + i % LAYERS_PER_CHUNK[c]
        i -= n
    raise IndexError(i)


def _ref_wgrad(reference: Sequence[torch.nn.Module], i: int) -> None:
    for m in reference[_layer_of(i)].modules():
        if isinstance(m, DelayedWgradLinear):
            m.backward_dw()


if __name__ == "__main__":
    main()
