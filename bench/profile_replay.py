"""Where does a graphed step's CPU time go? W2-like chain of small per-layer callables.

Compares torch.cuda.make_graphed_callables with gograph, and gograph with parts of its replay
path replaced, to attribute the per-replay overhead:
  default        gograph as shipped
  no-capture-chk replay without the is-capturing guard
  core-only      replay = one core.replay call (no companion/guard logic)
  noop           replay does nothing (pure Python + autograd overhead, no launches)
and times core.replay itself from the main thread (forward) and autograd's thread (backward).

  python bench/profile_replay.py [--layers 32] [--width 256] [--rows 64] [--steps 200]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import gograph
from gograph.core import _native


def make_layers(n, width, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()).to("cuda", dtype) for _ in range(n)]


def step(mods, x):
    h = x
    for m in mods:
        h = m(h)
    h.square().mean().backward()


def timeit(mods, x, steps):
    for _ in range(5):
        step(mods, x)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            step(mods, x)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randn(a.rows, a.width, device="cuda")
    samples = lambda: tuple(
        (torch.randn(a.rows, a.width, device="cuda").requires_grad_(i > 0),) for i in range(a.layers)
    )
    eager = make_layers(a.layers, a.width)
    print(f"eager           {timeit(eager, x, a.steps):8.3f} ms/step")
    tl = make_layers(a.layers, a.width)
    tg = torch.cuda.make_graphed_callables(tuple(tl), samples())
    print(f"torch           {timeit(tg, x, a.steps):8.3f} ms/step")
    gl = make_layers(a.layers, a.width)
    gg = gograph.make_graphed_callables(tuple(gl), samples())
    eng = gg[0].forward.engine
    print(f"gograph default {timeit(gg, x, a.steps):8.3f} ms/step")
    core = _native.core
    raw = getattr(core, "_gographcore", None)
    idx = eng.device_index
    orig = eng.replay

    def core_only(pass_id, kind):
        core.replay(pass_id, kind, torch._C._cuda_getCurrentRawStream(idx))

    eng.replay = core_only
    print(f"gograph core    {timeit(gg, x, a.steps):8.3f} ms/step")
    if raw is not None:
        rr = raw.gograph_Replay
        eng.replay = lambda pid, k: rr(pid, k, torch._C._cuda_getCurrentRawStream(idx))
        print(f"gograph rawcall {timeit(gg, x, a.steps):8.3f} ms/step")
    eng.replay = lambda pid, k: None
    print(f"gograph noop    {timeit(gg, x, a.steps):8.3f} ms/step  (no launches: CPU overhead only)")
    fwd_ns, bwd_ns = [], []

    def timed(pid, k):
        t = time.perf_counter_ns()
        core.replay(pid, k, torch._C._cuda_getCurrentRawStream(idx))
        (fwd_ns if k == 0 else bwd_ns).append(time.perf_counter_ns() - t)

    eng.replay = timed
    timeit(gg, x, 50)
    med = lambda v: sorted(v)[len(v) // 2] / 1e3
    print(
        f"core.replay median: forward (main thread) {med(fwd_ns):.2f} us, "
        f"backward (autograd thread) {med(bwd_ns):.2f} us"
    )
    eng.replay = orig
    # One launch, from the main thread: torch's CUDAGraph.replay() against the core's replay of a
    # graph of the same work, and the cost of one graphed forward call under no_grad.
    lin = torch.nn.Linear(a.width, a.width).cuda()
    xs = torch.randn(a.rows, a.width, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            lin(xs)
    torch.cuda.current_stream().wait_stream(side)
    tgraph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(tgraph):
        lin(xs)

    def per_call_us(fn, n=3000):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best

    pid = gg[1].forward.pass_id
    stream_of = torch._C._cuda_getCurrentRawStream
    print(
        f"one launch: torch CUDAGraph.replay {per_call_us(tgraph.replay):.2f} us, core.replay "
        f"{per_call_us(lambda: core.replay(pid, 0, stream_of(idx))):.2f} us, engine.replay "
        f"{per_call_us(lambda: eng.replay(pid, 0)):.2f} us"
    )
    with torch.no_grad():
        print(
            f"one graphed forward call under no_grad: torch {per_call_us(lambda: tg[1](x)):.2f} us, "
            f"gograph {per_call_us(lambda: gg[1](x)):.2f} us"
        )
    xg = x.detach().requires_grad_()
    print(
        f"one graphed forward call with grad (autograd node built): torch {per_call_us(lambda: tg[1](xg)):.2f} us, "
        f"gograph {per_call_us(lambda: gg[1](xg)):.2f} us"
    )
    del tgraph
    for m in gg:
        m.reset()
    gg = gl = tg = tl = None  # type: ignore[assignment]
    gc.collect()


if __name__ == "__main__":
    main()
