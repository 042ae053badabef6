"""Oracles 1 and 3 of the lifetime fuzzer: values against eager, and the canaries.

* :class:`Trace` (values): what a training program observed -- every output, loss, input grad,
  parameter grad and parameter, in program order, with ``requires_grad`` -- recorded by the eager
  run and by the graphed run, compared bitwise.
* :class:`GradCanaries` (lent ``.grad``): every ``.grad`` the program holds keeps its identity
  and its address (``data_ptr``) while it is held: within a step with
  ``zero_grad(set_to_none=True)``, for the rest of training with ``set_to_none=False`` (a
  ``reset()`` of the parameter's callable may copy it out: its address is taken again there).
  Its values are the trace's.
* :class:`OutputCanaries` (held outputs): every output the program holds keeps its values, unless
  the next forward of its own callable ran (the documented static-output contract) or it is a
  pool-planned buffer (``released_outputs``) that a later replay may overwrite -- then, with
  ``debug_replay_order``, reading it must raise the checker's error. A kept
  ``torch.autograd.grad`` result of a parameter without a ``.grad`` keeps its values, whatever replays.

Only weak references are held to ``.grad`` tensors: a strong one would look to gograph like a
holder of a lent buffer and change what it does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["GradCanaries", "OutputCanaries", "Trace", "leaves", "same_values"]


def leaves(out: Any) -> list[Tensor]:
    """The tensor leaves of a callable's output, in pytree order."""
    return [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]


@dataclass(eq=False)
class Trace:
    """(label, value on the CPU or None, requires_grad) per observation."""

    entries: list[tuple[str, Tensor | None, bool]] = field(default_factory=list)

    def add(self, label: str, t: Tensor | None) -> None:
        if t is None:
            self.entries.append((label, None, False))
        else:
            self.entries.append((label, t.detach().to("cpu", copy=True), bool(t.requires_grad)))

    def mismatch(self, graphed: Trace) -> str | None:
        """The first difference between this (eager) trace and the graphed one, or None."""
        for k, (want, got) in enumerate(zip(self.entries, graphed.entries)):
            (label, a, arg), (glabel, b, brg) = want, got
            if label != glabel:
                return f"values: observation {k} is {label!r} eagerly but {glabel!r} graphed (programs diverged)"
            if (a is None) != (b is None):
                return f"values: {label}: eager {_show(a)}, graphed {_show(b)}"
            if arg != brg:
                return f"values: {label}: requires_grad {arg} eagerly, {brg} graphed"
            if a is not None and b is not None and not same_values(a, b):
                return f"values: {label} differs from eager: {_diff(a, b)}"
        if len(self.entries) != len(graphed.entries):
            return f"values: eager made {len(self.entries)} observations, graphed {len(graphed.entries)}"
        return None


def same_values(a: Tensor, b: Tensor) -> bool:
    """Equal dtype, shape and values, NaN where the other has NaN."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and (torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))
    )


def _show(t: Tensor | None) -> str:
    return "None" if t is None else f"a tensor of shape {tuple(t.shape)}"


def _diff(a: Tensor, b: Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    d = (a.double() - b.double()).abs()
    return f"max |diff| {d.nan_to_num(float('inf')).max().item():.3g}, graphed has NaN: {bool(b.isnan().any())}"


@dataclass(eq=False)
class GradCanaries:
    """Identity and address of every ``.grad`` while the program holds it."""

    params: Sequence[tuple[str, torch.nn.Parameter]]
    violations: list[str]
    armed: dict[int, tuple[weakref.ref[Tensor], int]] = field(default_factory=dict)

    def arm(self) -> None:
        """Starts watching every ``.grad`` that exists and is not watched yet."""
        for k, (_, p) in enumerate(self.params):
            if k not in self.armed and p.grad is not None:
                self.armed[k] = (weakref.ref(p.grad), p.grad.data_ptr())

    def check(self, where: str) -> None:
        for k, (ref, ptr) in self.armed.items():
            name, p = self.params[k]
            held = ref()
            if held is None or p.grad is not held:
                self.violations.append(f"canary: {name}.grad is another tensor at {where} (it was replaced)")
            elif held.data_ptr() != ptr:
                self.violations.append(
                    f"canary: {name}.grad moved at {where} (data_ptr {ptr:#x} -> {held.data_ptr():#x}); "
                    "eager keeps one .grad at one address"
                )
        if any(v.startswith("canary:") for v in self.violations):
            self.armed.clear()  # reported once

    def disarm(self, which: Callable[[str], bool] | None = None) -> None:
        """Stops watching (every ``.grad``, or those whose parameter name ``which`` accepts)."""
        if which is None:
            self.armed.clear()
        else:
            self.armed = {k: v for k, v in self.armed.items() if not which(self.params[k][0])}


@dataclass(eq=False)
class _Held:
    tensor: Tensor
    value: Tensor
    owner: int | None  # None: nothing may change it (a torch.autograd.grad result)
    leaf: int
    forwards: int
    label: str


@dataclass(eq=False)
class OutputCanaries:
    """Held outputs and what may change them. ``forwards(i)`` counts the forward calls of
    callable ``i`` so far; ``pool_planned(i, leaf)`` says whether that output is a pool-planned
    buffer; ``debug`` whether the replay-order checker is on."""

    forwards: Callable[[int], int]
    pool_planned: Callable[[int, int], bool]
    debug: bool
    violations: list[str]
    held: list[_Held] = field(default_factory=list)

    def hold(self, owner: int | None, outs: Sequence[Tensor], label: str, what: str | None = "output") -> None:
        """Holds ``outs`` of callable ``owner``, detached (the same storage, not the autograd graph
        and the inputs it reaches); with ``owner`` None, the tensors themselves, which no replay
        may change (as a caller keeps a ``torch.autograd.grad`` result)."""
        n = self.forwards(owner) if owner is not None else 0
        for k, t in enumerate(outs):
            held = t.detach() if owner is not None else t
            name = label if what is None else f"{label} {what} {k}"
            self.held.append(_Held(held, t.detach().clone(), owner, k, n, name))

    def check(self, where: str) -> None:
        for h in self.held:
            if h.owner is not None and self.forwards(h.owner) != h.forwards:
                continue  # its own forward ran again: the static-output contract
            planned = h.owner is not None and self.pool_planned(h.owner, h.leaf)
            try:
                same = same_values(h.tensor, h.value)
            except RuntimeError as e:
                if not (planned and "pool-planned buffer" in str(e)):
                    self.violations.append(f"canary: reading {h.label} at {where} raised: {e}")
                continue
            if same:
                continue
            if h.owner is None:
                self.violations.append(f"canary: {h.label} changed at {where}")
            elif not planned:
                self.violations.append(f"canary: {h.label} changed at {where} though its callable did not run again")
            elif self.debug:
                self.violations.append(
                    f"canary: {h.label} (pool-planned) was overwritten at {where} and debug_replay_order "
                    "did not flag the read"
                )
        if any(v.startswith("canary:") for v in self.violations):
            self.held.clear()  # reported once

    def release(self) -> None:
        self.held.clear()
