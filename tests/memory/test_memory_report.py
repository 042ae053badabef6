"""gograph.memory_report and build observation (logging, progress), on the CPU eager engine.
The CUDA checks (numbers against torch.cuda.memory_allocated) are in test_memory_report_cuda.py."""

from __future__ import annotations

import json
import logging
import sys
import types
import warnings
from typing import ClassVar

import pytest
import torch

import gograph
from gograph.memory import MemoryReport, PassMemory

from helpers import make_mlp

F32 = 4


def _two_layers():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU())
    b = torch.nn.Linear(128, 32)
    x = torch.randn(16, 64, requires_grad=True)
    h = torch.randn(16, 128, requires_grad=True)
    gograph.make_graphed_callables((a, b), ((x,), (h,)), engine="eager")
    return a, b


def test_per_pass_bytes_and_totals():
    a, b = _two_layers()
    r = gograph.memory_report((a, b))
    assert isinstance(r, MemoryReport) and len(r.passes) == 2
    pa, pb = r.passes
    assert isinstance(pa, PassMemory)
    assert (pa.index, pa.label, pa.pass_id, pa.state, pa.engine) == (
        0,
        "Sequential",
        a.forward.pass_id,
        "ready",
        "eager",
    )
    w_a = (128 * 64 + 128) * F32
    assert pa.static_input_bytes == 16 * 64 * F32
    assert pa.param_bytes == w_a
    assert pa.output_bytes == 16 * 128 * F32
    assert pa.grad_output_bytes == 16 * 128 * F32
    assert pa.grad_input_bytes == 16 * 64 * F32 + w_a  # the input's grad and the parameters'
    assert pa.param_grad_bytes == w_a
    assert pa.static_bytes == pa.static_input_bytes + pa.output_bytes + pa.grad_output_bytes + pa.grad_input_bytes
    w_b = (32 * 128 + 32) * F32
    assert (pb.static_input_bytes, pb.param_bytes, pb.output_bytes) == (16 * 128 * F32, w_b, 16 * 32 * F32)
    # Capture order: fwd a, fwd b, bwd b, bwd a -- one pool.
    assert pa.capture_seq == {"forward": 1, "backward": 4}
    assert pb.capture_seq == {"forward": 2, "backward": 3}
    assert pa.graph_nodes == {"forward": None, "backward": None}  # eager: no graphs to count
    assert len(r.pools) == 1 and r.pools[0].pass_ids == [pa.pass_id, pb.pass_id]
    assert r.pools[0].reserved_bytes is None and r.pools[0].active_bytes is None
    assert pa.pool == pb.pool == r.pools[0].pool and pa.pool.startswith("eager/")
    t = r.totals
    assert (t.passes, t.graphs, t.graph_nodes) == (2, 4, None)
    assert t.output_bytes == pa.output_bytes + pb.output_bytes
    assert t.param_bytes == w_a + w_b
    assert t.static_bytes == pa.static_bytes + pb.static_bytes and t.shared_bytes == 0
    assert t.pool_reserved_bytes is None
    assert r.shared == []
    # Build: warmup peak is CUDA-only; the captures are recorded with their order and time.
    assert len(r.builds) == 1 and r.builds[0].warmup is None and r.builds[0].captures == 4
    # Warmup ran (3 iterations per callable) and is part of the build's time.
    assert 0 < r.builds[0].warmup_seconds < r.builds[0].seconds
    assert f"warmup {r.builds[0].warmup_seconds * 1e3:.1f} ms" in str(r)
    assert [c.kind for c in pa.captures] == ["forward", "backward"]
    assert [c.seq for c in pb.captures] == [2, 3]
    assert all(c.seconds >= 0 and c.memory_delta_bytes is None for c in pa.captures + pb.captures)


def test_accepts_modules_callables_and_nested_sequences():
    a, b = _two_layers()
    f = gograph.make_graphed_callables(lambda t: t.cos(), (torch.randn(5),))
    assert [p.label for p in gograph.memory_report(a).passes] == ["Sequential"]
    assert [p.label for p in gograph.memory_report(a.forward).passes] == ["Sequential"]
    assert [p.label for p in gograph.memory_report([a, (b, f), a]).passes] == ["Sequential", "Linear", f.label]
    assert f.label.endswith("<lambda>")
    r = gograph.memory_report((a, b, f))
    assert len(r.pools) == 2 and len(r.builds) == 2
    with pytest.raises(TypeError, match="not graphed"):
        gograph.memory_report(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expected what make_graphed_callables returned"):
        gograph.memory_report(42)
    with pytest.raises(ValueError, match="no graphed callables"):
        gograph.memory_report(())


def test_shared_storages_are_reported_both_ways():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    f = lambda t: t * 2
    g = lambda t: t + 1
    gf, gg = gograph.make_graphed_callables((f, g), ((x,), (x,)))  # one tensor is both static inputs
    r = gograph.memory_report((gf, gg))
    assert len(r.shared) == 1
    s = r.shared[0]
    assert s.nbytes == 4 * 8 * F32 and s.data_ptr == x.untyped_storage().data_ptr()
    assert s.holders == [f"pass {gf.pass_id} ({gf.label}) input[0]", f"pass {gg.pass_id} ({gg.label}) input[0]"]
    (sf,), (sg,) = r.passes[0].shared, r.passes[1].shared
    assert (sf.slot, sf.other_pass_id, sf.other_slot) == ("input[0]", gg.pass_id, "input[0]")
    assert (sg.slot, sg.other_pass_id) == ("input[0]", gf.pass_id)
    assert r.totals.static_input_bytes == 4 * 8 * F32  # counted once
    assert r.totals.shared_bytes == 4 * 8 * F32


def test_views_of_one_storage_count_once_per_pass():
    base = torch.randn(2, 50)

    def split(t):
        return t[0] * 1, t[1] * 1

    graphed = gograph.make_graphed_callables(split, (base,))
    p = gograph.memory_report(graphed).passes[0]
    assert p.static_input_bytes == 2 * 50 * F32
    assert p.output_bytes == 2 * 50 * F32  # two separate result storages


def test_parameter_names_in_slots_and_params_not_reported_as_shared():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    # Two functions closing over one layer's parameters (as per-micro-batch graphs of one layer).
    f1 = layer
    f2 = lambda t: layer(t).relu()
    g1, g2 = gograph.make_graphed_callables((f1, f2), ((x,), (x.detach().clone().requires_grad_(),)))
    r = gograph.memory_report((g1, g2))
    # The layer's parameters are in both passes but are the model's: not reported. What the two
    # backwards do share is their grad-output buffer (one slot: their backward steps differ).
    assert [[h.split()[-1] for h in s.holders] for s in r.shared] == [["grad_output[0]", "grad_output[0]"]]
    model = make_mlp()
    gograph.make_graphed_callables(model, (torch.randn(2, 8),))
    slots = [s for s in model.forward.static_grad_inputs]
    assert len(slots) == 1 + len(list(model.parameters()))
    from gograph.memory import _slots

    names = [name for cat, name, _, is_param, _planned in _slots(model.forward) if cat == "grad_input"]
    assert names[0] == "grad_input[0.weight]"  # the input did not require grad: no grad buffer


def test_reset_pass_reports_state_and_no_bytes():
    a, b = _two_layers()
    b.reset()
    r = gograph.memory_report((a, b))
    pb = r.passes[1]
    assert pb.state == "reset"
    assert pb.static_bytes == 0 and pb.param_bytes == 0
    assert pb.capture_seq == {"forward": 2, "backward": 3}  # the record remembers its order
    assert r.passes[0].state == "ready" and r.passes[0].output_bytes > 0


def test_to_dict_to_json_and_table():
    a, b = _two_layers()
    r = gograph.memory_report((a, b))
    d = r.to_dict()
    assert d["passes"][0]["static_bytes"] == r.passes[0].static_bytes
    assert d["totals"]["output_bytes"] == r.totals.output_bytes
    assert json.loads(r.to_json()) == json.loads(json.dumps(d))
    assert json.loads(r.to_json(indent=None))["pools"][0]["pool"] == r.pools[0].pool
    text = str(r)
    lines = text.splitlines()
    assert lines[0].startswith("gograph memory report: 2 pass(es), 4 graph(s), engine eager, 1 pool(s)")
    assert "Sequential" in text and "Linear" in text and "total (distinct storages)" in text
    assert "no device pool (eager engine)" in text and "warmup peak not measured" in text
    assert "8.0 KiB" in text  # a's output: 16 x 128 float32
    header = next(line for line in lines if line.startswith("#"))
    for col in ("inputs", "params", "outputs", "grad out", "grad in", "nodes f/b/w", "capture ms", "shared"):
        assert col in header


def test_guard_flag_shows_in_report():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 3)
    gograph.make_graphed_callables(m, (torch.randn(2, 3),), debug_replay_order=True)
    r = gograph.memory_report(m)
    assert r.passes[0].replay_order_check and r.builds[0].debug_replay_order
    assert "[guard]" in str(r) and "replay-order guard on" in str(r)


# ---------------------------------------------------------------------------------------------
# Logging and progress
# ---------------------------------------------------------------------------------------------
def test_each_capture_is_logged_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="gograph"):
        _two_layers()
    msgs = [r.getMessage() for r in caplog.records if r.name == "gograph"]
    assert not [m for m in msgs if m.startswith("gograph")]  # the logger's name says it
    captured = [m for m in msgs if m.startswith("captured ")]
    assert len(captured) == 4
    assert captured[0].startswith("captured forward of Sequential (pass ")
    assert "memory n/a (eager engine)" in captured[0] and "(capture #1 in pool eager/" in captured[0]
    assert captured[2].startswith("captured backward of Linear")  # backward bodies named too
    # the eager engine builds passes, no graph
    assert any(m.startswith("built 2 pass(es) (no CUDA graph") and " on the eager engine in " in m for m in msgs)


def test_no_info_logs_at_warning_level(caplog):
    with caplog.at_level(logging.WARNING, logger="gograph"):
        _two_layers()
    assert not [r for r in caplog.records if r.name == "gograph"]


class _FakeBar:
    instances: ClassVar[list[_FakeBar]] = []

    def __init__(self, total=None, desc="", unit="", leave=True):
        self.total, self.n, self.descs, self.postfix, self.closed = total, 0, [desc], [], False
        _FakeBar.instances.append(self)

    def update(self, n=1):
        self.n += n

    def set_description(self, d):
        self.descs.append(d)

    def set_postfix_str(self, s, refresh=True):
        self.postfix.append(s)

    def close(self):
        self.closed = True


def test_progress_bar_with_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=_FakeBar))
    _FakeBar.instances.clear()
    torch.manual_seed(0)
    mods = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    gograph.make_graphed_callables(mods, tuple((torch.randn(2, 4),) for _ in mods), progress=True)
    (bar,) = _FakeBar.instances
    assert bar.total == 6 and bar.n == 6 and bar.closed
    assert bar.descs == ["gograph", "gograph warmup", "gograph capture"]
    assert bar.postfix[0] == "forward Linear" and bar.postfix[-1] == "backward Linear"


def test_progress_bar_closed_when_the_build_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=_FakeBar))
    _FakeBar.instances.clear()

    def boom(t):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        gograph.make_graphed_callables(boom, (torch.randn(2),), progress=True)
    (bar,) = _FakeBar.instances
    assert bar.closed
    from gograph.runtime import _observe

    assert _observe.current_build() is None


def test_progress_without_tqdm_builds_and_says_so_once(monkeypatch):
    from gograph.runtime import _observe

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    monkeypatch.setattr(_observe, "_said_no_tqdm", [])
    with pytest.warns(UserWarning, match="progress=True shows a bar only with tqdm installed"):
        f = gograph.make_graphed_callables(lambda t: t + 1, (torch.randn(2),), progress=True)
    assert torch.equal(f(torch.zeros(2)), torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        gograph.make_graphed_callables(lambda t: t + 2, (torch.randn(2),), progress=True, engine="eager")


def test_build_stats_shared_by_the_callables_of_one_call():
    a, b = _two_layers()
    assert a.forward.build_stats is b.forward.build_stats
    stats = a.forward.build_stats
    assert stats.engine == "eager" and stats.seconds > 0 and stats.warmup is None
    assert [(c.kind, c.seq) for c in stats.captures] == [
        ("forward", 1),
        ("forward", 2),
        ("backward", 3),
        ("backward", 4),
    ]
