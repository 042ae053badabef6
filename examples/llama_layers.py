"""Graph each decoder layer of a small HF transformers Llama and train it against eager.

A randomly initialised LlamaConfig (no download), one graphed callable per LlamaDecoderLayer,
the rotary position embeddings passed as ``sample_kwargs`` (the same tensors at every call, so no
copy), optionally ``chain_buffers=True``. Trains ``--steps`` SGD steps of ``--micro`` accumulated
micro-batches on an eager copy and on the graphed layers, and prints whether every parameter is
bitwise equal, the step times (on a GPU) and gograph's memory report.

    pip install transformers
    python examples/llama_layers.py [--cpu] [--chain] [--layers 4] [--steps 5] [--micro 2]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import gograph

try:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
except ImportError:  # an optional dependency of the example only
    LlamaConfig = None


def build(layers: int, device: torch.device) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="eager", attention_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    return [LlamaDecoderLayer(config, i).to(device) for i in range(layers)], LlamaRotaryEmbedding(config).to(device)


def train(calls, params, batches, kwargs, micro: int) -> float:
    """SGD steps over ``batches`` (each ``micro`` micro-batches); returns seconds per step."""
    opt = torch.optim.SGD(params, lr=1e-2)
    start = time.perf_counter()
    for step in batches:
        for x in step[:micro]:
            for call in calls:
                x = call(x, **kwargs)
            x.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if params[0].is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(batches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the eager engine even with a GPU")
    ap.add_argument("--chain", action="store_true", help="chain_buffers=True")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    if LlamaConfig is None:
        print("examples/llama_layers.py needs HF transformers: pip install transformers", file=sys.stderr)
        return 2
    use_cuda = not args.cpu and torch.cuda.is_available() and gograph.cuda_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    layers, rotary = build(args.layers, device)
    ref = copy.deepcopy(layers)
    shape = (2, args.seq, 128)
    position_ids = torch.arange(args.seq, device=device)[None]
    kwargs = {"position_embeddings": rotary(torch.zeros(shape, device=device), position_ids)}
    shared = torch.randn(shape, device=device, requires_grad=True)  # read by warmup only with a chain
    samples = tuple((torch.randn(shape, device=device),) if i == 0 else
                    (shared if args.chain else torch.randn(shape, device=device, requires_grad=True),)
                    for i in range(args.layers))  # fmt: skip
    graphed = gograph.make_graphed_callables(tuple(layers), samples, sample_kwargs=(kwargs,) * args.layers,
                                             chain_buffers=args.chain)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randn(shape, generator=gen).to(device) for _ in range(args.micro)] for _ in range(args.steps)]
    t_graphed = train(graphed, [p for m in layers for p in m.parameters()], batches, kwargs, args.micro)
    t_eager = train(ref, [p for m in ref for p in m.parameters()], batches, kwargs, args.micro)
    same = all(torch.equal(p, q) for a, b in zip(layers, ref) for p, q in zip(a.parameters(), b.parameters()))
    engine = f"CUDA engine on {torch.cuda.get_device_name(device)}" if use_cuda else "the CPU eager engine"
    print(f"{args.layers} Llama decoder layers (hidden 128, seq {args.seq}), {args.steps} steps x {args.micro} "
          f"micro-batches on {engine}{', chain_buffers' if args.chain else ''}")  # fmt: skip
    print(f"  parameters bitwise equal to eager training: {same}")
    if use_cuda:
        print(f"  step time: graphed {t_graphed * 1e3:.2f} ms, eager {t_eager * 1e3:.2f} ms")
    print(gograph.memory_report(graphed))
    for g in graphed:
        g.reset()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
