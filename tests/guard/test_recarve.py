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
from gograph import _core, _plan, _recarve


def _state(index: int, pass_id: int, **kw: Any) -> Any:
    base = {"index": index, "pass_id": pass_id, "spec": SimpleNamespace(label=f"L{index}"), "flat_args": (),
            "chained_inputs": set(), "chained_grad_outputs": set(), "static_grad_outputs": ()}  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _at(addr: int, nbytes: int) -> torch.Tensor:
    """A stand-in whose storage reports ``addr`` and ``nbytes`` (specs read only those)."""
    storage = SimpleNamespace(data_ptr=lambda: addr, nbytes=lambda: nbytes)
    return SimpleNamespace(untyped_storage=lambda: storage)  # type: ignore[return-value]


def test_specs_from_a_capture_trace() -> None:
    """Two chained layers captured F0 F1 B1 X1 B0 X0: B0's capture re-carves what F1 saved."""
    ops = [_plan.Op("F", 0), _plan.Op("F", 1), _plan.Op("B", 1), _plan.Op("X", 1), _plan.Op("B", 0), _plan.Op("X", 0)]
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
    assert got[(10, 0)] == {"name": 'pass 10 ("L0") forward', "writes": [(0x1000, 0x1040)], "reads": []}
    assert got[(11, 0)]["reads"] == [(0x1000, 0x1040, (10, 0), "its chained input 0")]
    assert got[(11, 1)]["writes"] == [(0x3000, 0x3040)]
    assert got[(11, 1)]["reads"] == [
        (0x1000, 0x1040, (10, 0), "what pass 11's forward saved"),
        (0x2000, 0x2040, (11, 0), "what pass 11's forward saved"),
    ]
    assert got[(10, 1)]["writes"] == [(0x2000, 0x2040)]
    # Its chained grad output is no read: a replay copies the incoming grad in unless it is B1's.
    assert got[(10, 1)]["reads"] == [(0x1000, 0x1040, (10, 0), "what pass 10's forward saved")]


def _build(pool: Any, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    return gograph.make_graphed_callables(
        m, (torch.randn(4, 8, requires_grad=True),), engine="eager", pool=pool, debug_replay_order=True
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
