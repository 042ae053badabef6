"""``backward_dw()`` leaves ``.grad`` / ``.main_grad`` as eager's ``backward_dw()`` does, whatever
the caller did to them since graphing.

A weight-gradient graph adds into the tensor its capture added into (or writes a buffer of its
own where the module assigned a new tensor). The caller may since have set the slot to None
(``zero_grad()``'s default), pre-initialised it, replaced it, or kept a reference to a ``.grad``
it dropped. Every test here runs one program eagerly and graphed and compares, bitwise, what the
program observes: each ``.grad`` after each ``backward_dw()`` and ``zero_grad()``, whether it is
the same tensor as before (and then at the same address), the parameters after each step; and
that a ``.grad`` the program dropped or that was replaced keeps its values, as eagerly nothing
writes it again.

Modules (``te_models``): ``add_or_assign`` assigns ``weight.grad`` when it is None and adds into it
otherwise; ``assign`` always assigns (TransformerEngine's Linear without
``fuse_wgrad_accumulation``); ``add`` adds into a ``weight.grad`` that must exist (eagerly None
fails, so it runs only where the program keeps a ``.grad``).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import gograph
from gograph import megatron_order

from te_models import AddOrAssignLinear, AssignLinear, DelayedLinear, run_pipeline

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
F = 8
PATTERNS: dict[str, type[DelayedLinear]] = {
    "add_or_assign": AddOrAssignLinear,
    "assign": AssignLinear,
    "add": DelayedLinear,
}


@dataclass(eq=False)
class Observed:
    """What a program saw of ``weight.grad``: per event (label, values or None, whether it is the
    tensor it was before the event), and the violations of the two eager rules every run must
    keep: a ``.grad`` that stays the same tensor keeps its address, and one that left the slot
    (dropped, replaced) keeps its values. With ``hold`` the program holds every ``.grad`` it saw
    (so gograph sees holders of dropped grads); without, weak references only."""

    param: torch.nn.Parameter
    hold: bool
    events: list[tuple[str, torch.Tensor | None, bool]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    held: list[tuple[torch.Tensor, list[torch.Tensor | None]]] = field(default_factory=list)
    _before: tuple[Any, int, torch.Tensor | None] = (None, 0, None)

    def before(self) -> None:
        g = self.param.grad
        if g is None:
            self._before = (None, 0, None)
            return
        self._before = (weakref.ref(g), g.data_ptr(), g.detach().clone())
        if self.hold and not any(t is g for t, _ in self.held):
            self.held.append((g, [None]))

    def after(self, label: str) -> None:
        ref, ptr, values = self._before
        g = self.param.grad
        same = ref is not None and ref() is g
        if same and g is not None and g.data_ptr() != ptr:
            self.violations.append(f"{label}: .grad is the same tensor but moved")
        for t, frozen in self.held:
            if t is not g and frozen[0] is None and ref is not None and ref() is t:
                frozen[0] = values  # it left the slot in this event: eager never writes it again
            if frozen[0] is not None and not torch.equal(t, frozen[0]):
                self.violations.append(f"{label}: a .grad the program dropped (or that was replaced) changed")
        self.events.append((label, None if g is None else g.detach().clone(), same))


def _dense_backward(y: torch.Tensor) -> None:
    """``y.sum().backward()`` with a dense incoming grad: ``sum()``'s is expanded, which eager's
    matmul reads with stride 0 and a CUDA graph from its dense static buffer, so cuBLAS picks
    another kernel and the weight grads differ in their last bits on a GPU."""
    y.backward(torch.ones_like(y))


def _batches(n: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(4, F, generator=gen).to(device).requires_grad_() for _ in range(n)]


def _train(
    call: Callable[[torch.Tensor], torch.Tensor],
    dw: Callable[[], None],
    mod: DelayedLinear,
    xs: Sequence[torch.Tensor],
    micro: int,
    set_to_none: bool,
    hold: bool,
) -> tuple[Observed, list[torch.Tensor]]:
    """SGD over ``len(xs) // micro`` steps of ``micro`` micro-batches (forward, backward,
    ``backward_dw()``), then ``zero_grad(set_to_none)``; returns what it observed and the
    parameters after each step."""
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    seen, params = Observed(mod.weight, hold), []
    it = iter(xs)
    for step in range(len(xs) // micro):
        for mb in range(micro):
            call(next(it)).square().sum().backward()
            seen.before()
            dw()
            seen.after(f"step {step} micro-batch {mb}: backward_dw()")
        opt.step()
        params += [p.detach().clone() for p in mod.parameters()]
        seen.before()
        opt.zero_grad(set_to_none=set_to_none)
        seen.after(f"step {step}: zero_grad(set_to_none={set_to_none})")
    return seen, params


def _compare(got: tuple[Observed, list[torch.Tensor]], want: tuple[Observed, list[torch.Tensor]]) -> None:
    (g, gp), (w, wp) = got, want
    assert w.violations == [], "the eager run itself broke a rule it states"
    assert g.violations == []
    assert len(g.events) == len(w.events)
    for (label, a, same_a), (_, b, same_b) in zip(g.events, w.events):
        assert (a is None) == (b is None), f"{label}: .grad is {'None' if a is None else 'a tensor'} graphed"
        assert a is None or torch.equal(a, b), f"{label}: .grad differs from eager"  # type: ignore[arg-type]
        assert same_a == same_b, f"{label}: .grad is {'the same' if same_a else 'another'} tensor graphed, not eagerly"
    assert all(torch.equal(a, b) for a, b in zip(gp, wp)), "parameters differ from eager"


def _cases() -> list[Any]:
    out = []
    for pattern in PATTERNS:
        for pre in ("none", "before", "after"):
            for set_to_none in (True, False):
                if pattern == "add" and (pre == "none" or set_to_none):
                    continue  # eagerly it fails on a None .grad
                out.append((pattern, pre, set_to_none))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("pattern", "pre", "set_to_none"), _cases())
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("hold", [False, True], ids=["dropped", "held"])
def test_backward_dw_trains_like_eager_in_every_grad_state(
    device: str, pattern: str, pre: str, set_to_none: bool, micro: int, hold: bool, no_tf32: Any
) -> None:
    """``pre``: ``weight.grad`` None throughout, zeros assigned before graphing, or zeros assigned
    after graphing (to both the graphed module and its eager twin; for ``add``, which needs one to
    graph, replacing the one assigned before)."""
    mod = PATTERNS[pattern](F, seed=5).to(device)
    ref = copy.deepcopy(mod)
    if pre == "before" or pattern == "add":
        mod.weight.grad = torch.zeros_like(mod.weight)
    graphed = gograph.make_graphed_callables(mod, (torch.randn(4, F, device=device, requires_grad=True),))
    assert graphed.forward._wgrad is not None
    for m in (mod, ref) if pre == "after" else (ref,) if pre == "before" else ():
        m.weight.grad = torch.zeros_like(m.weight)
    assert (mod.weight.grad is None) == (ref.weight.grad is None), "graphing changed .grad"
    xs = _batches(3 * micro, device)
    got = _train(graphed, graphed.backward_dw, mod, xs, micro, set_to_none, hold)
    want = _train(ref, ref.backward_dw, ref, xs, micro, set_to_none, hold)
    _compare(got, want)
    graphed.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", ["add_or_assign", "assign"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("hold", [False, True], ids=["dropped", "held"])
def test_without_warmup_a_grad_none_at_capture(
    device: str, pattern: str, set_to_none: bool, micro: int, hold: bool, no_tf32: Any
) -> None:
    """Graphed without warmup while ``.grad`` is None, the capture is shown a zero ``.grad`` (made
    before it, given back after), so it sees what the module does to an existing one: add into
    it (the graph's target) or replace it (the graph's own buffer). Every state is then served as
    with warmup, including a module that always assigns and a program that keeps its grads."""
    mod = PATTERNS[pattern](F, seed=6).to(device)
    ref = copy.deepcopy(mod)
    graphed = gograph.make_graphed_callables(
        mod, (torch.randn(4, F, device=device, requires_grad=True),), num_warmup_iters=0
    )
    assert mod.weight.grad is None
    xs = _batches(3 * micro, device)
    got = _train(graphed, graphed.backward_dw, mod, xs, micro, set_to_none, hold)
    want = _train(ref, ref.backward_dw, ref, xs, micro, set_to_none, hold)
    _compare(got, want)
    graphed.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", ["add_or_assign", "assign"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("warmup", [0, 1])
def test_frozen_weight_whose_grad_backward_dw_writes(
    device: str, pattern: str, set_to_none: bool, warmup: int, no_tf32: Any
) -> None:
    """A frozen weight (``requires_grad=False``) whose ``.grad`` the module's ``backward_dw()``
    writes anyway, and an optimizer over the trainable parameters only, so ``zero_grad()`` never
    touches that ``.grad``: eagerly an assigning module replaces it at every call, an
    add-or-assign one adds into it. Without warmup the capture is shown a zero ``.grad`` for the
    frozen weight too, so the assigning module is not taken for one that adds (which summed every
    step's gradient into the one tensor)."""
    mod = PATTERNS[pattern](F, seed=7).to(device)
    mod.weight.requires_grad_(False)
    ref = copy.deepcopy(mod)
    graphed = gograph.make_graphed_callables(
        mod, (torch.randn(4, F, device=device, requires_grad=True),), num_warmup_iters=warmup
    )
    for m in (mod, ref):
        m.weight.grad = None  # as eagerly before the first step, whatever the warmup left
    got, want = [], []
    for out, call, dw, m in ((got, graphed, graphed.backward_dw, mod), (want, ref, ref.backward_dw, ref)):
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        for x in _batches(3, device):
            _dense_backward(call(x))
            dw()
            out += [m.weight.grad.clone(), m.bias.grad.clone()]  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            out.append(m.bias.detach().clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    graphed.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", ["add_or_assign", "assign"])
def test_the_issue_minimal_form(device: str, pattern: str, no_tf32: Any) -> None:
    """``.grad`` None when graphing; ``zero_grad()`` (set_to_none=True, torch's default) after
    every step: the graphed module trains bitwise as its eager twin, and the weight-gradient graph
    keeps writing the one tensor it captured (lent back to ``.grad`` when the slot is empty)."""
    m = PATTERNS[pattern](F, seed=1).to(device)
    ref = copy.deepcopy(m)
    m.weight.grad = None
    g = gograph.make_graphed_callables(m, (torch.randn(4, F, device=device, requires_grad=True),))
    opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in (m, ref)]
    for x in _batches(4, device):
        for call, dw in ((g, g.backward_dw), (ref, ref.backward_dw)):
            _dense_backward(call(x))
            dw()
        assert torch.equal(m.weight.grad, ref.weight.grad)  # type: ignore[arg-type]
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    g.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_kept_target_replays_alone(device: str, no_tf32: Any) -> None:
    """A ``.grad`` kept in place costs the replay and nothing else: ``backward_dw()`` runs no
    operation of its own beyond the module's work (on the eager engine, which re-runs that work,
    the same operators as the eager module's ``backward_dw()``)."""
    mod = AddOrAssignLinear(F, seed=2).to(device)
    ref = copy.deepcopy(mod)
    graphed = gograph.make_graphed_callables(mod, (torch.randn(4, F, device=device, requires_grad=True),))
    x = _batches(1, device)[0]
    counts = []
    for call, dw in ((graphed, graphed.backward_dw), (ref, ref.backward_dw)):
        _dense_backward(call(x))  # the first, from None: the graph's target zeroed and lent to .grad
        dw()
        _dense_backward(call(x))
        with _Ops() as ops:
            dw()  # the second: .grad kept, the tensor the graph adds into
        counts.append(ops.names)
    if device == "cpu":
        assert counts[0] == counts[1], "the kept .grad cost operations of gograph's own"
    else:
        assert all(not name.startswith(("aten::zero", "aten::clone", "aten::copy")) for name in counts[0])
    assert torch.equal(mod.weight.grad, ref.weight.grad)  # type: ignore[arg-type]
    graphed.reset()


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten operators dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func.name()))
        return func(*args, **(kwargs or {}))


def _order(chunks: int, micro: int) -> list[float]:
    order: list[float] = []
    for e in megatron_order(2, 0, chunks, micro):  # each backward followed by its weight-gradient entry
        order.append(e)
        if e < 0:
            order.append(e - 0.5)
    return order


def _pipeline(
    calls: Callable[[int, torch.Tensor], torch.Tensor],
    dw: Callable[[int], None],
    mods: Sequence[DelayedLinear],
    order: list[float],
    micro: int,
    steps: int,
    set_to_none: bool,
    device: str,
) -> list[torch.Tensor]:
    """``steps`` iterations of the schedule (a microbatch's weight gradients accumulate into the
    step's ``.grad``), an SGD step and ``zero_grad`` after each; the grads before each step and
    the parameters after."""
    chunks = len(mods)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        inputs = {
            (c, m): torch.randn(4, F, generator=gen).to(device).requires_grad_()
            for c in range(chunks)
            for m in range(micro)
        }
        dys = {(c, m): torch.randn(4, F, generator=gen).to(device) for c in range(chunks) for m in range(micro)}
        run_pipeline(order, [1] * chunks, micro, calls, inputs, dys, chain=True, wgrad=dw)
        out += [m.weight.grad.clone() for m in mods]  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        out += [p.detach().clone() for m in mods for p in m.parameters()]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", ["add_or_assign", "assign"])
@pytest.mark.parametrize("share", [False, True], ids=["per_microbatch", "share_microbatch_graphs"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_order_with_weight_gradient_entries(
    device: str, pattern: str, share: bool, set_to_none: bool, no_tf32: Any
) -> None:
    """An interleaved ``_order`` with a weight-gradient entry after every backward: each
    microbatch's ``backward_dw()`` (a graph of its own, or one set of graphs shared by the
    microbatches never in flight together) accumulates into the step's ``.grad``, from None."""
    chunks, micro = 2, 4
    mods = [PATTERNS[pattern](F, seed=s).to(device) for s in range(chunks)]
    eager = copy.deepcopy(mods)
    order = _order(chunks, micro)
    samples = tuple((torch.randn(4, F, device=device, requires_grad=True),) for _ in range(chunks * micro))
    graphed = gograph.make_graphed_callables(
        tuple(mods), samples, _order=order, _num_layers_per_chunk=[1] * chunks, share_microbatch_graphs=share
    )
    assert all(m.weight.grad is None for m in mods), "graphing left a .grad behind"
    got = _pipeline(
        lambda p, x: graphed[p](x), lambda p: graphed[p].backward_dw(), mods, order, micro, 3, set_to_none, device
    )
    want = _pipeline(
        lambda p, x: eager[p // micro](x),
        lambda p: eager[p // micro].backward_dw(),
        eager,
        order,
        micro,
        3,
        set_to_none,
        device,
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for g in graphed:
        g.reset()


class MainGradLinear(DelayedLinear):
    """Megatron-LM's pattern: ``backward_dw()`` adds into ``weight.main_grad``, a persistent fp32
    buffer (here a plain attribute of the parameter)."""

    def backward_dw(self) -> None:
        x, dy = self._stash.pop(0)
        with torch.no_grad():
            self.weight.main_grad.add_(dy.reshape(-1, F).t() @ x.reshape(-1, F))


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_replaced_or_none_trains_like_eager(device: str, no_tf32: Any) -> None:
    """``.main_grad`` replaced by a new buffer (a checkpoint load, a rebuilt bucket): the gradient
    lands in the new buffer, the old one keeps its values."""
    mod = MainGradLinear(F, seed=4).to(device)
    mod.weight.main_grad = torch.zeros_like(mod.weight)  # type: ignore[attr-defined]
    ref = copy.deepcopy(mod)
    ref.weight.main_grad = torch.zeros_like(ref.weight)  # type: ignore[attr-defined]
    graphed = gograph.make_graphed_callables(mod, (torch.randn(4, F, device=device, requires_grad=True),))
    captured = mod.weight.main_grad  # type: ignore[attr-defined]
    for step, x in enumerate(_batches(3, device)):
        for m in (mod, ref):
            m.weight.main_grad = torch.full_like(m.weight, float(step))  # type: ignore[attr-defined]
        before = captured.clone()
        for call, dw in ((graphed, graphed.backward_dw), (ref, ref.backward_dw)):
            _dense_backward(call(x))
            dw()
        assert torch.equal(mod.weight.main_grad, ref.weight.main_grad)  # type: ignore[attr-defined]
        assert torch.equal(captured, before), "the buffer the caller replaced changed"
    graphed.reset()


class MainGradAccum(DelayedLinear):
    """``backward_dw()`` creates ``weight.main_grad`` when the parameter has none and adds into it
    otherwise."""

    def backward_dw(self) -> None:
        x, dy = self._stash.pop(0)
        with torch.no_grad():
            dw = dy.reshape(-1, F).t() @ x.reshape(-1, F)
            if getattr(self.weight, "main_grad", None) is None:
                self.weight.main_grad = dw  # type: ignore[attr-defined]
            else:
                self.weight.main_grad.add_(dw)  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drop", ["delattr", "none", "keep"])
def test_main_grad_created_by_a_capture_without_warmup(device: str, drop: str, no_tf32: Any) -> None:
    """No ``.main_grad`` when graphed without warmup (no zero tensor can be shown: its shape and
    dtype are the module's business): the capture sees the module create one, the graph writes
    a buffer of its own, and an absent or None ``.main_grad`` gets a copy of the gradient, a kept
    one the gradient added into it, as eagerly."""
    mod = MainGradAccum(F, seed=8).to(device)
    ref = copy.deepcopy(mod)
    graphed = gograph.make_graphed_callables(
        mod, (torch.randn(4, F, device=device, requires_grad=True),), num_warmup_iters=0
    )
    assert not hasattr(mod.weight, "main_grad"), "graphing left a main_grad behind"
    for step, x in enumerate(_batches(4, device)):
        for call, dw, m in ((graphed, graphed.backward_dw, mod), (ref, ref.backward_dw, ref)):
            _dense_backward(call(x))
            dw()
            if drop == "delattr" and step % 2:
                del m.weight.main_grad
            elif drop == "none" and step % 2:
                m.weight.main_grad = None  # type: ignore[attr-defined]
        a, b = getattr(mod.weight, "main_grad", None), getattr(ref.weight, "main_grad", None)
        assert hasattr(mod.weight, "main_grad") == hasattr(ref.weight, "main_grad"), f"step {step}"
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"step {step}"
    graphed.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_the_gradient_cannot_be_added_into_is_refused(device: str) -> None:
    """A ``.main_grad`` of another shape: eager's ``add_`` fails, and so does ``backward_dw()``,
    saying why, before anything runs (the slot and the graph's target unchanged)."""
    mod = MainGradLinear(F, seed=4).to(device)
    mod.weight.main_grad = torch.zeros_like(mod.weight)  # type: ignore[attr-defined]
    graphed = gograph.make_graphed_callables(mod, (torch.randn(4, F, device=device, requires_grad=True),))
    target = mod.weight.main_grad  # type: ignore[attr-defined]
    _dense_backward(graphed(_batches(1, device)[0]))
    graphed.backward_dw()
    wrong = torch.ones(2, F, device=device)
    mod.weight.main_grad = wrong  # type: ignore[attr-defined]
    before = target.clone()
    _dense_backward(graphed(_batches(1, device)[0]))
    with pytest.raises(RuntimeError, match=r"weight\.main_grad is a tensor of shape \(2, 8\).*cannot be added into it"):
        graphed.backward_dw()
    assert torch.equal(wrong, torch.ones(2, F, device=device)) and torch.equal(target, before)
    mod.weight.main_grad = target  # type: ignore[attr-defined]
    graphed.backward_dw()  # the weight-gradient work of that backward, now where it can go
    assert not torch.equal(target, before)
    graphed.reset()
