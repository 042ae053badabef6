"""Cost of the replay-order guard (``debug_replay_order=True`` / ``GOGRAPH_DEBUG=1``).

Runs on the CPU (eager engine), so it measures exactly what the guard adds on the host: the Go
check inside ``core.replay`` and, for forwards, the Python ``requires_grad`` scan that closes a
forward without backward. (On CUDA the same host cost is added to the enqueue time of a replay.)

    PYTHONPATH=python .venv/bin/python bench/replay_order_guard.py

1. ``core.replay(pass, kind, 0)`` alone (one gopy call; eager passes launch nothing), for a
   training iteration of ``--layers`` passes (fwd 1..n, bwd n..1), guard off vs on;
2. a full training iteration through the graphed modules (autograd, static copies, eager
   re-runs of tiny layers), guard off vs on.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph
from gograph.core import _native


def build(layers: int, guard: bool) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    mods = [torch.nn.Linear(8, 8) for _ in range(layers)]
    args = tuple((torch.randn(2, 8, requires_grad=True),) for _ in range(layers))
    gograph.make_graphed_callables(tuple(mods), args, num_warmup_iters=1, engine="eager", debug_replay_order=guard)
    return mods


def core_iteration(ids: list[int]):
    replay = _native.core.replay

    def run() -> None:
        for p in ids:
            replay(p, 0, 0)
        for p in reversed(ids):
            replay(p, 1, 0)

    return run


def model_iteration(mods: list[torch.nn.Module]):
    x = torch.randn(2, 8, requires_grad=True)

    def run() -> None:
        h = x
        for m in mods:
            h = m(h)
        h.sum().backward()

    return run


def interleaved_best(fns: list, number: int, repeat: int) -> list[float]:
    """Best-of-``repeat`` seconds per call of each fn, the rounds of the fns interleaved so that
    load on a shared machine hits them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timeit.timeit(fn, number=number) / number)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    off, on = build(a.layers, False), build(a.layers, True)
    ids_off = [m.forward.pass_id for m in off]
    ids_on = [m.forward.pass_id for m in on]
    c0, c1 = interleaved_best([core_iteration(ids_off), core_iteration(ids_on)], a.number, a.repeat)
    m0, m1 = interleaved_best([model_iteration(off), model_iteration(on)], max(1, a.number // 10), a.repeat)
    for m in off + on:
        m.reset()
    n = 2 * a.layers
    print(
        f"replay-order guard cost, {a.layers} layers ({n} replays per training iteration), eager engine, "
        f"core flavor {_native.flavor}, best of {a.repeat} interleaved rounds"
    )
    print(
        f"  core.replay alone : off {c0 / n * 1e6:7.3f} us/replay   on {c1 / n * 1e6:7.3f} us/replay   "
        f"(+{(c1 - c0) / n * 1e6:.3f} us)"
    )
    print(
        f"  training iteration: off {m0 * 1e6:7.1f} us/iter     on {m1 * 1e6:7.1f} us/iter     "
        f"(+{(m1 - m0) / n * 1e6:.3f} us/replay, {100 * (m1 - m0) / m0:+.1f}%)"
    )


if __name__ == "__main__":
    main()
