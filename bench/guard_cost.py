"""Per-replay cost of the debug-mode shared-pool checker (issue: a checker for reads of re-carved
pool memory), on the CUDA engine.

Two identical chains of ``--layers`` small layers are graphed in one process, one with
``debug_replay_order=True`` (every replay checked by the core against what each graph writes and
reads), one without; a training step (forward through the chain, backward) runs on each in
alternating rounds, and the median per-round time per replay is compared.

  python bench/guard_cost.py [--layers 8] [--rounds 7] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import gograph


def chain(layers: int, debug: bool) -> tuple[torch.nn.Module, ...]:
    torch.manual_seed(0)
    mods = tuple(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()).cuda() for _ in range(layers))
    samples = tuple((torch.randn(64, 256, device="cuda", requires_grad=i > 0),) for i in range(layers))
    return gograph.make_graphed_callables(mods, samples, debug_replay_order=debug, chain_buffers=True)


def step(mods: tuple[torch.nn.Module, ...], x: torch.Tensor) -> None:
    h = x
    for m in mods:
        h = m(h)
    h.sum().backward()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and gograph.cuda_available()):
        print("bench/guard_cost.py needs a GPU and the CUDA core", file=sys.stderr)
        return 2
    arms = {"off": chain(args.layers, False), "on": chain(args.layers, True)}
    x = torch.randn(64, 256, device="cuda")
    per: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.rounds):
        for name, mods in arms.items():
            step(mods, x)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(mods, x)
            torch.cuda.synchronize()
            per[name].append((time.perf_counter() - t0) / (args.steps * 2 * args.layers))
    off, on = statistics.median(per["off"]), statistics.median(per["on"])
    print(
        f"per replay (median of {args.rounds} rounds, {args.layers} layers, forward + backward): "
        f"checker off {off * 1e6:.2f} us, on {on * 1e6:.2f} us, +{(on - off) * 1e6:.2f} us ({on / off:.3f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
