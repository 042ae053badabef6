"""What is live at a footprint cell's peaks: the allocator's history, split at the build and the steps.

Runs one cell of bench/footprint.py (same workload, arm and mode syntax) in this process with
torch's allocator history on, then finds the moment of peak reserved memory during
``make_graphed_callables`` (graphed arms) and during the training steps, and lists at each what
the reserved bytes hold: live allocations grouped by the innermost frame in gograph, the bench
or the model, and the cached-but-free bytes per stream. Diagnostic only (the history slows every
allocation); bench/footprint.py's numbers are the measurement.

  python bench/peak_breakdown.py chain gograph:chain_buffers=true+shared_samples=true+loss_in_graph=1 none
  python bench/peak_breakdown.py chain eager none --steps 3 --top 15
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import footprint

MiB = 2**20
SMALL_SEGMENT = 2 * MiB  # the caching allocator's small-pool segment
OURS = ("/gograph/", "/bench/", "/transformers/")


def trace_len() -> int:
    return len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])


def mark_phases() -> dict[str, int]:
    """Wraps the calls that bound a cell's phases so their trace positions are recorded."""
    marks: dict[str, int] = {}
    reset = torch.cuda.reset_peak_memory_stats

    def reset_marked(*a: Any, **k: Any) -> None:
        marks.setdefault("init", trace_len())  # run_cell resets the peak right after model init
        reset(*a, **k)

    torch.cuda.reset_peak_memory_stats = reset_marked
    for mod in (footprint.gograph, torch.cuda):
        make = mod.make_graphed_callables

        def make_marked(*a: Any, _make: Any = make, **k: Any) -> Any:
            out = _make(*a, **k)
            torch.cuda.synchronize()
            marks["build"] = trace_len()
            return out

        mod.make_graphed_callables = make_marked  # type: ignore[attr-defined]
    return marks


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in our code or the model's (else the innermost frame)."""
    for f in frames:
        if any(s in f["filename"] for s in OURS):
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    return f"{os.path.basename(frames[0]['filename'])}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def made_by(frames: list[dict[str, Any]]) -> str:
    """where(), and the innermost gograph frame (warmup or capture) when that is not it."""
    ours = next((f for f in frames if "/gograph/" in f["filename"]), None)
    if ours is None or ours is frames[0]:
        return where(frames)
    return f"{where(frames)} < {where([ours])}"


def replay(trace: list[dict[str, Any]], start: int, stop: int, base: int) -> tuple[int, int]:
    """(index, reserved bytes) of the peak of reserved memory in trace[start:stop]."""
    reserved, best, at = 0, -1, start
    for i, e in enumerate(trace[:stop]):
        a = e["action"]
        if a in ("segment_alloc", "segment_map"):
            reserved += e["size"]
        elif a in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
        if i >= start and reserved > best:
            best, at = reserved, i
    return at, best - base


def live_at(trace: list[dict[str, Any]], upto: int) -> tuple[dict[str, int], dict[int, int]]:
    """Live allocations after trace[:upto+1], grouped by where(); reserved bytes per stream."""
    live: dict[int, dict[str, Any]] = {}
    seg_stream: dict[int, int] = collections.Counter()
    for e in trace[: upto + 1]:
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = e
        elif a == "free_completed":
            live.pop(e["addr"], None)
        elif a in ("segment_alloc", "segment_map"):
            seg_stream[e["stream"]] += e["size"]
        elif a in ("segment_free", "segment_unmap"):
            seg_stream[e["stream"]] -= e["size"]
    groups: dict[str, int] = collections.Counter()
    for e in live.values():
        groups[f"[stream {e['stream']:#x}] {where(e.get('frames') or [])}"] += e["size"]
    return groups, dict(seg_stream)


def segments_at(trace: list[dict[str, Any]], upto: int) -> list[dict[str, Any]]:
    """The segments reserved after trace[:upto+1]: address, size, stream, live bytes in it, the
    trace entry that made it and where (the allocation that grew the pool)."""
    segs: dict[int, dict[str, Any]] = {}
    live: dict[int, int] = {}
    for made, e in enumerate(trace[: upto + 1]):
        a = e["action"]
        if a in ("segment_alloc", "segment_map"):
            segs[e["addr"]] = {"addr": e["addr"], "size": e["size"], "stream": e["stream"], "live": 0,
                               "made": made, "by": made_by(e.get("frames") or [])}  # fmt: skip
        elif a in ("segment_free", "segment_unmap"):
            segs.pop(e["addr"], None)
        elif a == "alloc":
            live[e["addr"]] = e["size"]
        elif a == "free_completed":
            live.pop(e["addr"], None)
    starts = sorted(segs)
    for addr, size in live.items():
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < starts[i] + segs[starts[i]]["size"]:
            segs[starts[i]]["live"] += size
    return list(segs.values())


def print_segments(segs: list[dict[str, Any]], most: int) -> None:
    """Where the reserved-but-free bytes sit: the segments with the most free bytes."""
    for seg in sorted(segs, key=lambda g: g["live"] - g["size"])[:most]:
        print(
            f"   segment {seg['size'] / MiB:8.1f} MiB [stream {seg['stream']:#x}] "
            f"live {seg['live'] / MiB:8.1f}, free {(seg['size'] - seg['live']) / MiB:8.1f}, "
            f"made at {seg['made']} by {seg['by']}"
        )
    free = sum(g["size"] - g["live"] for g in segs)
    print(f"   {len(segs)} segments, {free / MiB:.0f} MiB free in them")


def print_small(segs: list[dict[str, Any]]) -> None:
    """Reserved bytes per stream in small-pool segments (2 MiB: allocations up to 1 MiB) and in
    large ones, and who made each small segment: a pool or a stream with any small tensor costs
    one 2 MiB segment at least."""
    per: dict[tuple[int, bool], list[int]] = collections.defaultdict(lambda: [0, 0])
    for seg in segs:
        row = per[(seg["stream"], seg["size"] == SMALL_SEGMENT)]
        row[0], row[1] = row[0] + 1, row[1] + seg["size"]
    for (stream, small), (n, size) in sorted(per.items()):
        print(f"   {'small' if small else 'large'} segments [stream {stream:#x}]: {n}, {size / MiB:.0f} MiB")
    for seg in segs:
        if seg["size"] == SMALL_SEGMENT:
            print(
                f"   small segment [stream {seg['stream']:#x}] live {seg['live'] / 1024:.1f} KiB, "
                f"made at {seg['made']} by {seg['by']}"
            )


def print_events(trace: list[dict[str, Any]], at: int, around: int) -> None:
    """The allocator events around trace entry ``at`` (what made the peak's segment, and why no
    free block served it)."""
    for i in range(max(0, at - around), min(len(trace), at + around + 1)):
        e = trace[i]
        mark = ">>" if i == at else "  "
        print(
            f"   {mark} {i:6d} {e['action']:16s} {e.get('size', 0) / MiB:9.2f} MiB [stream {e.get('stream', 0):#x}] "
            f"{where(e.get('frames') or [])}"
        )


def report(
    name: str,
    trace: list[dict[str, Any]],
    start: int,
    stop: int,
    base: int,
    top: int,
    segments: int = 0,
    events: int = 0,
    small: bool = False,
) -> dict[str, Any]:
    at, peak = replay(trace, start, stop, base)
    segs = segments_at(trace, at) if segments or small else []
    if segments:
        print_segments(segs, segments)
    if small:
        print_small(segs)
    if events:
        print_events(trace, at, events)
    groups, streams = live_at(trace, at)
    live = sum(groups.values())
    print(f"== {name}: peak reserved {peak / MiB:.0f} MiB over after-init (trace entry {at})")
    for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {v / MiB:9.1f} MiB  {k}")
    reserved_all = sum(streams.values())
    print(
        f"   live {live / MiB:.0f} MiB; reserved {reserved_all / MiB:.0f} MiB by stream: "
        + ", ".join(f"{s:#x} {v / MiB:.0f}" for s, v in streams.items() if v)
    )
    return {"phase": name, "peak_reserved": peak, "live": live, "groups": dict(groups), "streams": streams}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("arm")
    ap.add_argument("mode", choices=sorted(footprint.MODES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--segments", type=int, default=0, metavar="N", help="list the N segments with the most free bytes")
    ap.add_argument(
        "--events", type=int, default=0, metavar="N", help="list the N allocator events on each side of a peak"
    )
    ap.add_argument("--small", action="store_true", help="small vs large segments per stream, each small one's maker")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/peak_breakdown.py needs a GPU", file=sys.stderr)
        return 2
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    marks = mark_phases()
    row = footprint.run_cell(args.workload, args.arm, args.mode, steps=args.steps, small=False)
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(None)
    init = marks["init"]
    print(f"trace entries: after init {init}, build ended {marks.get('build', '-')}, {len(trace)} in all")
    base = replay(trace, init - 1, init, 0)[1] if init else 0
    print(f"{args.workload} {args.arm} {args.mode}: footprint peak {row['peak_reserved'] / MiB:.0f} MiB")
    out = []
    if "build" in marks:
        out.append(report("build", trace, init, marks["build"], base, args.top, args.segments, args.events, args.small))
    out.append(
        report(
            "steps", trace, marks.get("build", init), len(trace), base, args.top, args.segments, args.events, args.small
        )
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cell": [args.workload, args.arm, args.mode], "row": row, "phases": out}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
