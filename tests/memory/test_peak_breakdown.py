"""bench/peak_breakdown.py's reading of an allocator trace (CPU: a synthetic trace in the format
of ``torch.cuda.memory._snapshot()["device_traces"]``): which segments are reserved at a trace
entry, how many bytes are live in each, which entry made each and from where, and where the peak
of reserved memory is."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
peak_breakdown: Any = pytest.importorskip("peak_breakdown")

MiB = 2**20


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


WARMUP = [frame("/x/bench/workloads.py", 139, "forward"), frame("/x/python/gograph/_bodies.py", 83, "__call__")]
BACKWARD: list[dict[str, Any]] = []  # autograd's engine thread: no Python frame


def event(action: str, addr: int, size: int, frames: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 7, "frames": frames or []}


@pytest.fixture
def trace() -> list[dict[str, Any]]:
    """Two segments (64 MiB made by a warmup forward, 32 MiB by a backward), allocations in
    them, one of them freed, then the 32 MiB segment released."""
    return [
        event("segment_alloc", 0x1000_0000, 64 * MiB, WARMUP),  # 0
        event("alloc", 0x1000_0000, 32 * MiB, WARMUP),  # 1
        event("alloc", 0x1200_0000, 16 * MiB, WARMUP),  # 2
        event("segment_alloc", 0x2000_0000, 32 * MiB, BACKWARD),  # 3: the peak (96 MiB reserved)
        event("alloc", 0x2000_0000, 32 * MiB, BACKWARD),  # 4
        event("free_completed", 0x1000_0000, 32 * MiB, WARMUP),  # 5
        event("free_completed", 0x2000_0000, 32 * MiB, BACKWARD),  # 6
        event("segment_free", 0x2000_0000, 32 * MiB, BACKWARD),  # 7
    ]


def test_segments_at_counts_live_bytes_and_who_made_each(trace: list[dict[str, Any]]) -> None:
    segs = {s["addr"]: s for s in peak_breakdown.segments_at(trace, 5)}
    assert set(segs) == {0x1000_0000, 0x2000_0000}
    first, second = segs[0x1000_0000], segs[0x2000_0000]
    assert (first["size"], first["live"], first["made"]) == (64 * MiB, 16 * MiB, 0)  # 32 of its 48 freed
    assert first["by"] == "workloads.py:139 forward < _bodies.py:83 __call__"
    assert (second["size"], second["live"], second["made"], second["by"]) == (32 * MiB, 32 * MiB, 3, "?")


def test_a_released_segment_is_gone(trace: list[dict[str, Any]]) -> None:
    segs = peak_breakdown.segments_at(trace, len(trace) - 1)
    assert [(s["addr"], s["live"]) for s in segs] == [(0x1000_0000, 16 * MiB)]


def test_the_peak_of_reserved_memory(trace: list[dict[str, Any]]) -> None:
    at, reserved = peak_breakdown.replay(trace, 0, len(trace), 0)
    assert (at, reserved) == (3, 96 * MiB)
    at, reserved = peak_breakdown.replay(trace, 0, len(trace), 64 * MiB)  # over a baseline
    assert (at, reserved) == (3, 32 * MiB)


def test_made_by_names_the_gograph_frame_only_when_it_is_not_the_innermost() -> None:
    assert peak_breakdown.made_by(WARMUP) == "workloads.py:139 forward < _bodies.py:83 __call__"
    own = [frame("/x/python/gograph/_captures.py", 161, "_grad_output_buffer")]
    assert peak_breakdown.made_by(own) == "_captures.py:161 _grad_output_buffer"
    assert peak_breakdown.made_by([]) == "?"


def test_small_segments_are_counted_per_stream_with_their_maker(capsys: pytest.CaptureFixture[str]) -> None:
    small = [frame("/x/python/gograph/_warmup.py", 184, "<genexpr>")]
    trace = [
        event("segment_alloc", 0x1000_0000, 20 * MiB, WARMUP),
        event("segment_alloc", 0x3000_0000, 2 * MiB, small),
        event("alloc", 0x3000_0000, 512, small),
        {**event("segment_alloc", 0x4000_0000, 2 * MiB), "stream": 0},
    ]
    peak_breakdown.print_small(peak_breakdown.segments_at(trace, len(trace) - 1))
    lines = capsys.readouterr().out.splitlines()
    assert "small segments [stream 0x0]: 1, 2 MiB" in lines[0]
    assert "large segments [stream 0x7]: 1, 20 MiB" in lines[1]
    assert "small segments [stream 0x7]: 1, 2 MiB" in lines[2]
    assert "[stream 0x7] live 0.5 KiB, made at 1 by _warmup.py:184 <genexpr>" in lines[3]
    assert "[stream 0x0] live 0.0 KiB, made at 3 by ?" in lines[4]
