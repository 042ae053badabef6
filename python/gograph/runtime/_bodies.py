"""Capture bodies: what an engine runs when it captures (or, on the eager engine, replays) one
kind of one pass. Explicit objects, not closures: engines and finalizers can reach them, so they
never hold their pass's owner (a module is held through a weakref).

A module's pass runs ``module(*args, **kwargs)``, through its class's ``__call__``, as
``torch.cuda.make_graphed_callables`` and TransformerEngine's warm up and capture it: a class
may route its call (Megatron-LM's layers return their graph outputs from ``__call__`` while
graphs are being made), and torch's rule that a graphed module has no hooks of its own makes
``nn.Module.__call__`` exactly its forward. While a module's body runs, :func:`running_module`
is that module: its own graphed callable, reached again through ``__call__`` (an eager replay
re-running a module whose ``forward`` it replaced), then runs the original forward.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..support import _torch

__all__ = ["RUNNING", "BackwardBody", "ForwardBody", "autograd_grad", "flat_tuple_spec", "running_module"]

LEAF_SPEC = pytree.tree_flatten(0)[1]  # the treespec of a lone leaf (a callable returning one Tensor)


@functools.lru_cache(maxsize=64)
def flat_tuple_spec(n: int) -> pytree.TreeSpec:
    """The treespec of a flat tuple of ``n`` leaves (args passed as plain tensors)."""
    return pytree.tree_flatten((0,) * n)[1]


def autograd_grad(
    outputs: tuple[Tensor, ...],
    inputs: tuple[Tensor, ...],
    grad_outputs: tuple[Tensor, ...],
    allow_unused: bool,
    retain_graph: bool = False,
) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, only_inputs=True, allow_unused=...,
    retain_graph=...)`` for the warmup and capture backwards, whose ``grad_outputs`` are buffers
    made like the outputs.

    For plain tensors (no ``__torch_function__`` override or mode) with autograd's debug log
    off, torch.autograd.grad only normalizes and validates its arguments before calling
    autograd's engine; that Python layer was a fifth of a small layer's warmup iteration, so the
    engine is called directly. Anything else goes through torch.autograd.grad. The engine raises
    the same errors (an unused input without ``allow_unused``, an output without grad)."""
    try:
        return _grad(outputs, inputs, grad_outputs, allow_unused, retain_graph)
    except RuntimeError as e:
        if allow_unused or _UNUSED not in str(e):
            raise
        raise RuntimeError(_unused_message(outputs, inputs)) from e


def _grad(
    outputs: tuple[Tensor, ...],
    inputs: tuple[Tensor, ...],
    grad_outputs: tuple[Tensor, ...],
    allow_unused: bool,
    retain_graph: bool,
) -> tuple[Tensor | None, ...]:
    run = _torch.run_backward
    if (
        run is not None
        and len(outputs) == len(grad_outputs)
        and not _torch.has_torch_function(outputs + inputs + grad_outputs)
        and _torch.autograd_log_quiet()
    ):
        return tuple(run(outputs, grad_outputs, retain_graph, False, inputs, allow_unused, accumulate_grad=False))
    return tuple(
        torch.autograd.grad(
            outputs=outputs,
            inputs=inputs,
            grad_outputs=grad_outputs,
            only_inputs=True,
            allow_unused=allow_unused,
            retain_graph=retain_graph or None,
        )
    )


class _Running(threading.local):
    """The module whose forward body runs on this thread (None outside one)."""

    module: torch.nn.Module | None = None


RUNNING = _Running()
"""``RUNNING.module``: the module whose forward body (warmup, capture, eager replay) runs on this
thread (read on the replay hot path without a call)."""


def running_module() -> torch.nn.Module | None:
    """The module whose forward body (warmup, capture, eager replay) runs on this thread."""
    return RUNNING.module


#: What autograd's engine says of an input the outputs do not depend on.
_UNUSED = "appears to not have been used in the graph"


def _unused_message(outputs: tuple[Tensor, ...], inputs: tuple[Tensor, ...]) -> str:
    """gograph's message for autograd's unused-input error: which inputs, and the option that
    allows them (``allow_unused_input``; autograd's own message names its ``allow_unused``)."""
    try:
        unused = _unreached(outputs, inputs)
    except Exception:  # the graph walk is a courtesy: the advice stands without it
        unused = []
    what = ", ".join(
        f"{'a parameter' if isinstance(t, torch.nn.Parameter) else 'a sample arg'} of shape {tuple(t.shape)}"
        for t in (inputs[i] for i in unused)
    )
    return (
        f"{what or 'an input that requires grad'} does not reach the outputs (autograd: one of the "
        f"differentiated Tensors {_UNUSED}). Pass allow_unused_input=True to make_graphed_callables if that "
        "is intended (its grad is then None), or set requires_grad=False on that input"
    )


def _unreached(outputs: tuple[Tensor, ...], inputs: tuple[Tensor, ...]) -> list[int]:
    """Indices of ``inputs`` whose gradient node no output's autograd graph reaches."""
    seen: set[Any] = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return [i for i, t in enumerate(inputs) if torch.autograd.graph.get_gradient_edge(t).node not in seen]


class ForwardBody:
    """Runs one callable's forward on its sample args and returns the flat tuple of output
    tensors; the output treespec of the latest call is kept in :attr:`out_spec`. A module is
    called through its class's ``__call__`` (held by weakref), a function directly."""

    __slots__ = ("_fn", "_module_ref", "label", "out_spec")

    def __init__(self, fn: Callable[..., Any] | None, module: torch.nn.Module | None, label: str) -> None:
        """``module``: the module to call; else ``fn``, the function to call."""
        if module is None and fn is None:
            raise TypeError("gograph: a forward body needs a module or a function")
        self._fn = fn
        self._module_ref = weakref.ref(module) if module is not None else None
        self.out_spec: pytree.TreeSpec | None = None
        self.label = label

    @property
    def module(self) -> torch.nn.Module | None:
        """The module this body calls (None for a function, or once the module is gone)."""
        return self._module_ref() if self._module_ref is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        if self._module_ref is not None:
            module = self._module_ref()
            if module is None:
                raise RuntimeError(f"gograph: the graphed module {self.label} no longer exists")
            outer, RUNNING.module = RUNNING.module, module
            try:
                out = module(*args, **kwargs)
            finally:
                RUNNING.module = outer
        else:
            out = self._fn(*args, **kwargs)  # type: ignore[misc]
        if isinstance(out, Tensor):  # the common case, without pytree's flattening
            self.out_spec = LEAF_SPEC
            return (out,)
        return self._flatten(out)

    def _flatten(self, out: Any) -> tuple[Tensor, ...]:
        if out is None:
            raise TypeError(
                f"gograph: a graphed callable must return at least one Tensor; {self.label} returned None. "
                "Return the tensors it computes (work that only updates state in place belongs in torch.cuda.graph)"
            )
        leaves, spec = pytree.tree_flatten(out)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"gograph: the outputs of a graphed callable must be Tensors (in any pytree structure); "
                    f"output leaf {i} of {self.label} is a {type(leaf).__name__}"
                )
        if not leaves:
            raise TypeError(
                f"gograph: a graphed callable must return at least one Tensor; {self.label} returned an empty "
                f"{type(out).__name__}. Return the tensors it computes (work that only updates state in place "
                "belongs in torch.cuda.graph)"
            )
        self.out_spec = spec
        return tuple(leaves)


class BackwardBody:
    """The grads of the outputs that require grad with respect to the static inputs that require
    grad, with the static grad-output buffers as incoming gradients. Called with the forward
    outputs it differentiates (the capture's, or on the eager engine the latest forward replay's)."""

    __slots__ = ("allow_unused", "grad_outputs", "inputs", "n_inputs", "output_mask", "retain_graph")

    def __init__(
        self,
        inputs: tuple[Tensor, ...],
        grad_outputs: tuple[Tensor, ...],
        output_mask: tuple[bool, ...],
        allow_unused: bool,
        retain_graph: bool = False,
        anchors: tuple[Tensor, ...] = (),
    ) -> None:
        # Anchors are differentiated too and their grads dropped: they keep autograd from pruning
        # nodes eager's backward runs (:attr:`gograph.build._state.PassState.anchors`).
        self.inputs = inputs + anchors
        self.n_inputs = len(inputs)
        self.grad_outputs = grad_outputs
        self.output_mask = output_mask
        self.allow_unused = allow_unused
        self.retain_graph = retain_graph  # TransformerEngine's retain_graph_in_backward

    def __call__(self, outputs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
        outs = tuple(o for o, m in zip(outputs, self.output_mask) if m)
        grads = autograd_grad(outs, self.inputs, self.grad_outputs, self.allow_unused, self.retain_graph)
        return grads if len(grads) == self.n_inputs else grads[: self.n_inputs]
