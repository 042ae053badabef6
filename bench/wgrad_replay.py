"""What ``backward_dw()`` costs on the host, per state of ``.grad``: the calls and the kernels gograph
launches besides the weight-gradient graph, on any machine (no GPU needed).

The eager engine runs the same Python as the CUDA engine around a replay; here its replay is reduced
to the core's lifecycle call (``_core.raw_replay``, as ``bench/host_path.py`` does), so what is
timed and counted is everything but the graph. ``--layers`` graphed modules whose delayed weight
gradient assigns ``weight.grad`` when it is None and adds into it otherwise (the common hand-written
pattern), ``backward_dw()`` called on each, the slot in one state per arm:

* ``kept``: ``.grad`` is the tensor the graph adds into (``zero_grad(set_to_none=False)``): the
  replay alone, the path that must cost what it cost before;
* ``none``: ``.grad`` set to None before each call (``zero_grad()``'s default): the target is zeroed
  and lent back;
* ``other``: ``.grad`` a tensor assigned after graphing: the gradient alone added into it;
* ``held``: ``.grad`` set to None while the old one is still referenced: the target saved and
  restored around the replay, a copy handed out.

Reported per arm: the median µs per ``backward_dw()`` over alternating rounds (the slot's reset
before each call included, a Python attribute write), its median per-round ratio to ``kept``, and
the aten operators dispatched per call (the kernels gograph itself launches; the replay launches the
graph besides). A core built before the grad-slot policy runs ``kept`` only (the others raise there).

  python bench/wgrad_replay.py [--layers 32] [--width 64] [--rounds 15] [--calls 200] [--arms kept,none,other,held]
                               [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph
from gograph.core import _core
from gograph.engines import EagerEngine


class LifecycleOnlyEngine(EagerEngine):
    """The eager engine with its replay reduced to the core's lifecycle call (the graph taken out)."""

    def replay(self, pass_id: int, kind: int) -> None:
        _core.raw_replay(pass_id, kind, 0)


class _Matmul(torch.autograd.Function):
    """``x @ w.T`` whose backward leaves ``(x, dy)`` for ``backward_dw()``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, owner: Any) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.owner = owner
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, w = ctx.saved_tensors
        ctx.owner.stash = (x, dy)
        return dy @ w, None, None


class AddOrAssign(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width**0.5)
        self.stash: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Matmul.apply(x, self.weight, self)

    def need_backward_dw(self) -> bool:
        return True

    def backward_dw(self) -> None:
        assert self.stash is not None
        x, dy = self.stash
        with torch.no_grad():
            dw = dy.t() @ x
            if self.weight.grad is None:
                self.weight.grad = dw
            else:
                self.weight.grad.add_(dw)


def _graphed(n: int, width: int) -> tuple[list[Any], list[AddOrAssign]]:
    torch.manual_seed(0)
    mods = [AddOrAssign(width) for _ in range(n)]
    samples = tuple((torch.randn(4, width, requires_grad=True),) for _ in mods)
    x = torch.randn(4, width, requires_grad=True)
    calls = gograph.make_graphed_callables(tuple(mods), samples, engine=LifecycleOnlyEngine(), num_warmup_iters=1)
    for c in calls:  # the graph's target becomes .grad, kept from then on
        c(x).sum().backward()
        c.backward_dw()
    return list(calls), mods


def _resets(arm: str, mods: list[AddOrAssign]) -> Callable[[int], None]:
    """What happens to ``mods[i].weight.grad`` before each call of the arm."""
    if arm == "kept":
        return lambda i: None
    if arm == "none":

        def drop(i: int) -> None:
            mods[i].weight.grad = None

        return drop
    if arm == "other":
        others = [torch.zeros_like(m.weight) for m in mods]

        def assign(i: int) -> None:
            mods[i].weight.grad = others[i]

        return assign
    held: list[torch.Tensor | None] = [None] * len(mods)

    def drop_held(i: int) -> None:
        held[i] = mods[i].weight.grad  # the old .grad stays referenced
        mods[i].weight.grad = None

    return drop_held


def time_round(calls: list[Any], reset: Callable[[int], None], n: int) -> float:
    """µs per ``backward_dw()`` (with the slot's reset)."""
    t0 = time.perf_counter()
    for _ in range(n):
        for i, c in enumerate(calls):
            reset(i)
            c.backward_dw()
    return (time.perf_counter() - t0) / n / len(calls) * 1e6


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_per_call(calls: list[Any], reset: Callable[[int], None]) -> float | None:
    """Aten operators dispatched by ``backward_dw()`` per call (None: the state is refused)."""
    counts = []
    for i, c in enumerate(calls):
        reset(i)
        with _Count() as mode:
            try:
                c.backward_dw()
            except RuntimeError:
                return None
        counts.append(mode.ops)
    return sum(counts) / len(counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--arms", default="kept,none,other,held", help="comma-separated (compare trees arm by arm)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    arms: dict[str, tuple[list[Any], Callable[[int], None]]] = {}
    ops: dict[str, float | None] = {}
    for arm in args.arms.split(","):
        calls, mods = _graphed(args.layers, args.width)
        reset = _resets(arm, mods)
        ops[arm] = ops_per_call(calls, reset)
        if ops[arm] is not None:
            arms[arm] = (calls, reset)
    names = list(arms)
    per: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            per[n].append(time_round(*arms[n], args.calls))
    kept = per.get("kept")
    rows = [
        {
            "arm": n,
            "us_per_call": statistics.median(per[n]) if n in per else None,
            "x_kept": statistics.median(a / b for a, b in zip(per[n], kept)) if n in per and kept else None,
            "ops_per_call": ops[n],
        }
        for n in ops
    ]
    print(f"{args.layers} layers, weight {args.width}x{args.width}, {args.rounds} rounds x {args.calls} calls")
    print("| .grad when backward_dw() runs | us per call | x kept | aten ops per call |\n|---|---|---|---|")
    for row in rows:
        if row["us_per_call"] is None:
            print(f"| {row['arm']} | refused | - | - |")
        else:
            x = "-" if row["x_kept"] is None else f"{row['x_kept']:.2f}"
            print(f"| {row['arm']} | {row['us_per_call']:.2f} | {x} | {row['ops_per_call']:.0f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
