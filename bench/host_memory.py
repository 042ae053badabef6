"""Host memory per graph cycle, and where make_graphed_callables spends its time.

1. RSS growth per graph -> replay -> reset -> delete cycle on the CUDA engine, for a model with
   and without dropout (dropout adds a torch RNG companion graph per capture), and with torch's
   own make_graphed_callables for reference.
2. A cProfile of gograph.make_graphed_callables on W2 (32 x Linear(256)+ReLU), top functions by
   cumulative time, next to torch's total.

  python bench/host_memory.py [--cycles 300]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import resource
import time

import torch

import gograph


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def cycle(maker, dropout: bool, dev) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.GELU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.1))
    layers.append(torch.nn.Linear(32, 16))
    model = torch.nn.Sequential(*layers).to(dev)
    x = torch.randn(8, 16, device=dev)
    g = maker(model, (x,))
    g(x).sum().backward()
    if hasattr(g, "reset") and maker is gograph.make_graphed_callables:
        g.reset()
    del g, model, x
    gc.collect()


def growth(maker, dropout: bool, dev, cycles: int) -> float:
    for _ in range(20):
        cycle(maker, dropout, dev)
    torch.cuda.synchronize()
    r0 = rss_bytes()
    for _ in range(cycles):
        cycle(maker, dropout, dev)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return (rss_bytes() - r0) / cycles


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cycles", type=int, default=300)
    a = p.parse_args()
    dev = torch.device("cuda")
    for name, maker in (("gograph", gograph.make_graphed_callables), ("torch", torch.cuda.make_graphed_callables)):
        for dropout in (False, True):
            g = growth(maker, dropout, dev, a.cycles)
            print(f"{name:8} dropout={dropout!s:5}: host RSS {g:+9.0f} B/cycle over {a.cycles} cycles")
    layers = lambda: [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()).cuda() for _ in range(32)]
    samples = lambda: tuple((torch.randn(64, 256, device="cuda").requires_grad_(i > 0),) for i in range(32))
    for name, maker in (("torch", torch.cuda.make_graphed_callables), ("gograph", gograph.make_graphed_callables)):
        ls, ss = layers(), samples()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        maker(tuple(ls), ss)
        torch.cuda.synchronize()
        print(f"W2 {name} make_graphed_callables {time.perf_counter() - t0:.3f} s")
    ls, ss = layers(), samples()
    pr = cProfile.Profile()
    pr.enable()
    gograph.make_graphed_callables(tuple(ls), ss)
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()
