"""The host cost of a graphed call, with the graph launch taken out: gograph against a wrapper of
torch's shape and a bare autograd node, on any machine (no GPU needed).

A graphed forward and backward on a launch-bound model is host work: argument handling, the
autograd node, copies into static inputs, the replay call, grad hand-out. On the CPU the eager
engine runs the same Python as the CUDA engine; here its replay is reduced to the core's lifecycle
call (``_core.replay``), so what is timed is everything but the graph. Arms, each over the same
``--layers`` graphed ``Linear(width) + ReLU`` callables (tiny tensors: copies cost ~nothing):

* ``bare``: one ``torch.autograd.Function`` per layer over its input and parameters that returns
  preallocated outputs and grads (no pytree, no copies): the floor of any per-layer graphed node;
* ``bare-module``: the same node as each module's forward, called through ``Module.__call__``
  as a graphed module is: the floor of a graphed module;
* ``torch-shaped``: the shape of ``torch.cuda.make_graphed_callables``'s wrapper (pytree flatten,
  an ``autograd.Function`` over input and parameters, a copy into the static input, the replay
  call, detached outputs; grads copied into static grad outputs, replay, detached grads returned);
* ``gograph``: ``gograph.make_graphed_callables`` as a user calls it;
* ``gograph-chain``: the same with ``chain_buffers=True``.

One step is a forward through every layer, ``sum()`` and a backward; the arms run in alternating
rounds (order rotated) in one process. Reported: the median µs per layer and step (forward +
backward) of each arm and its median per-round ratio to ``bare``.

  python bench/host_path.py [--layers 32] [--width 16] [--rows 4] [--rounds 15] [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph
from gograph.core import _core
from gograph.engines import EagerEngine


class LifecycleOnlyEngine(EagerEngine):
    """The eager engine with its replay reduced to the core's lifecycle call, through the entry
    point the CUDA engine's replay uses (``_core.raw_replay``, with no stream): what a graphed
    call costs on the host besides the graph and its launch."""

    def replay(self, pass_id: int, kind: int) -> None:
        _core.raw_replay(pass_id, kind, 0)


def _layers(n: int, width: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(n)]


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, static: Any, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.static = static
        return static.out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (None, *[g.detach() for g in ctx.static.grads])


class _Static:
    """One layer's preallocated buffers: the graph's static input, output and grads."""

    def __init__(self, layer: torch.nn.Module, rows: int, width: int) -> None:
        self.params = tuple(layer.parameters())
        self.inp = torch.zeros(rows, width)
        self.out = torch.zeros(rows, width)
        self.grad_out = torch.zeros(rows, width)
        self.grads = (torch.zeros(rows, width), *[torch.zeros_like(p) for p in self.params])

    def replay(self) -> None:  # the graph launch, taken out
        return None


def bare_calls(layers: list[torch.nn.Module], rows: int, width: int) -> list[Callable[..., Any]]:
    statics = [_Static(m, rows, width) for m in layers]
    return [lambda x, s=s: _Bare.apply(s, x, *s.params) for s in statics]


def bare_module_calls(layers: list[torch.nn.Module], rows: int, width: int) -> list[Callable[..., Any]]:
    """The bare node as each module's forward: a graphed module is called through
    ``Module.__call__`` (torch's and gograph's replace the forward), which this arm pays too."""
    for m in layers:
        s = _Static(m, rows, width)
        m.forward = lambda x, s=s: _Bare.apply(s, x, *s.params)  # type: ignore[method-assign]
    return list(layers)


class _TorchShaped(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, static: Any, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.static = static
        if static.inp.data_ptr() != inputs[0].data_ptr():
            static.inp.copy_(inputs[0])
        static.replay()
        return static.out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        s = ctx.static
        if s.grad_out.data_ptr() != grad.data_ptr():
            s.grad_out.copy_(grad)
        s.replay()
        return (None, *[g.detach() for g in s.grads])


def torch_shaped_calls(layers: list[torch.nn.Module], rows: int, width: int) -> list[Callable[..., Any]]:
    """As torch's wrapper: the module's forward replaced, so a call goes through Module.__call__."""

    def forward(s: _Static, spec: pytree.TreeSpec, *args: Any) -> Any:
        flat = pytree.arg_tree_leaves(*args)
        out = _TorchShaped.apply(s, *flat, *s.params)
        return pytree.tree_unflatten((out,), spec)

    out_spec = pytree.tree_structure(torch.zeros(1))  # a single-tensor output
    for m in layers:
        m.forward = functools.partial(forward, _Static(m, rows, width), out_spec)  # type: ignore[method-assign]
    return list(layers)


def gograph_calls(layers: list[torch.nn.Module], rows: int, width: int, **kw: Any) -> list[Callable[..., Any]]:
    samples = tuple((torch.randn(rows, width, requires_grad=True),) for _ in layers)
    return list(
        gograph.make_graphed_callables(tuple(layers), samples, engine=LifecycleOnlyEngine(), num_warmup_iters=1, **kw)
    )


def step(calls: list[Callable[..., Any]], x: torch.Tensor) -> None:
    for c in calls:
        x = c(x)
    x.sum().backward()


def time_round(calls: list[Callable[..., Any]], x: torch.Tensor, steps: int, layers: list[torch.nn.Module]) -> float:
    """µs per layer and step; grads dropped after each step (``zero_grad(set_to_none=True)``
    over a list made once, so the drop costs every arm alike and little)."""
    params = [p for m in layers for p in m.parameters()]
    t0 = time.perf_counter()
    for _ in range(steps):
        step(calls, x)
        for p in params:
            p.grad = None
    return (time.perf_counter() - t0) / steps / len(calls) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    makers: dict[str, Callable[..., list[Callable[..., Any]]]] = {
        "bare": bare_calls,
        "bare-module": bare_module_calls,
        "torch-shaped": torch_shaped_calls,
        "gograph": gograph_calls,
        "gograph-chain": lambda ls, r, w: gograph_calls(ls, r, w, chain_buffers=True),
    }
    arms = {}
    for name, make in makers.items():
        layers = _layers(args.layers, args.width)
        arms[name] = (make(layers, args.rows, args.width), layers)
    x = torch.randn(args.rows, args.width, requires_grad=True)
    names = list(arms)
    for name in names:  # warm every path once
        time_round(*arms[name][:1], x, 5, arms[name][1])
    per: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        got = {n: time_round(arms[n][0], x, args.steps, arms[n][1]) for n in order}
        for n in names:
            per[n].append(got[n])
            ratios[n].append(got[n] / got["bare"])
    rows = [
        {"arm": n, "us_per_layer_step": statistics.median(per[n]), "x_bare": statistics.median(ratios[n])}
        for n in names
    ]
    print(
        f"{args.layers} layers, Linear({args.width}) + ReLU, {args.rows} rows, {args.rounds} rounds, {args.steps} steps"
    )
    print("| arm | us per layer and step (fwd + bwd) | x bare |\n|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {row['us_per_layer_step']:.1f} | {row['x_bare']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)  # host work only: intra-op threads would only add noise
    sys.exit(main())
