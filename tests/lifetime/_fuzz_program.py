"""The training program of a default-schedule case, run the same way by both worlds.

Per step and micro-batch: the callables still in use run in order (callable i takes the previous
one's outputs where the case says so, or where ``chain_buffers`` chained them, else fresh data),
the loss sums every output times fixed coefficients (so each tensor has at most two consumers:
the loss and the next callable; a sum of two grads is bitwise the same in either order),
``loss.backward()`` (or ``torch.autograd.grad``), ``backward_dw()`` of the delayed layers (after
the backward, or inside it right after each callable's own); after the micro-batches an SGD step
and ``zero_grad``, and optionally a forward of every callable under ``torch.no_grad()``. Resets
happen before the micro-batch the case names; a chained callable whose previous callable is gone
must refuse a fresh input (``ChainedInputError``) and is used no more. Every observation goes to
the world's trace; the canaries are checked after every call.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _fuzz_config import STEPS, Case
from _fuzz_models import DELAYED_KINDS, FEATURES, ROWS
from _fuzz_oracles import leaves
from _fuzz_world import World
from torch import Tensor

import gograph

__all__ = ["Data", "DefaultProgram", "Plan"]


@dataclass(eq=False)
class Data:
    """Deterministic tensors by key (the same for both worlds, whatever each asks for first)."""

    seed: int
    device: torch.device
    cache: dict[tuple[Any, ...], Tensor] = field(default_factory=dict)

    def get(self, *key: Any, shape: Sequence[int] = (ROWS, FEATURES)) -> Tensor:
        full = (*key, tuple(shape))
        t = self.cache.get(full)
        if t is None:
            g = torch.Generator().manual_seed(zlib.crc32(repr(full).encode()) ^ self.seed)
            t = self.cache[full] = torch.randn(tuple(shape), generator=g).to(self.device)
        return t

    def leaf(self, requires_grad: bool, *key: Any, shape: Sequence[int] = (ROWS, FEATURES)) -> Tensor:
        return self.get(*key, shape=shape).clone().requires_grad_(requires_grad)


@dataclass(eq=False)
class Plan:
    """What both worlds share: per callable the ``requires_grad`` of each positional sample, the
    positions ``chain_buffers`` chained (from the graphed build), which callables are reset or
    cut off at each (step, micro-batch), and the ``backward_dw()`` calls the eager run made."""

    case: Case
    data: Data
    sample_grad: list[tuple[bool, ...]]
    chained: list[frozenset[int]]
    events: dict[tuple[int, int], tuple[list[int], list[int]]] = field(default_factory=dict)
    dw_calls: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def schedule(self) -> None:
        """Resets and chain cuts per (step, micro-batch)."""
        alive = set(range(len(self.case.layers)))
        for s in range(STEPS):
            for m in range(self.case.micro):
                resets = [i for rs, rm, i in self.case.resets if (rs, rm) == (s, m) and i in alive]
                alive -= set(resets)
                cut = []
                for i in sorted(alive):
                    if self.chained[i] and i - 1 not in alive:
                        cut.append(i)
                        alive.discard(i)
                self.events[(s, m)] = (resets, cut)


@dataclass(eq=False)
class DefaultProgram:
    """Runs ``plan`` in ``world`` (the eager world first: it decides the ``backward_dw`` calls)."""

    world: World
    plan: Plan
    no_grad: bool
    alive: set[int] = field(default_factory=set)

    def run(self) -> None:
        self.alive = set(range(len(self.plan.case.layers)))
        with torch.no_grad() if self.no_grad else contextlib.nullcontext():
            for s in range(STEPS):
                for m in range(self.plan.case.micro):
                    self._events(s, m)
                    self._micro_batch(s, m)
                delayed = [
                    self.world.modules[i] for i, layer in enumerate(self.plan.case.layers) if layer.kind == "delayed"
                ]
                self.world.step(f"step {s}", delayed)
                if self.plan.case.evaluate:
                    with torch.no_grad():  # evaluation between training steps
                        self._forwards(s, "eval", f"step {s} evaluation")

    def _events(self, s: int, m: int) -> None:
        """The resets before micro-batch ``m`` of step ``s``, and the chained callables they cut off."""
        resets, cut = self.plan.events[(s, m)]
        for i in resets:
            self.alive.discard(i)
            args, kwargs, _ = self._inputs(i, s, m, None, feed_static=False)
            self.world.reset(i, i, lambda name, i=i: name.startswith(f"m{i}."), args, kwargs)
        for i in cut:
            self.alive.discard(i)
            self.world.events.append("a chained callable cut off by a reset")
            if self.world.is_graphed:  # its graph reads the reset callable's output buffer in place
                args, kwargs, _ = self._inputs(i, s, m, None)
                with pytest.raises(gograph.ChainedInputError):
                    self.world.call(i, args, kwargs)

    def _inputs(
        self, i: int, s: int, m: Any, prev: list[Tensor] | None, feed_static: bool = True
    ) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[str, Tensor]]]:
        """Positional args, kwargs, and the fresh leaves whose grads the trace records (callable
        0's static input itself when the case feeds it and ``feed_static``)."""
        layer, data = self.plan.case.layers[i], self.plan.data
        n_pos = 2 if layer.kind == "unused" else 1
        args, fresh = [], []
        for k in range(n_pos):
            if prev is not None and (k in self.plan.chained[i] or (k == 0 and layer.from_prev)):
                args.append(prev[k])
            elif i == 0 and k == 0 and feed_static and self.plan.case.feed_static and self.world.graphed is not None:
                t = self.world.graphed[0].static_input_surface[0]  # a loader's copy lands in it: no copy-in
                with torch.no_grad():
                    t.copy_(data.get("x", s, m, i, k))
                args.append(t)
                fresh.append((f"input {k}", t))
            else:
                t = data.leaf(self.plan.sample_grad[i][k], "x", s, m, i, k)
                args.append(t)
                fresh.append((f"input {k}", t))
        kwargs: dict[str, Any] = {}
        if layer.kind == "kwargs":
            scale = data.get("scale", s, m) if self.plan.case.shared_samples else data.get("scale", s, m, i)
            kwargs = {"scale": scale, "bias": data.leaf(True, "bias", s, m, i, shape=(FEATURES,))}
            fresh.append(("kwarg bias", kwargs["bias"]))
        return tuple(args), kwargs, fresh

    def _forwards(self, s: int, m: Any, where: str) -> tuple[dict[int, list[Tensor]], list[tuple[str, Tensor]]]:
        outs: dict[int, list[Tensor]] = {}
        fresh: list[tuple[str, Tensor]] = []
        for i in sorted(self.alive):
            args, kwargs, new = self._inputs(i, s, m, outs.get(i - 1))
            fresh += [(f"{where} callable {i} {name}", t) for name, t in new]
            outs[i] = leaves(self.world.call(i, args, kwargs))
            self.world.record_outputs(f"{where} callable {i}", i, outs[i])
            self.world.checkpoint(f"{where}, after the forward of callable {i}")
        return outs, fresh

    def _micro_batch(self, s: int, m: int) -> None:
        where = f"step {s} micro-batch {m}"
        outs, fresh = self._forwards(s, m, where)
        # Every output is in the loss (with the next callable, at most two consumers each): every
        # pass that records a backward gets it, as the replay-order guard needs.
        terms = [
            (t.float() * self.plan.data.get("coeff", i, k, shape=t.shape)).sum()
            for i, ts in outs.items()
            for k, t in enumerate(ts)
        ]
        loss = torch.stack(terms).sum() if terms else None
        self.world.trace.add(f"{where} loss", loss)
        slots = self.world.slot_refs()  # the weight.grad backward_dw() writes, before it runs
        if loss is not None and loss.requires_grad:
            handles = self._dw_hooks(s, m, outs)
            self._differentiate(loss, fresh, where)
            for h in handles:
                h.remove()
        del outs, loss, terms
        for name, t in fresh:  # input grads alias static buffers that later replays overwrite: read now
            self.world.trace.add(f"{name} .grad", t.grad)
            t.grad = None  # a static input passed itself is the same leaf at every call
        self._backward_dw(s, m, where)
        self.world.trace_slots(slots, where)
        for name, p in self.world.params:
            self.world.trace.add(f"{where}: {name}.grad", p.grad)

    def _differentiate(self, loss: Tensor, fresh: list[tuple[str, Tensor]], where: str) -> None:
        """``loss.backward()``, or ``torch.autograd.grad`` of the inputs and parameters: the
        parameters' results are summed into ``.grad`` (in place where it exists, as AccumulateGrad
        does), and those of parameters without a ``.grad`` are kept for the rest of training (they
        must not change). Where ``.grad`` exists the result is the static buffer, as for input
        grads (docs/API.md): read now, not kept."""
        if not self.plan.case.autograd_grad:
            loss.backward()
            self.world.checkpoint(f"{where}, after loss.backward()")
            return
        named = [(name, p) for name, p in self.world.params if p.requires_grad]
        had_grad = {name for name, p in named if p.grad is not None}
        leaves = [t for _, t in fresh if t.requires_grad]
        grads = torch.autograd.grad(loss, [*leaves, *(p for _, p in named)], allow_unused=True)
        for t, g in zip(leaves, grads):
            t.grad = g
        kept = []
        for (name, p), g in zip(named, grads[len(leaves) :]):
            if g is None:
                continue
            if name not in had_grad and self.plan.case.clone_param_grads:  # else torch's aliasing
                kept.append((name, g))
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)
        for name, g in kept:
            self.world.kept.hold(None, [g], f"the torch.autograd.grad result for {name} kept at {where}", None)
        self.world.checkpoint(f"{where}, after torch.autograd.grad")

    def _dw_hooks(self, s: int, m: int, outs: dict[int, list[Tensor]]) -> list[Any]:
        """backward_dw "during": each graphed callable's weight-gradient graph replays right after
        its backward (a post-hook on its autograd node), in capture order."""
        if not (self.world.is_graphed and self.plan.case.backward_dw == "during"):
            return []
        handles = []
        for i in self.plan.dw_calls.get((s, m), ()):
            node = next((t.grad_fn for t in outs.get(i, ()) if t.grad_fn is not None), None)
            if node is not None:
                handles.append(node.register_hook(lambda grad_in, grad_out, i=i: self.world.backward_dw(i)))
        return handles

    def _backward_dw(self, s: int, m: int, where: str) -> None:
        if self.plan.case.backward_dw == "none":
            for i in self.alive:  # nothing will consume what the delayed layers kept
                if self.plan.case.layers[i].kind in DELAYED_KINDS:
                    self.world.modules[i].stash.clear()  # type: ignore[union-attr]
            return
        if not self.world.is_graphed:  # eagerly (the timing changes nothing): the layers whose backward ran
            self.plan.dw_calls[(s, m)] = [
                i
                for i in sorted(self.alive, reverse=True)
                if self.plan.case.layers[i].kind in DELAYED_KINDS and self.world.modules[i].stash  # type: ignore[union-attr]
            ]
        elif self.plan.case.backward_dw == "during":
            return  # replayed inside loss.backward()
        for i in self.plan.dw_calls[(s, m)]:
            self.world.backward_dw(i)
            self.world.checkpoint(f"{where}, after backward_dw() of callable {i}")
