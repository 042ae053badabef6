"""The precise shared-pool checker (debug mode; the Go rules are internal/recarve's tests).

* what each graph writes and reads, derived from a capture's allocator history (synthetic here;
  tests/guard/test_recarve_cuda.py records real ones on the GPU);
* the core's wiring end to end on the eager engine: two builds sharing a pool, guarded, with
  specs given -- an order the capture-order rule refuses passes when the graphs' memory is
  disjoint, and a real overwrite of memory another graph still needs is refused before the
  replay runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import gograph
from gograph.core import _core
from gograph.core._kinds import CaptureOp
from gograph.core._wire import Op
from gograph.probes import _recarve
from gograph.replay._handouts import WATCH


def _state(index: int, pass_id: int, **kw: Any) -> Any:
    base = {"index": index, "pass_id": pass_id, "spec": SimpleNamespace(label=f"L{index}"), "flat_args": (),
            "chained_inputs": set(), "chained_grad_outputs": set(), "static_grad_outputs": (), "released": set(),
            "static_outputs": (), "static_grad_inputs": (), "seq": [1, 1, 1]}  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _at(addr: int, nbytes: int) -> torch.Tensor:
    """A stand-in whose storage reports ``addr`` and ``nbytes`` (specs read only those)."""
    storage = SimpleNamespace(data_ptr=lambda: addr, nbytes=lambda: nbytes)
    return SimpleNamespace(untyped_storage=lambda: storage)  # type: ignore[return-value]


def test_specs_from_a_capture_trace() -> None:
    """Two chained layers captured F0 F1 B1 X1 B0 X0: B0's capture re-carves what F1 saved."""
    ops = [
        Op(CaptureOp("F"), 0),
        Op(CaptureOp("F"), 1),
        Op(CaptureOp("B"), 1),
        Op(CaptureOp("X"), 1),
        Op(CaptureOp("B"), 0),
        Op(CaptureOp("X"), 0),
    ]
    states = [
        _state(0, 10, chained_grad_outputs={0}, static_grad_outputs=(_at(0x3000, 64),)),
        _state(1, 11, chained_inputs={0}, flat_args=(_at(0x1000, 64),)),
    ]
    rec = _recarve.CaptureRecorder(torch.device("cuda", 0))
    rec.saved = {0: [(0x1000, 64)], 1: [(0x1000, 64), (0x2000, 64)]}
    rec.entries = [
        {"action": "alloc", "addr": 0x1000, "size": 64},  # F0: its output (saved by F1 too)
        {"action": "alloc", "addr": 0x2000, "size": 64},  # F1: what it saves
        {"action": "alloc", "addr": 0x3000, "size": 64}, {"action": "free_completed", "addr": 0x2000, "size": 64},  # B1
        {"action": "alloc", "addr": 0x2000, "size": 64},  # B0: re-carves F1's saved block
    ]  # fmt: skip
    rec.marks = [0, 1, 2, 4, 4, 5, 5]
    got = _recarve.specs(rec, ops, states)
    assert got[(10, 0)] == {"name": 'pass 10 ("L0") forward', "writes": [(0x1000, 0x1040)], "reads": [],
                            "handouts": []}  # fmt: skip
    assert got[(11, 0)]["reads"] == [(0x1000, 0x1040, (10, 0), "its chained input 0")]
    assert got[(11, 1)]["writes"] == [(0x3000, 0x3040)]
    assert got[(11, 1)]["reads"] == [
        (0x1000, 0x1040, (10, 0), "what pass 11's forward saved"),
        (0x2000, 0x2040, (11, 0), "what pass 11's forward saved"),
    ]
    assert got[(10, 1)]["writes"] == [(0x2000, 0x2040)]
    # Its chained grad output is no read: a replay copies the incoming grad in unless it is B1's.
    assert got[(10, 1)]["reads"] == [(0x1000, 0x1040, (10, 0), "what pass 10's forward saved")]
    assert all(not s["handouts"] for s in got.values())  # nothing was released


def test_a_weight_gradient_reads_only_what_its_backward_kept() -> None:
    """F0 B0 W0: the backward frees one saved block (autograd's) and allocates at its address;
    the weight-gradient graph reads the block its work kept and the incoming grad, not the
    backward's new block as if the forward had saved it."""
    ops = [Op(CaptureOp("F"), 0), Op(CaptureOp("B"), 0), Op(CaptureOp("W"), 0)]
    st = _state(0, 7, static_grad_outputs=(_at(0x3000, 64),))
    rec = _recarve.CaptureRecorder(torch.device("cuda", 0))
    rec.saved = {0: [(0x1000, 256), (0x2000, 64)]}
    rec.entries = [
        {"action": "alloc", "addr": 0x1000, "size": 256}, {"action": "alloc", "addr": 0x2000, "size": 64},  # F0
        {"action": "alloc", "addr": 0x3000, "size": 64},  # B0: the incoming grad's buffer, then its work
        {"action": "free_completed", "addr": 0x1000, "size": 256}, {"action": "alloc", "addr": 0x1000, "size": 32},
    ]  # fmt: skip
    rec.marks = [0, 2, 5, 5]
    got = _recarve.specs(rec, ops, [st])
    assert [r[:3] for r in got[(7, 1)]["reads"]] == [(0x1000, 0x1100, (7, 0)), (0x2000, 0x2040, (7, 0))]
    assert (0x1000, 0x1020) in got[(7, 1)]["writes"]
    assert [r[:3] for r in got[(7, 2)]["reads"]] == [(0x2000, 0x2040, (7, 0)), (0x3000, 0x3040, (7, 1))]


def test_a_graph_not_captured_has_no_spec() -> None:
    """A backward no output needed was not captured: the core has no graph to check for it."""
    ops = [Op(CaptureOp("F"), 0), Op(CaptureOp("B"), 0)]
    rec = _recarve.CaptureRecorder(torch.device("cuda", 0))
    rec.entries, rec.marks = [{"action": "alloc", "addr": 0x100, "size": 8}], [0, 1, 1]
    got = _recarve.specs(rec, ops, [_state(0, 3, seq=[1, 0, 0])])
    assert list(got) == [(3, 0)]


def test_released_buffers_are_handouts() -> None:
    """A released output is its forward's hand-out, a released input grad its backward's; a
    released parameter grad is not (it reaches .grad owned or lent: LentGrads watches it)."""
    ops = [Op(CaptureOp("F"), 0), Op(CaptureOp("B"), 0)]
    st = _state(0, 12, released={("o", 1), ("d", 0), ("p", 1)}, static_outputs=(_at(0x100, 8), _at(0x200, 16)),
                static_grad_inputs=(_at(0x300, 32), _at(0x400, 8)))  # fmt: skip
    rec = _recarve.CaptureRecorder(torch.device("cuda", 0))
    rec.entries, rec.marks = [], [0, 0, 0]
    got = _recarve.specs(rec, ops, [st])
    assert got[(12, 0)]["handouts"] == [(0x200, 0x210, 1, "output 1")]
    assert got[(12, 1)]["handouts"] == [(0x300, 0x320, 0, "the grad of input 0")]


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())


def _build(pool: Any, seed: int) -> torch.nn.Module:
    return gograph.make_graphed_callables(
        _module(seed), (torch.randn(4, 8, requires_grad=True),), engine="eager", pool=pool, debug_replay_order=True
    )


def _spec(name: str, writes: list[tuple[int, int]], reads: list[tuple[int, int, int, int]] = ()) -> str:
    lines = [
        f"name {name}",
        *(f"w {a} {b}" for a, b in writes),
        *(f"r {a} {b} {p} {k} its saved" for a, b, p, k in reads),
    ]
    return "\n".join(lines)


def _interleaved(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """A's forward, B's forward and backward, then A's backward."""
    x = torch.randn(4, 8, requires_grad=True)
    ya = a(x)
    b(x).sum().backward()
    ya.sum().backward()


def _pair() -> tuple[Any, Any]:
    """Two builds sharing one pool, guarded."""
    pool = gograph.graph_pool_handle()
    return _build(pool, 0), _build(pool, 1)


def test_capture_order_rule_refuses_interleaving() -> None:
    a, b = _pair()
    with pytest.raises(RuntimeError, match="refusing to replay the forward"):
        _interleaved(a, b)
    a.reset()
    b.reset()


def test_disjoint_memory_interleaves() -> None:
    a, b = _pair()
    pa, pb = a.forward.pass_id, b.forward.pass_id
    _core.set_replay_recarve_spec(pa, 0, _spec("A forward", [(0, 100)]))
    _core.set_replay_recarve_spec(pa, 1, _spec("A backward", [(100, 150)], [(0, 100, pa, 0)]))
    _core.set_replay_recarve_spec(pb, 0, _spec("B forward", [(200, 300)]))
    _core.set_replay_recarve_spec(pb, 1, _spec("B backward", [(300, 350)], [(200, 300, pb, 0)]))
    for _ in range(3):
        _interleaved(a, b)
        _interleaved(b, a)
    a.reset()
    b.reset()


def test_an_overwrite_of_needed_memory_is_refused() -> None:
    a, b = _pair()
    pa, pb = a.forward.pass_id, b.forward.pass_id
    _core.set_replay_recarve_spec(pa, 0, _spec("A forward", [(0, 100)]))
    _core.set_replay_recarve_spec(pa, 1, _spec("A backward", [(100, 150)], [(0, 100, pa, 0)]))
    _core.set_replay_recarve_spec(pb, 0, _spec("B forward", [(50, 120)]))  # B's capture re-carved A's
    _core.set_replay_recarve_spec(pb, 1, _spec("B backward", [(300, 350)], [(50, 120, pb, 0)]))
    x = torch.randn(4, 8, requires_grad=True)
    a(x).sum().backward()  # A alone, then B alone: fine
    b(x).sum().backward()
    ya = a(x)
    with pytest.raises(RuntimeError, match=r"B forward is about to overwrite pool bytes \[0x32, 0x64\), which hold "
                       r"the content A forward wrote and A backward still needs.*pytorch#166975"):  # fmt: skip
        b(x)
    ya.sum().backward()  # A's backward still runs: the refused replay changed nothing
    a.reset()
    b.reset()


def _handout_pair() -> tuple[Any, Any]:
    """A's forward hands out its output at [0, 40) of the pool, pool-planned; B's forward capture
    re-carved [10, 30) of it (A's backward reads only [40, 100), what its forward saved)."""
    a, b = _pair()
    pa, pb = a.forward.pass_id, b.forward.pass_id
    _recarve.send({
        (pa, 0): {"name": "A forward", "writes": [(0, 100)], "reads": [], "handouts": [(0, 40, 0, "output 0")]},
        (pa, 1): {"name": "A backward", "writes": [(200, 250)], "reads": [(40, 100, (pa, 0), "its saved")]},
        (pb, 0): {"name": "B forward", "writes": [(10, 30), (300, 400)], "reads": []},
        (pb, 1): {"name": "B backward", "writes": [(500, 550)], "reads": [(300, 400, (pb, 0), "its saved")]},
    })  # fmt: skip
    return a, b


def test_a_held_handout_overwritten_by_another_graph_raises_on_read() -> None:
    a, b = _handout_pair()
    twin = _module(0)
    x = torch.randn(4, 8, requires_grad=True)
    ya = a(x)
    assert torch.equal(ya, twin(x))  # readable until another graph overwrites it
    ya.sum().backward()
    kept, view, cloned = ya, ya[1:], ya.clone()
    b(x).sum().backward()  # B's replay overwrites A's output
    for t in (kept, view):
        match = (r"this tensor is output 0 of A forward, a pool-planned buffer, and B forward's replay overwrote"
                 r" it \(pool bytes \[0xa, 0x1e\).*clone a returned tensor")  # fmt: skip
        with pytest.raises(RuntimeError, match=match):
            t.sum()
    assert torch.equal(cloned, twin(x))  # what was read or cloned in time stays right
    assert len(WATCH) == 0
    a.reset()
    b.reset()


def test_handouts_read_in_time_pass() -> None:
    a, b = _handout_pair()
    twin = _module(0)
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        yb = b(x)  # B first, then A: A's output is fresh
        ya = a(x)
        yb.sum().backward()
        ya.sum().backward()
        assert torch.equal(ya, twin(x))
        ya = a(x)  # a new replay of A hands out a new tensor; the old one was overwritten by A itself
        ya.sum().backward()
        assert torch.equal(ya, twin(x))
        del ya  # nothing holds it: B's replay has nothing to poison
        b(x).sum().backward()
    assert len(WATCH) == 0
    y = a(x)
    a.reset()
    b.reset()
    assert len(WATCH) == 0
    with pytest.raises(RuntimeError, match="handed out .*was reset since"):  # its memory went with the pass
        y.sum()


def test_a_watched_graph_the_core_forgot_is_dropped() -> None:
    """A graph known to the watch whose pass the core no longer has does not break replays."""
    a, b = _handout_pair()
    WATCH.register((987654321, 0), [0])  # no such pass in the core
    x = torch.randn(4, 8, requires_grad=True)
    a(x).sum().backward()
    assert not WATCH.watches(987654321, 0)
    a.reset()
    b.reset()


def test_a_hold_is_left_out_of_the_writes_only_where_it_was_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA engine holds free blocks (allocations no kernel writes) while a capture runs: the
    recorder marks those allocations by their place in the history, so a later capture's block at
    a once-held address is a write again (held addresses kept for the process made a backward's
    read of what its forward saved look unwritten, on the GPU)."""
    history: list[dict[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(_recarve.CaptureRecorder, "_device_entries", lambda self: list(history))
    history.append({"action": "alloc", "addr": 0x9000, "size": 64})  # before the recording
    with _recarve.CaptureRecorder(torch.device("cuda", 0)) as rec:
        history.append({"action": "alloc", "addr": 0x1000, "size": 64})  # F0's output
        position = gograph.runtime.engines.HELD.position
        assert position is not None
        start = position()
        history.append({"action": "alloc", "addr": 0x2000, "size": 64})  # held by F0's capture
        gograph.runtime.engines.HELD.spans.append((start, position()))
        history.append({"action": "free_completed", "addr": 0x2000, "size": 64})  # the hold released
        history.append({"action": "alloc", "addr": 0x2000, "size": 64})  # F1: what it saves
    assert (
        gograph.runtime.engines.HELD.position is None and not gograph.runtime.engines.HELD.spans
    )  # nothing outside a recording
    assert [bool(e.get("held")) for e in rec.entries] == [False, True, False, False]
    rec.marks = [0, 3, 4]
    got = _recarve.specs(rec, [Op(CaptureOp("F"), 0), Op(CaptureOp("F"), 1)], [_state(0, 10), _state(1, 11)])
    assert got[(10, 0)]["writes"] == [(0x1000, 0x1040)]
    assert got[(11, 0)]["writes"] == [(0x2000, 0x2040)]
