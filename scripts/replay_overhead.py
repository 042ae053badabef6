"""Per-call cost of the replay-time argument checks (shape, dtype, device per static input).

Times ``GraphedCallable._replay_forward`` -- the loop that copies user args into the static
inputs -- with the engine's replay stubbed out, so only the Python argument handling is measured:

* ``checked``: the product's loop (shape/dtype/device compare, then the data_ptr compare);
* ``baseline``: the loop before the checks existed (isinstance + data_ptr compare only).

and, for context, a whole graphed call (autograd node, replay, output unflatten) on the engine.
Runs on CPU (eager engine) everywhere, and on the CUDA engine when a GPU and the cuda flavor of
the core are present. Usage: ``PYTHONPATH=python python scripts/replay_overhead.py [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from typing import Any

import torch
from torch import Tensor

import gograph
from gograph.engines import FORWARD


def _baseline_replay_forward(self: gograph.GraphedCallable, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The argument loop as it was before the replay-time checks (kept here to compare)."""
    surface = self.static_input_surface
    for i in range(self.len_user_args):
        static, new = surface[i], inputs[i]
        if not isinstance(new, Tensor):
            raise TypeError("not a tensor")
        if static.data_ptr() != new.data_ptr():
            static.copy_(new)
    self.engine.replay(self.pass_id, FORWARD)
    return tuple(o.detach() for o in self.static_outputs)


class _NoReplay:
    """Engine stand-in whose replay does nothing: isolates the argument handling."""

    def replay(self, pass_id: int, kind: int) -> None:
        return None


def _best_ns(fn: Any, number: int, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def measure(device: str, n_args: int, number: int) -> dict[str, float]:
    dev = torch.device(device)
    shape = (16, 64)
    fn = {1: lambda a: a * 2, 2: lambda a, b: a * b, 4: lambda a, b, c, d: a * b + c * d}[n_args]
    samples = tuple(torch.randn(shape, device=dev) for _ in range(n_args))
    graphed = gograph.make_graphed_callables(fn, samples)
    args = tuple(torch.randn(shape, device=dev) for _ in range(n_args))
    # Args that already *are* the static inputs: no copy kernel, so the loop itself dominates.
    static_args = tuple(graphed.static_input_surface[:n_args])
    # Other tensor objects over the static inputs' memory: every check runs, no copy kernel.
    view_args = tuple(s.view(s.shape) for s in static_args)
    real_engine = graphed.engine
    graphed.engine = _NoReplay()  # type: ignore[assignment]
    try:
        res = {
            "checked_new_args_ns": _best_ns(lambda: graphed._replay_forward(args), number),
            "baseline_new_args_ns": _best_ns(lambda: _baseline_replay_forward(graphed, args), number),
            "checked_static_args_ns": _best_ns(lambda: graphed._replay_forward(static_args), number),
            "baseline_static_args_ns": _best_ns(lambda: _baseline_replay_forward(graphed, static_args), number),
            "checked_view_args_ns": _best_ns(lambda: graphed._replay_forward(view_args), number),
            "baseline_view_args_ns": _best_ns(lambda: _baseline_replay_forward(graphed, view_args), number),
        }
    finally:
        graphed.engine = real_engine
    with torch.no_grad():
        res["whole_call_ns"] = _best_ns(lambda: graphed(*args), max(number // 10, 100))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    graphed.reset()
    # The checks' cost: measured where they all run and no copy kernel adds noise.
    res["added_per_call_ns"] = res["checked_view_args_ns"] - res["baseline_view_args_ns"]
    res["added_per_arg_ns"] = res["added_per_call_ns"] / n_args
    res["added_fraction_of_call"] = res["added_per_call_ns"] / res["whole_call_ns"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--number", type=int, default=100_000)
    opts = ap.parse_args()
    devices = ["cpu"]
    if torch.cuda.is_available() and gograph.cuda_available():
        devices.append("cuda")
    results: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if "cuda" in devices:
        # The CUDA engine's replay asks torch whether the current stream is capturing (to refuse a
        # replay inside torch.cuda.graph): one C call per replayed graph.
        is_capturing = torch._C._cuda_isCurrentStreamCapturing
        results["cuda/capture_status_check_ns"] = _best_ns(is_capturing, opts.number)
        print(
            f"cuda  capture-status check (torch._C._cuda_isCurrentStreamCapturing): "
            f"{results['cuda/capture_status_check_ns']:.0f} ns per replay"
        )
    for device in devices:
        for n in (1, 2, 4):
            r = measure(device, n, opts.number)
            results[f"{device}/{n}args"] = r
            print(
                f"{device:5s} {n} arg(s): checks add {r['added_per_call_ns']:6.0f} ns/call "
                f"({r['added_per_arg_ns']:4.0f} ns/arg: loop {r['checked_view_args_ns']:5.0f} vs "
                f"{r['baseline_view_args_ns']:5.0f} ns before); static args {r['checked_static_args_ns']:5.0f} "
                f"vs {r['baseline_static_args_ns']:5.0f} ns; new args (with copy) "
                f"{r['checked_new_args_ns']:5.0f} vs {r['baseline_new_args_ns']:5.0f} ns; whole call "
                f"{r['whole_call_ns'] / 1000:6.2f} us -> checks are {100 * r['added_fraction_of_call']:4.1f}%"
            )
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
