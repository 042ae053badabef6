"""Training-step time of graphed arms against each other, side by side in one process.

For one workload (bench/workloads.py) and one ``zero_grad(set_to_none=...)`` mode, every arm
(eager, torch's ``make_graphed_callables``, gograph, gograph with extra arguments) gets its own
copy of the model (same init) and SGD; the arms then run in alternating rounds of ``--steps``
training steps each (their order rotated every round), so host noise hits them alike. Reported:
per arm the best and median round (ms per step), and per arm the median of its per-round ratio to
the reference arm (``--ref``, default torch).

  python bench/steptime.py --workload stack --mode none            # launch-bound stack
  python bench/steptime.py --workload chain --arms torch,gograph,gograph:chain_buffers=true
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
from footprint import MODES, graph, parse_arm
from workloads import workload


class Arm:
    """One arm: its model copy, optimizer and per-pass callables."""

    def __init__(self, spec: str, wl: Any, device: torch.device) -> None:
        self.spec = spec
        maker, kwargs = parse_arm(spec)
        self.layers = wl.build(device)
        self.opt = torch.optim.SGD([p for m in self.layers for p in m.parameters()], lr=1e-3)
        self.calls = (
            wl.eager_calls(self.layers) if maker == "eager" else graph(maker, kwargs, wl, self.layers, device)[0]
        )
        self.rounds: list[float] = []

    def run(self, wl: Any, batches: list[Any], set_to_none: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in batches:
            wl.step(self.calls, b)
            self.opt.step()
            self.opt.zero_grad(set_to_none=set_to_none)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / len(batches)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="stack")
    ap.add_argument("--arms", default="eager,torch,gograph")
    ap.add_argument("--ref", default="torch")
    ap.add_argument("--mode", default="none", choices=sorted(MODES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    wl = workload(args.workload)
    arms = [Arm(s, wl, device) for s in args.arms.split(",")]
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [wl.batch(gen, device) for _ in range(args.steps)]
    for arm in arms:  # warm: allocator caches, cuBLAS, first-replay uploads
        arm.run(wl, batches[:3], MODES[args.mode])
    for r in range(args.rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            arm.rounds.append(arm.run(wl, batches, MODES[args.mode]))
    ref = next((a for a in arms if a.spec == args.ref), arms[0])
    result: dict[str, Any] = {
        "workload": args.workload,
        "mode": args.mode,
        "rounds": args.rounds,
        "steps": args.steps,
        "ref": ref.spec,
        "arms": {},
    }
    print(f"{args.workload} zero_grad(set_to_none={MODES[args.mode]}), {args.rounds} rounds x {args.steps} steps")
    for arm in arms:
        ratios = [a / b for a, b in zip(arm.rounds, ref.rounds)]
        row = {
            "best_ms": min(arm.rounds) * 1e3,
            "median_ms": statistics.median(arm.rounds) * 1e3,
            "median_ratio_to_ref": statistics.median(ratios),
            "best_ratio_to_ref": min(arm.rounds) / min(ref.rounds),
        }
        result["arms"][arm.spec] = row
        print(
            f"  {arm.spec:32s} best {row['best_ms']:8.3f} ms  median {row['median_ms']:8.3f} ms  "
            f"x{ref.spec}: median per-round {row['median_ratio_to_ref']:.3f}, best {row['best_ratio_to_ref']:.3f}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
