"""Attributes host RSS growth to the pieces of an RNG companion capture.

Each variant repeats one small piece of what a gograph capture with dropout does, N times after
a warm-up, and prints RSS growth per repetition, the growth of gc-tracked objects, and the top
tracemalloc differences for the full gograph cycle.

  python bench/companion_rss.py [--cycles 200]
"""

from __future__ import annotations

import argparse
import gc
import resource
import tracemalloc
import warnings

import torch

import gograph


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def empty_companion(shared_pool=None, quiet=False, kernel=False, scratch=None, register=True):
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    pool = shared_pool if shared_pool is not None else torch.cuda.graph_pool_handle()
    with torch.cuda.stream(side):
        g.capture_begin(pool=pool, capture_error_mode="relaxed")
        if kernel:
            scratch.add_(1)
        if quiet:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g.capture_end()
        else:
            g.capture_end()
    g.replay()
    torch.cuda.synchronize()
    g.reset()
    del g


def gograph_cycle(dropout: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.GELU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.1))
    layers.append(torch.nn.Linear(32, 16))
    model = torch.nn.Sequential(*layers).cuda()
    x = torch.randn(8, 16, device="cuda")
    g = gograph.make_graphed_callables(model, (x,))
    g(x).sum().backward()
    g.reset()
    del g, model, x
    gc.collect()


def measure(name, fn, cycles):
    for _ in range(20):
        fn()
    gc.collect()
    torch.cuda.synchronize()
    n0, r0 = len(gc.get_objects()), rss_bytes()
    for _ in range(cycles):
        fn()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(
        f"{name:44} RSS {(rss_bytes() - r0) / cycles:+10.0f} B/rep, "
        f"gc objects {(len(gc.get_objects()) - n0) / cycles:+.2f}/rep",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=200)
    a = ap.parse_args()
    torch.ones(1, device="cuda")
    warnings.simplefilter("ignore")
    # A pool id shared by many captures must keep a reference between them in both of torch's
    # allocators (torch asserts when a released pool id is captured into again): anchor it with
    # an empty graph kept alive, as the CUDA engine does.
    shared = torch.cuda.graph_pool_handle()
    anchor = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()):
        anchor.capture_begin(pool=shared, capture_error_mode="relaxed")
        anchor.capture_end()
    scratch = torch.zeros(1, device="cuda")
    warnings.resetwarnings()
    measure("empty relaxed capture, new pool", lambda: empty_companion(quiet=True), a.cycles)
    measure("empty relaxed capture, shared anchored pool", lambda: empty_companion(shared, quiet=True), a.cycles)
    measure("empty, new pool, warning not silenced", empty_companion, a.cycles)
    measure("one kernel, new pool", lambda: empty_companion(kernel=True, scratch=scratch), a.cycles)
    measure("one kernel, shared anchored pool", lambda: empty_companion(shared, kernel=True, scratch=scratch), a.cycles)
    measure("gograph cycle without dropout", lambda: gograph_cycle(False), a.cycles)
    measure("gograph cycle with dropout", lambda: gograph_cycle(True), a.cycles)
    tracemalloc.start(12)
    for _ in range(20):
        gograph_cycle(True)
    s0 = tracemalloc.take_snapshot()
    for _ in range(100):
        gograph_cycle(True)
    s1 = tracemalloc.take_snapshot()
    print("tracemalloc top growth over 100 dropout cycles (Python allocations only):")
    for st in s1.compare_to(s0, "traceback")[:6]:
        print(f"  {st.size_diff:+9d} B {st.count_diff:+6d} blocks")
        for line in st.traceback.format()[-8:]:
            print("     ", line)


if __name__ == "__main__":
    main()
