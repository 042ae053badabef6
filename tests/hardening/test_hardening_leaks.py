"""Hardening: leaks and lifetimes over many cycles of graph -> replay -> reset -> delete.

Each cycle must hand back everything: the core's pass records and graphs (``live_passes``,
``live_graphs``), the eager engine's pool references, device memory (CUDA), and host memory
(RSS growth bounded; measured and printed, see docs/RELIABILITY.md). Also: no Go->Python
callbacks, and garbage calls into the core come back as Python exceptions, never a crash."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gograph
from gograph.core import _native
from gograph.engines import EagerEngine

from helpers import make_mlp

mgc = gograph.make_graphed_callables

try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # pragma: no cover - not glibc
    _libc = None


def rss_bytes() -> int:
    """Resident set size of this process, after a collection and returning freed heap to the OS
    (so that the number measures what is kept, not allocator slack)."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _core_cycle(core) -> None:
    """One pass record's whole life in the core: two eager capture transactions, seal, three
    replays, reset, drop (11 calls)."""
    p = core.new_pass(7, "layer7")
    for k in (0, 1):
        core.begin_pass_capture(p, k, "eager/leak", 0, 0)
        core.end_pass_capture(p, k, 0)
    core.seal_pass(p)
    for k in (0, 1, 0):
        core.replay(p, k, 0)
    assert core.reset_pass(p) == 2
    core.drop_pass(p)


def _warm_go_heap() -> None:
    """The Go runtime grows its heap to ~4 MiB (its minimum GC target) before collecting
    steadily: RSS rises by that much over the first ~50k core calls of a process, whatever they
    are. Measurements start after it, so that they show growth that does not stop."""
    core = _native.core
    for _ in range(60000):
        _core_cycle(core)


def _cycle(model: torch.nn.Module, x: torch.Tensor, engine) -> None:
    mgc(model, (x,), num_warmup_iters=1, engine=engine)
    out = model(x)
    out.square().sum().backward()
    del out
    model.reset()
    del model.forward, model.reset, model.backward_dw  # back to the plain module
    model.zero_grad(set_to_none=True)


def _run_cycles(n: int, make, engine, device="cpu") -> list[int]:
    """n cycles, each graphing a fresh model (then deleting it), with RSS samples."""
    samples = []
    x = torch.randn(8, 16, device=device, requires_grad=True)
    for i in range(n):
        model = make()
        _cycle(model, x, engine)
        del model
        x.grad = None
        if i % 100 == 99:
            samples.append(rss_bytes())
    return samples


def _growth_per_cycle(samples: list[int], per: int = 100) -> float:
    """Least-squares slope of RSS over the samples, per cycle: a leak grows steadily, allocator
    noise (a few pages up and down) does not."""
    n = len(samples)
    mx = (n - 1) / 2
    my = sum(samples) / n
    cov = sum((i - mx) * (y - my) for i, y in enumerate(samples))
    var = sum((i - mx) ** 2 for i in range(n))
    return cov / var / per


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc for RSS")
def test_thousand_cycles_on_the_eager_engine_leak_nothing():
    engine = EagerEngine()
    gc.collect()
    base_passes, base_graphs = gograph.live_passes(), gograph.live_graphs()

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    _run_cycles(50, make, engine)  # warm caches and the allocator
    _warm_go_heap()
    samples = _run_cycles(1000, make, engine)
    gc.collect()
    assert gograph.live_passes() == base_passes
    assert gograph.live_graphs() == base_graphs
    assert not engine._passes
    growth = _growth_per_cycle(samples)
    total = samples[-1] - samples[0]
    print(
        f"\neager engine, 1000 cycles: RSS {samples[0] / 2**20:.1f} -> {samples[-1] / 2**20:.1f} MiB "
        f"({total / 2**10:+.0f} KiB over 900 cycles, {growth:+.0f} B/cycle)"
    )
    # Bounded: a leak of the pass machinery (the static buffers alone are ~2 KiB per cycle here,
    # the model ~3 KiB) grows by >= 2 KiB every cycle, in every run; measured slopes are 0-350
    # B/cycle on a loaded 2-core CI machine (allocator noise, which a second run does not repeat).
    # Per-call leaks of the core are held to < 2 B by the next test.
    bound = 1024
    if growth >= bound:
        samples = _run_cycles(1000, make, engine)
        growth = min(growth, _growth_per_cycle(samples))
    assert growth < bound, f"host memory grows {growth:.0f} B per graph->replay->reset->delete cycle"


def test_thousand_cycles_of_the_core_records():
    """The core's side alone: 100000 x (new pass, 2 capture transactions, seal, replay x3, reset, drop)."""
    core = _native.core
    base = core.live_passes()
    _warm_go_heap()
    r0 = rss_bytes()
    for _ in range(100000):
        _core_cycle(core)
    per_call = (rss_bytes() - r0) / (100000 * 11)
    print(f"\ncore records: {per_call:+.2f} B per core call over 1M calls")
    assert core.live_passes() == base
    # gopy's wrapper of an error-only function leaked ~31 B per call (before those functions
    # returned (bool, error)); noise here is about +-0.5 B per call.
    assert per_call < 2, "a core call leaks memory (gopy's error-only wrapper shape?)"


def test_errors_from_the_core_do_not_leak():
    core = _native.core

    def fail():
        for call in (
            lambda: core.seal_pass(-5),
            lambda: core.replay(-5, 0, 0),
            lambda: core.pass_state(-5),
            lambda: core.end_pass_capture(-5, 0, 0),
            lambda: core.drop_pass(-5),
        ):
            try:
                call()
            except RuntimeError:
                pass

    _warm_go_heap()
    for _ in range(20000):
        fail()

    def window() -> float:
        r0 = rss_bytes()
        for _ in range(60000):
            fail()
        return (rss_bytes() - r0) / (60000 * 5)

    # A leak grows in every window (the one this guards against was ~31 B per call); RSS noise
    # (a page or two of the Go heap or Python's arenas) reads up to ~2 B in one window and not
    # in the next, so a window over the bound is measured once more.
    per_call = window()
    if per_call >= 2:
        per_call = min(per_call, window())
    print(f"\ncore errors: {per_call:+.2f} B per failing core call")
    assert per_call < 2


# ---------------------------------------------------------------------------------------------
# The boundary
# ---------------------------------------------------------------------------------------------
_GARBAGE_CALLS = r"""
import itertools, sys
from gograph.core import _native
core = _native.core
ints = [0, 1, -1, 2, 3, 7, 2**31, -2**31, 2**62, -2**63, 2**63 - 1]
strs = ["", "x", "\x00nul", "caf\u00e9 \U0001f680", "\"quoted\"\n", "a" * 10000]
outcomes = {}
names = ["core_version", "flavor", "cuda_header_version", "live_graphs", "live_passes", "driver_version",
         "device_count", "device_name", "device_total_memory", "exchange_capture_mode", "capture_status",
         "graph_node_count", "destroy_graph", "upload_graph", "launch_graph", "new_pass", "begin_pass_capture",
         "end_pass_capture", "abort_pass_capture", "seal_pass", "replay", "pass_state", "pass_graph", "reset_pass",
         "pass_reset_error", "drop_pass", "pool_refs", "plan_schedule", "plan_steps", "plan_warmup", "plan_capture",
         "plan_memory", "free_plan", "live_plans", "trigger_panic_for_test", "begin_capture", "end_capture",
         "abort_capture", "set_replay_recarve_spec"]
# On the cuda flavor, the calls that hand their stream straight to the driver get only stream 0
# (refused before the driver): a garbage stream value would be dereferenced as a pointer there,
# and raw handles are the caller's contract (see CORE_API.md). end_capture, upload_graph and
# launch_graph check the stream or graph against the registry first, so they get everything.
# The cpu flavor has no driver: everything goes.
DRIVER_STREAM_FIRST = ("begin_capture", "abort_capture", "capture_status")
created = []
for name in names:
    fn = getattr(core, name)
    nargs = fn.__code__.co_argcount if hasattr(fn, "__code__") else None
    for args in itertools.islice(itertools.product(ints, repeat=nargs or 0), 300):
        if _native.flavor == "cuda" and name in DRIVER_STREAM_FIRST and args[0] != 0:
            continue
        try:
            r = fn(*args)
            if name == "new_pass":
                created.append(r)
            if name == "begin_pass_capture":  # leave nothing open
                core.abort_pass_capture(args[0], args[1], args[3])
            outcomes[(name, "ok")] = outcomes.get((name, "ok"), 0) + 1
        except (RuntimeError, OverflowError, TypeError, ValueError) as e:
            assert "internal panic" not in str(e) or name == "trigger_panic_for_test", (name, args, str(e))
            outcomes[(name, type(e).__name__)] = outcomes.get((name, type(e).__name__), 0) + 1
for s in strs:
    for i in (0, 5):
        try:
            created.append(core.new_pass(i, s))
        except ValueError as e:  # a NUL cannot cross into a C string: refused before Go
            assert "\x00" in s and "null" in str(e), (s, e)
            continue
        assert core.pass_state(created[-1]) == "building"
for p in created:
    core.drop_pass(p)
for h in range(1, 1000):
    core.free_plan(h)
assert core.live_passes() == 0, core.live_passes()
assert core.live_plans() == 0, core.live_plans()
print("CALLS", sum(outcomes.values()))
print("OK")
"""


def test_garbage_calls_into_the_core_raise_and_never_crash():
    """Every exported function with integer and string arguments from the edges of int64 (and
    beyond: OverflowError), in a subprocess so that a crash would show as a return code."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(gograph.__file__)))
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_GARBAGE_CALLS)], capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "OK" in p.stdout
    print(p.stdout.strip().splitlines()[0])


def test_ints_beyond_int64_are_refused_before_go():
    core = _native.core
    for bad in (2**63, -(2**63) - 1, 2**100):
        with pytest.raises(OverflowError):
            core.replay(bad, 0, 0)
        with pytest.raises(OverflowError):
            core.pass_state(bad)


def test_panics_under_exports_come_back_as_runtime_errors():
    core = _native.core
    for _ in range(1000):
        with pytest.raises(RuntimeError, match="trigger_panic_for_test: internal panic"):
            core.trigger_panic_for_test()
    assert core.live_passes() >= 0  # the interpreter and the core are fine


def test_core_exposes_no_callbacks_and_only_scalar_signatures():
    """The generated wrapper takes no Python callables: every exported function's parameters are
    scalars or strings (checked on the Go side by TestExportRules); here, on the wrapper's
    docstrings/signatures gopy generates."""
    import inspect

    core = _native.core
    funcs = {n: getattr(core, n) for n in dir(core) if not n.startswith("_") and callable(getattr(core, n))}
    assert "make_graphed_callables" not in funcs
    for name, fn in funcs.items():
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        for param in sig.parameters.values():
            assert param.kind in (param.POSITIONAL_OR_KEYWORD, param.POSITIONAL_ONLY), (name, param)


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_thousand_cycles_on_cuda_leak_nothing(cuda_device):
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 16)
        ).to(cuda_device)

    _run_cycles(20, make, None, device=cuda_device)  # cuBLAS, allocator warm
    _warm_go_heap()
    gc.collect()
    torch.cuda.synchronize(cuda_device)
    torch.cuda.empty_cache()
    base_alloc = torch.cuda.memory_allocated(cuda_device)
    base_passes, base_graphs = gograph.live_passes(), gograph.live_graphs()
    samples = _run_cycles(1000, make, None, device=cuda_device)
    gc.collect()
    torch.cuda.synchronize(cuda_device)
    torch.cuda.empty_cache()
    assert gograph.live_graphs() == base_graphs
    assert gograph.live_passes() == base_passes
    assert torch.cuda.memory_allocated(cuda_device) == base_alloc
    eng = gograph.engines.default_cuda_engine(cuda_device)
    assert not eng.rng.companions
    growth = _growth_per_cycle(samples)
    print(
        f"\ncuda engine, 1000 cycles: RSS {samples[0] / 2**20:.1f} -> {samples[-1] / 2**20:.1f} MiB "
        f"({growth:+.0f} B/cycle); device memory back to {base_alloc} B"
    )
    assert growth < 4096, f"host memory grows {growth:.0f} B per cycle on the CUDA engine"


@pytest.mark.cuda
def test_hundred_layers_graph_replay_reset_delete_cycles(cuda_device):
    """The training-job shape: 100 layers in one call, 20 cycles; everything comes back. The
    allocated baseline is taken after the first cycle: a process's first capture and backward
    leave what the libraries keep for its lifetime (cuBLAS's workspace for each stream it ran on,
    allocated through the caching allocator), which no later cycle adds to."""
    gc.collect()
    base_graphs = gograph.live_graphs()
    base_alloc = None
    for cycle in range(21):
        layers = [make_mlp(seed=i, d_in=16, d_hidden=32, d_out=16, device=cuda_device) for i in range(100)]
        samples = tuple((torch.randn(4, 16, device=cuda_device, requires_grad=True),) for _ in layers)
        mgc(tuple(layers), samples, num_warmup_iters=1)
        assert gograph.live_graphs() == base_graphs + 200
        y = torch.randn(4, 16, device=cuda_device, requires_grad=True)
        for m in layers:
            y = m(y)
        y.sum().backward()
        del y, samples
        for m in layers[::2]:
            m.reset()  # half explicitly, half by deletion
        del layers, m
        gc.collect()
        assert gograph.live_graphs() == base_graphs
        if cycle == 0:
            torch.cuda.synchronize(cuda_device)
            torch.cuda.empty_cache()
            base_alloc = torch.cuda.memory_allocated(cuda_device)
    torch.cuda.synchronize(cuda_device)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(cuda_device) == base_alloc
