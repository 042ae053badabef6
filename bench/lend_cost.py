"""The lent-grad bookkeeping of one default-schedule training step, alone (CPU, no GPU needed).

With ``zero_grad(set_to_none=True)`` every graphed backward lends its parameters' static grad
buffers to ``.grad`` and records them; the next step's first forward sweeps the records (copies
out any buffer something still holds). This times that bookkeeping for a stack of graphed layers
on the eager engine, with the same calls the backward makes, in reverse layer order.

  python bench/lend_cost.py [--layers 32] [--steps 500]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args()
    layers = tuple(torch.nn.Linear(16, 16) for _ in range(args.layers))
    samples = tuple((torch.randn(4, 16, requires_grad=True),) for _ in layers)
    calls = gograph.make_graphed_callables(layers, samples, num_warmup_iters=1)
    passes = [c.forward for c in calls]
    lent = passes[0].shared.lent
    assert lent is not None

    def step() -> None:
        for f in reversed(passes):  # the backwards, last layer first
            if lent.entries:
                lent.sweep(f._bwd_seq)
            lent.lend(f._bwd_seq, f.pass_id, [(s, s.static) for s in f._param_grad_slots])
        lent.sweep(passes[0]._fwd_seq)  # the next step's first forward

    for _ in range(50):
        step()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    per = (time.perf_counter() - t) / args.steps
    print(f"{args.layers} layers x {len(passes[0]._param_grad_slots)} parameters: {per * 1e6:.1f} us per step")
    for f in passes:
        f.reset()


if __name__ == "__main__":
    main()
