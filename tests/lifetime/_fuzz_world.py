"""One side of the lifetime fuzzer's comparison: the callables a training program runs, eagerly
or graphed, with the oracles that watch it.

A :class:`World` calls callable (or pass) ``i``, replays its delayed weight gradient, resets it,
and keeps the program's observations (:class:`Trace`) and canaries. The eager world runs the
ungraphed twins of the graphed callables; both run the same program on the same data and seeds,
and put the ``weight.grad`` that ``backward_dw()`` writes in the same state (``grad_state``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from _fuzz_live import TRACKER, StaticRefs
from _fuzz_oracles import GradCanaries, OutputCanaries, Trace, same_values
from torch import Tensor

__all__ = ["World"]

LR = 0.1


@dataclass(eq=False)
class World:
    """``calls[i]`` runs callable (pass) ``i``; ``modules`` are the modules whose parameters train
    (named ``m<k>.<param>``); ``graphed`` the GraphedCallables (None eagerly); ``dw_modules`` the
    indices of the modules whose ``backward_dw()`` writes ``weight.grad``, put in ``grad_state``
    (``_fuzz_config.GRAD_STATES``)."""

    calls: Sequence[Callable[..., Any]]
    modules: Sequence[torch.nn.Module | None]
    graphed: Sequence[Any] | None
    set_to_none: bool
    debug: bool = False
    grad_state: str = "as_is"
    dw_modules: frozenset[int] = frozenset()
    trace: Trace = field(default_factory=Trace)
    violations: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    statics: StaticRefs = field(default_factory=StaticRefs)

    def __post_init__(self) -> None:
        # Forwards are counted per set of graphs: with share_microbatch_graphs the callables of one
        # colour (one pass id) replay one set, and any member's forward overwrites its outputs.
        self.colour = [g.pass_id for g in self.graphed] if self.graphed is not None else list(range(len(self.calls)))
        self.forwards = dict.fromkeys(self.colour, 0)
        self.params = [
            (f"m{k}.{name}", p) for k, m in enumerate(self.modules) if m is not None for name, p in m.named_parameters()
        ]
        self.opt = torch.optim.SGD([p for _, p in self.params], lr=LR) if self.params else None
        self.grads = GradCanaries(self.params, self.violations)
        self.outputs = OutputCanaries(
            lambda i: self.forwards[self.colour[i]],
            self._pool_planned,
            self.debug and self.graphed is not None,
            self.violations,
        )
        self.kept = OutputCanaries(lambda i: 0, lambda i, k: False, False, self.violations)  # for all of training
        if self.graphed is not None:
            self.statics.take(self.graphed)
        self.slots = [(n, p) for n, p in self.params if any(n == f"m{k}.weight" for k in self.dw_modules)]
        if self.grad_state == "preinit":  # pre-initialised after graphing
            for _, p in self.slots:
                p.grad = torch.zeros_like(p)

    @property
    def is_graphed(self) -> bool:
        return self.graphed is not None

    def _pool_planned(self, i: int, leaf: int) -> bool:
        return self.graphed is not None and leaf in self.graphed[i].released_outputs

    def call(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.forwards[self.colour[i]] += 1
        return self.calls[i](*args, **kwargs)

    def backward_dw(self, i: int) -> None:
        before = self._before_slots()
        if self.graphed is not None:
            self.graphed[i].backward_dw()
        else:
            module = self.modules[i] if i < len(self.modules) else None
            assert module is not None and hasattr(module, "backward_dw")
            module.backward_dw()
        self._after_slots(before, f"the backward_dw() of {i}")

    def _before_slots(self) -> list[tuple[Any, Any]]:
        """Per slot, its ``.grad`` before an event that may replace or drop it: held (with its
        values) when the program holds every ``.grad`` it saw, else weakly (a reference would be a
        holder gograph must work around)."""
        out = []
        for _, p in self.slots:
            g = p.grad
            if g is None:
                out.append((None, None))
            elif self.grad_state == "hold":
                out.append((g, g.detach().clone()))
            else:
                out.append((weakref.ref(g), None))
        return out

    def _after_slots(self, before: list[tuple[Any, Any]], where: str) -> None:
        """A ``.grad`` that left its slot (replaced as eagerly by a module that assigns, dropped)
        is no canary of the slot's any more; one the program holds must have its values still,
        and keep them."""
        for (name, p), (g, values) in zip(self.slots, before):
            if g is None:
                continue
            old = g() if isinstance(g, weakref.ref) else g
            if old is not None and p.grad is old:
                continue
            self.grads.disarm(lambda n, name=name: n == name)
            if values is not None and old is not None:
                if not same_values(old, values):
                    self.violations.append(
                        f"canary: {name}.grad, held by the program, changed as it left the slot at {where}"
                    )
                self.kept.hold(None, [old], f"{name}.grad held since it left the slot at {where}", None)

    def slot_refs(self) -> list[Any]:
        """Weak references to the slots' ``.grad`` now (None where there is none)."""
        return [None if p.grad is None else weakref.ref(p.grad) for _, p in self.slots]

    def trace_slots(self, refs: list[Any], where: str) -> None:
        """Whether each slot's ``.grad`` is the tensor it was at ``refs``, into the trace: eager's
        identity (kept and added into, or replaced) is part of what graphed training must match."""
        for (name, p), r in zip(self.slots, refs):
            same = (r() if r is not None else None) is p.grad
            self.trace.add(f"{where}: {name}.grad is the tensor it was", torch.tensor(same))

    def checkpoint(self, where: str) -> None:
        """Oracle 3 at a point of the program (both worlds: the eager one checks the oracles)."""
        self.grads.arm()
        self.grads.check(where)
        self.outputs.check(where)
        self.kept.check(where)

    def reset(
        self, i: int, owner: int | None, names: Callable[[str], bool], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Resets graphed callable ``i`` (a no-op eagerly) and checks what must be dead after it:
        its static buffers, what its forwards made (``owner``: the tracker's index, None when
        other passes of the same callable live on). ``names`` picks its parameters, whose
        ``.grad`` a reset may copy out. A call with ``args`` and ``kwargs``, and
        ``backward_dw()``, must then raise saying it was reset."""
        if self.graphed is None:
            return
        self.graphed[i].reset()
        for what, fn in (
            ("a call", lambda: self.calls[i](*args, **kwargs)),
            ("backward_dw()", self.graphed[i].backward_dw),
        ):
            try:
                fn()
                self.violations.append(f"reset: {what} of graphed callable {i} after its reset() did not raise")
            except RuntimeError as e:
                if "reset" not in str(e):
                    self.violations.append(f"reset: {what} of graphed callable {i} after its reset() raised {e!r}")
        self.grads.disarm(names)
        self.statics.check_released(i, self.graphed, self.violations)
        if owner is not None:
            TRACKER.check_all_dead(f"the reset() of callable {i}", owner=owner)

    def step(self, where: str, delayed: Sequence[Any]) -> None:
        """Records the grads, steps SGD (a delayed layer's weight from its ``main_grad``), zeroes
        the grads, records the parameters."""
        for name, p in self.params:
            self.trace.add(f"{where}: {name}.grad before the step", p.grad)
        for k, m in enumerate(delayed):
            self.trace.add(f"{where}: main_grad of delayed layer {k}", m.main_grad)
        if self.opt is not None:
            self.opt.step()
        with torch.no_grad():
            for m in delayed:
                m.weight.sub_(LR * m.main_grad)
                m.main_grad.zero_()
        self.checkpoint(f"{where}, after the optimizer step")
        before = self._before_slots()
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=self.set_to_none)
        self._after_slots(before, f"{where}, zero_grad")
        if self.grad_state == "replace":  # a checkpoint load, a rebuilt bucket: new tensors, same values
            before = self._before_slots()
            for _, p in self.slots:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            self._after_slots(before, f"{where}, replaced")
        if self.set_to_none:
            self.grads.disarm()
        else:
            self.checkpoint(f"{where}, after zero_grad")
        self.outputs.release()
        for m in delayed:  # what no backward_dw() consumed (the program calls none) goes
            m.stash.clear()
        for name, p in self.params:
            self.trace.add(f"{where}: {name} after the step", p)

    def record_outputs(self, where: str, owner: int, outs: Sequence[Tensor]) -> None:
        for k, t in enumerate(outs):
            self.trace.add(f"{where} output {k}", t)
        self.outputs.hold(owner, outs, where)

    def finish(self) -> None:
        """Resets everything left (graphed) and checks that nothing of the build is alive."""
        if self.graphed is None:
            return
        for i, g in enumerate(self.graphed):
            if not g.is_reset:
                g.reset()
                self.statics.check_released(i, self.graphed, self.violations)
        self.grads.disarm()
        self.outputs.release()
        self.kept.release()
        TRACKER.check_all_dead("the end, every callable reset")
