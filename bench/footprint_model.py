"""The footprint bench's cells without a GPU: what each cell's pools would reserve, modelled.

bench/footprint.py measures peak ``torch.cuda.max_memory_reserved()`` of a graphed training run
(``make_graphed_callables`` and its steps) on a GPU. This runs the same cell (workload, arm,
``zero_grad`` mode) at the same sizes on the CPU, on the eager engine, without computing
anything: every op's outputs are allocated (uninitialised, by torch's CPU allocator) in the shapes
it would return, views are real views, in-place ops write nothing. torch's profiler records every
allocation and free; each allocation is put in the pool it would take on CUDA -- the graph pool
during a capture, the side stream's part of the default pool during warmup, the default pool
otherwise (a replay allocates nothing on CUDA: what the eager engine allocates while replaying is
left out) -- and the core runs the whole sequence through its model of the caching allocator
(``_core.simulate_pools``, internal/poolsim over internal/allocsim).

The figure is a model, not a measurement: it leaves out the pool seed the CUDA engine carves
(chosen from a CUDA allocation trace), cuBLAS workspaces, the small allocations of CUDA's RNG and
streams, and whatever the CUDA kernels allocate beyond their outputs. It follows what the layout of
gograph's own buffers does to the caching allocator, which is what the CPU memory gate
(tests/memory/test_footprint_gate.py) holds.

  python bench/footprint_model.py                               # the gate's cells, table
  python bench/footprint_model.py --workloads chain --arms eager,gograph --modes none
  python bench/footprint_model.py --cell chain gograph zero     # one cell, JSON
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import gograph
from gograph.core import _core
from gograph.engines import EagerEngine

from footprint import MODES, graph, parse_arm
from workloads import workload

MiB = 2**20
STEPS = 4  # keep mode peaks in step 1, the first step's copies in step 0: four show both
#: The gate's cells: the drop-in call and the two documented opt-ins, as docs/BENCHMARKS.md's table.
ARMS = (
    "eager",
    "gograph",
    "gograph:chain_buffers=true+shared_samples=all+recv_into_static=1",
    "gograph:chain_buffers=true+shared_samples=all+recv_into_static=1+loss_in_graph=1",
)
_WINDOW = "gograph-pool:"  # record_function names that mark where allocations go
_aten = torch.ops.aten


class NoCompute(TorchDispatchMode):
    """Ops allocate their outputs and compute nothing: a functional op's outputs are
    uninitialised tensors of the shapes, strides and dtypes it would return (found on the meta
    device), a view is the real view, an in-place or ``out=`` op returns what it would have
    written. Values are garbage; sizes, aliasing and lifetimes are the real ones."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if any(r.alias_info is not None for r in schema.returns):
            written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            if not written:
                return func(*args, **kwargs)  # a view: no memory of its own
            for a, v in zip(schema.arguments, args):
                if a.name == written[0]:
                    return v
            return kwargs[written[0]]
        if func is _aten.equal.default:  # a comparison on the host (the shared-input guard)
            return True
        if func is _aten._local_scalar_dense.default:
            return 0
        meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        if "device" in meta_kwargs:
            meta_kwargs["device"] = torch.device("meta")
        return tree_map(_allocated, func(*meta_args, **meta_kwargs))


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _allocated(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, requires_grad=False)
    return x


class PoolMarkingEngine(EagerEngine):
    """The eager engine, marking where each allocation would go on CUDA: captures in the graph
    pool, warmup on the side stream (or, for a warmup the core put in the graph pool, there),
    replays nowhere (a CUDA replay allocates nothing), ``empty_cache`` where the CUDA engine
    calls it."""

    def _capture(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(_WINDOW + "g"):
            return super()._capture(*args, **kwargs)

    def replay(self, pass_id: int, kind: int) -> None:
        with record_function(_WINDOW + "replay"):
            super().replay(pass_id, kind)

    @contextlib.contextmanager
    def warmup_context(self, pool: Any = None) -> Iterator[None]:
        with record_function(_WINDOW + ("w" if pool is None else "g")):
            yield

    def release_cached(self) -> None:
        with record_function(_WINDOW + "empty"):
            pass

    def buffer_released(self, tensor: torch.Tensor) -> None:
        # the eager engine keeps the buffer (host memory); on CUDA its block is free from here
        with record_function(f"{_WINDOW}free:{tensor.untyped_storage().data_ptr()}"):
            pass


def pools_trace(prof: Any) -> str:
    """The profiled allocations and frees as the core's pools trace, in time order."""
    allocations: list[tuple[int, int, int]] = []
    windows: list[tuple[int, int, str]] = []

    def walk(node: Any) -> None:
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            allocations.append((node.start_time_ns, f.ptr, f.alloc_size))
        elif node.name.startswith(_WINDOW):
            windows.append((node.start_time_ns, node.end_time_ns, node.name[len(_WINDOW) :]))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    windows.sort()
    markers = [w for w in windows if w[2] == "empty" or w[2].startswith("free:")]
    windows = [w for w in windows if w not in markers]  # the pools allocations go to
    starts = [w[0] for w in windows]
    events = [(t, 0, ptr, size) for t, ptr, size in allocations]
    events += [(w[0], 1, 0, 0) if w[2] == "empty" else (w[0], 2, int(w[2][5:]), 0) for w in markers]
    lines: list[str] = ["pools v1"]
    live: dict[int, int | None] = {}
    next_id = 0
    events.sort(key=lambda e: e[0])  # stable: events of one instant keep the tree's order
    for t, marker, ptr, size in events:
        if marker == 1:
            lines.append("e")
        elif marker == 2:  # a buffer the core released: free in the pool, kept on the host
            block = live.get(ptr)
            if block is not None:
                lines.append(f"f {block}")
                live[ptr] = None
        elif size > 0:
            i = bisect.bisect_right(starts, t) - 1
            pool = windows[i][2] if i >= 0 and t <= windows[i][1] else "d"
            if pool == "replay":
                live[ptr] = None  # a replay's own allocation: none on CUDA
                continue
            live[ptr] = next_id
            lines.append(f"a {next_id} {size} {pool}")
            next_id += 1
        elif ptr in live:
            block = live.pop(ptr)
            if block is not None:
                lines.append(f"f {block}")
    return "\n".join(lines) + "\n"


#: The pipeline rank's build cells: bench/pipeline.py's call (rank 0 of 4 stages, 4 chunks x 2
#: layers, hidden 1024, 4096 rows, bf16) at a microbatch count (the cell's mode).
PIPELINE_BUILD = "pipeline-build"


def run_pipeline_build(arm: str, micro: int) -> dict[str, Any]:
    """What graphing the pipeline rank allocates, modelled: the samples (one fresh tensor per
    pass, in a list, as Megatron-LM's and TransformerEngine's callers pass them) are made before
    the record starts, so the figure is the call's own -- warmup, captures and the buffers they
    keep -- whatever the caller allocated; with buffer reuse it is flat in the microbatch count."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pipeline import Layer

    maker, kwargs = parse_arm(arm)
    if maker != "gograph":
        raise SystemExit(f"{PIPELINE_BUILD}: a gograph arm, got {arm!r}")
    chunks, per_chunk, hidden, rows = 4, 2, 1024, 4096
    torch.manual_seed(0)
    layers = tuple(Layer(hidden, 4 * hidden).to(torch.bfloat16) for _ in range(chunks * per_chunk))
    samples = [
        (torch.empty(rows, hidden, dtype=torch.bfloat16).requires_grad_(),) for _ in range(chunks * per_chunk * micro)
    ]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, NoCompute():
        graphed = gograph.make_graphed_callables(
            layers,
            samples,
            _order=gograph.megatron_order(4, 0, chunks, micro),
            _num_layers_per_chunk=per_chunk,
            engine=PoolMarkingEngine(),
            **kwargs,
        )
        del samples, graphed
    result = _footprint(_core.simulate_pools(pools_trace(prof)))
    return {"workload": PIPELINE_BUILD, "arm": arm, "mode": str(micro), **result}


def run_cell(name: str, arm: str, mode: str, steps: int = STEPS) -> dict[str, Any]:
    """One cell modelled: the pools' peak reserved and allocated bytes (relative to after model
    init, as bench/footprint.py's), per pool, and the run's wall time. The pipeline build cells
    (``pipeline-build``) take the microbatch count as their mode (:func:`run_pipeline_build`)."""
    if name == PIPELINE_BUILD:
        return run_pipeline_build(arm, int(mode))
    device = torch.device("cpu")
    wl = workload(name, False)
    maker, kwargs = parse_arm(arm)
    into_static = bool(kwargs.pop("recv_into_static", False))
    layers = wl.build(device)  # real initialisation, before anything is recorded
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=1e-3)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, NoCompute():
        if maker == "eager":
            calls = wl.eager_calls(layers)
            if kwargs.get("loss_in_graph"):
                raise SystemExit("eager has no loss_in_graph arm")
        else:
            calls, _ = graph(maker, {**kwargs, "engine": PoolMarkingEngine()}, wl, layers, device)
        gen = torch.Generator(device=device).manual_seed(1)
        into = wl.static_inputs(calls) if into_static else {}
        for _ in range(steps):
            batch = wl.batch(gen, device, recv=into_static)
            batch.into = into
            wl.step(calls, batch)
            del batch
            opt.step()
            opt.zero_grad(set_to_none=MODES[mode])
        del calls, into
    result = _footprint(_core.simulate_pools(pools_trace(prof)))
    return {"workload": name, "arm": arm, "mode": mode, **result}


def _footprint(text: str) -> dict[str, Any]:
    lines = text.splitlines()
    if not lines or lines[0].split()[:2] != ["footprint", "v1"]:
        raise RuntimeError(f"simulate_pools returned {lines[:1]}, not a footprint v1 text")
    out: dict[str, Any] = {"pools": {}}
    for line in lines[1:]:
        f = line.split()
        if f[0] == "pool":
            out["pools"][f[1]] = {f[i]: int(f[i + 1]) for i in range(2, len(f), 2)}
        else:
            out[f[0]] = int(f[1])
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Modelled peak reserved MiB and x eager per cell, with each pool's peak."""
    eager = {(r["workload"], r["mode"]): r["peak_reserved"] for r in rows if r["arm"] == "eager"}
    head = "| workload | zero_grad (microbatches) | arm | modelled peak reserved MiB | x eager |"
    out = [head + " default / warmup / graph pool MiB |"]
    out.append("|---|---|---|---|---|---|")
    for r in rows:
        base = eager.get((r["workload"], r["mode"]))
        ratio = f"{r['peak_reserved'] / base:.3f}" if base else "-"
        pools = " / ".join(f"{r['pools'][p]['peak_reserved'] / MiB:.0f}" for p in ("d", "w", "g"))
        out.append(
            f"| {r['workload']} | {_mode_text(r['mode'])} | {r['arm']} | {r['peak_reserved'] / MiB:.0f} "
            f"| {ratio} | {pools} |"
        )
    return "\n".join(out)


def _mode_text(mode: str) -> str:
    return f"set_to_none={MODES[mode]}" if mode in MODES else f"{mode} microbatches"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="chain,blocks")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--modes", default="none,zero")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--cell", nargs=3, metavar=("WORKLOAD", "ARM", "MODE"), help="one cell, as a JSON line")
    ap.add_argument(
        "--pipeline-arms",
        default="",
        help=f"comma-separated gograph arms of the {PIPELINE_BUILD} cells, at 8 and 64 microbatches",
    )
    args = ap.parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell(*args.cell, steps=args.steps)))
        return 0
    rows = [
        run_cell(name, arm, mode, args.steps)
        for name in filter(None, args.workloads.split(","))
        for mode in args.modes.split(",")
        for arm in args.arms.split(",")
    ]
    rows += [run_pipeline_build(arm, m) for arm in filter(None, args.pipeline_arms.split(",")) for m in (8, 64)]
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gograph": gograph.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
