"""One sample tensor for every layer: is graphed training still eager training?

torch.cuda.make_graphed_callables makes each sample its graph's static input, so layers graphed
with one sample tensor (``((x,),) * n``, a common way to write the samples) read one buffer: each
forward's copy-in overwrites the input that the earlier layers' backwards read, and the weight
grads come out wrong without an error. gograph's planner gives the layers whose forward is still
live a buffer of their own. This script trains the same stack eagerly, with torch's graphs and
with gograph's, and prints each arm's first-step weight grads against eager's (relative error,
layer by layer) and how far its parameters end from eager's (0 = bitwise).

Then the same for a no-grad input: attention layers that all take their mask through one shared
sample (as masks and rotary embeddings are shared, one static buffer in torch and gograph alike),
called with alternating masks (full causal and a sliding window, as Mistral- and Gemma-style
stacks alternate them). torch's graphs compute the earlier layers' backwards from the later
layers' mask; gograph refuses the second layer's call (SharedInputError).

  python bench/shared_samples.py [--layers 4] [--dim 1024] [--rows 2048] [--steps 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph

log = logging.getLogger("bench.shared_samples")


def _stack(n: int, dim: int, device: torch.device) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU()).to(device) for _ in range(n)]


def _train(
    calls: Sequence[Callable[..., Any]], mods: Sequence[torch.nn.Module], args: argparse.Namespace
) -> list[torch.Tensor]:
    """``args.steps`` SGD steps; returns the first step's weight grads, layer by layer."""
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    first: list[torch.Tensor] = []
    for _ in range(args.steps):
        x = torch.randn(args.rows, args.dim, device="cuda", generator=gen).requires_grad_()
        for c in calls:
            x = c(x)
        (x.float().square().sum() / args.rows).backward()
        if not first:
            first = [m[0].weight.grad.detach().clone() for m in mods]
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return first


def _param_distance(a: Sequence[torch.nn.Module], b: Sequence[torch.nn.Module]) -> float:
    with torch.no_grad():
        return max(float((p - q).abs().max()) for m, r in zip(a, b) for p, q in zip(m.parameters(), r.parameters()))


def _grad_error(grads: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> list[float]:
    """Per layer, max |grad - eager grad| / max |eager grad|."""
    return [float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, ref)]


class _Attention(torch.nn.Module):
    """Self-attention with an additive mask (math SDPA: deterministic), heads of 64."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, dim = x.shape
        q, k, v = self.qkv(x).view(1, rows, 3, dim // 64, 64).permute(2, 0, 3, 1, 4)
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + a.transpose(1, 2).reshape(rows, dim)


def _window(rows: int, width: int) -> torch.Tensor:
    i = torch.arange(rows, device="cuda")
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < width)
    return torch.zeros(rows, rows, device="cuda").masked_fill(~keep, float("-inf"))


def _alternating(make: Callable[..., Any], args: argparse.Namespace) -> dict[str, Any]:
    """One step of attention layers with alternating masks through one mask sample: the first
    layer's weight-grad error against eager, or the error the maker raised."""
    torch.manual_seed(0)
    rows = min(args.rows, 1024)
    eager = [_Attention(args.dim).cuda() for _ in range(args.layers)]
    mods = [copy.deepcopy(m) for m in eager]
    masks = [_window(rows, rows), _window(rows, 128)]
    x = torch.randn(rows, args.dim, device="cuda", requires_grad=True)
    sample = _window(rows, rows)  # one mask sample for every layer, not a tensor the step passes
    graphed = make(tuple(mods), tuple((x, sample) for _ in mods))
    grads = []
    for calls, layers in ((eager, eager), (graphed, mods)):
        h = torch.randn(rows, args.dim, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        h.requires_grad_()
        try:
            for i, c in enumerate(calls):
                h = c(h, masks[i % 2])
        except gograph.SharedInputError as e:
            return {"raised": type(e).__name__, "message": str(e)}
        h.square().mean().backward()
        grads.append([m.qkv.weight.grad for m in layers])
    return {"first_step_grad_rel_error": _grad_error(grads[1], grads[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = torch.device("cuda")
    eager = _stack(args.layers, args.dim, dev)
    arms: dict[str, Any] = {"torch": torch.cuda.make_graphed_callables, "gograph": gograph.make_graphed_callables}
    base = [copy.deepcopy(m) for m in eager]
    ref = _train(eager, eager, args)
    result = {}
    for name, make in arms.items():
        mods = [copy.deepcopy(m) for m in base]
        x = torch.randn(args.rows, args.dim, device=dev, requires_grad=True)
        graphed = make(tuple(mods), ((x,),) * args.layers)
        errors = _grad_error(_train(graphed, mods, args), ref)
        result[name] = {"param_max_abs_diff": _param_distance(mods, eager), "first_step_grad_rel_error": errors}
        log.info("%-8s first step's weight grads vs eager, relative error per layer: %s", name,
                 " ".join(f"{e:.3g}" for e in errors))  # fmt: skip
        dist = result[name]["param_max_abs_diff"]
        log.info("%-8s max |param - eager param| after %d steps: %.3g%s", name, args.steps, dist,
                 " (bitwise)" if dist == 0 else "")  # fmt: skip
    for name, make in arms.items():
        alt = result[name]["alternating_masks"] = _alternating(make, args)
        if "raised" in alt:
            log.info("%-8s alternating masks through one sample: %s: %s", name, alt["raised"], alt["message"][:160])
        else:
            log.info("%-8s alternating masks through one sample, weight-grad relative error per layer: %s", name,
                     " ".join(f"{e:.3g}" for e in alt["first_step_grad_rel_error"]))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
