"""The build-time state of one pass: what warmup learned and what capture produced.

A :class:`PassState` starts from its frozen :class:`gograph.request._args.PassSpec`, is filled by the
warmup and capture executors (:mod:`gograph.build._warmup`, :mod:`gograph.build._captures`) and is turned
into a :class:`gograph.replay.graphed.PassResult` when the build succeeds; then it is discarded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..request import _te
from ..runtime._bodies import ForwardBody

if TYPE_CHECKING:  # pragma: no cover
    from ..request._args import PassSpec

__all__ = ["PassState", "replace_leaves"]


class PassState:
    """One pass while it is being built. ``flat_args`` (and ``sample_args`` / ``sample_kwargs``)
    start as the sample args and may be replaced by shared slots or chained buffers; ``params``
    may shrink under TransformerEngine's grad rules."""

    def __init__(self, spec: PassSpec, pass_id: int) -> None:
        self.spec, self.index, self.pass_id = spec, spec.index, pass_id
        self.body = ForwardBody(spec.forward_fn, spec.module, spec.label)  # a module: through its __call__
        self.flat_args: tuple[Tensor, ...] = spec.flat_args
        self.sample_args: tuple[Any, ...] = spec.sample_args
        self.sample_kwargs: dict[str, Any] = dict(spec.sample_kwargs)
        self.params: tuple[torch.nn.Parameter, ...] = spec.params
        self.te_grads = spec.te_grads
        # warmup
        self.rng: list[bool | None] = [None, None, None]  # forward, backward, wgrad consumed RNG (None: unknown)
        self.output_meta: tuple[tuple[tuple[Any, ...], bool], ...] = ()  # per output (signature, requires grad)
        self.wgrad_candidates: tuple[Any, ...] | None = None
        self.wgrad_modules: dict[int, Any] = {}
        self.need_dw = False
        self.warm_outputs: tuple[Tensor, ...] | None = None
        self.warm_grads: tuple[Tensor | None, ...] | None = None
        self.warmed = False
        self.inputs_seen = False  # a forward ran that said which input leaves it writes in place
        self.warm_backwards = 0  # TransformerEngine's grad rules differ on the first iteration
        self.warm_backward_ran = False  # the latest warmup backward ran (some output required grad)
        # capture
        self.capture_outputs: tuple[Tensor, ...] | None = None  # with their autograd graph
        self.static_outputs: tuple[Tensor, ...] = ()
        self.output_requires_grad: tuple[bool, ...] = ()
        self.output_spec: pytree.TreeSpec | None = None
        self.static_grad_outputs: tuple[Tensor | None, ...] = ()
        self.static_grad_inputs: tuple[Tensor | None, ...] = ()
        self.has_backward = False
        self.wgrad_body: _te.WgradBody | None = None
        self.chained_inputs: set[int] = set()
        self.separated_inputs: set[int] = set()  # leaves given a clone of their sample (_regions)
        self.mutated_inputs: frozenset[int] = frozenset()  # leaves its forward writes in place (warmup)
        self.chained_grad_outputs: set[int] = set()
        self.released: set[tuple[str, int]] = set()  # (role, index) handed back to the pool
        self.seq = [0, 0, 0]  # capture sequence numbers of its forward, backward, weight gradient
        # per kind, the capture sequence number of the first lending backward whose lent grads
        # a replay of that graph may overwrite (the core's rule; 0: any)
        self.lent_from = [0, 0, 0]

    @property
    def surface(self) -> tuple[Tensor, ...]:
        return self.flat_args + self.params

    @property
    def grad_surface(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.surface if t.requires_grad)

    @property
    def captures_backward(self) -> bool:
        """Whether a backward graph is captured: training, and (when warmup saw the outputs) some
        output requires grad."""
        if not self.spec.grad_enabled:
            return False
        return any(rg for _, rg in self.output_meta) if self.warmed else True

    @property
    def may_need_dw(self) -> bool:
        """Whether a weight-gradient graph is captured: warmup found a submodule that ran and needs
        one, or (without warmup) some submodule of the callable reports ``need_backward_dw()``."""
        if not self.captures_backward:
            return False
        return self.need_dw

    @property
    def anchors(self) -> tuple[torch.nn.Parameter, ...]:
        """Parameters that left the static surface (TransformerEngine's rule: no grad in the first
        warmup backward, e.g. a delayed weight gradient's weight) but still require grad: a
        backward differentiates them too, and drops their (None) grads, so that it runs every node
        eager's ``loss.backward()`` runs -- the one that stashes the delayed weight-gradient work
        among them, even where no input of the pass requires grad."""
        if len(self.params) == len(self.spec.params):
            return ()
        kept = {id(p) for p in self.params}
        return tuple(p for p in self.spec.params if p.requires_grad and id(p) not in kept)

    @property
    def capture_body(self) -> Any:
        """The forward body engines record, called with :attr:`body_args`."""
        if self.spec.kwargs_keys:
            return _te.CallWithKwargs(self.body, len(self.sample_args), self.spec.kwargs_keys)
        return self.body

    @property
    def body_args(self) -> tuple[Any, ...]:
        return (*self.sample_args, *(self.sample_kwargs[k] for k in self.spec.kwargs_keys))

    def replace_args(self, replacements: dict[int, Tensor]) -> None:
        """Flat leaf j becomes ``replacements[j]`` (a slot or a chained buffer)."""
        if not replacements:
            return
        n = self.spec.n_pos
        flat = list(self.flat_args)
        for j, t in replacements.items():
            flat[j] = t
        self.flat_args = tuple(flat)
        pos = {j: t for j, t in replacements.items() if j < n}
        if pos:
            self.sample_args = replace_leaves(self.sample_args, pos)
        kw = {j - n: t for j, t in replacements.items() if j >= n}
        if kw:
            keys = self.spec.kwargs_keys
            values = replace_leaves([self.sample_kwargs[k] for k in keys], kw)
            self.sample_kwargs = dict(zip(keys, values))


def replace_leaves(tree: Any, replacements: Mapping[int, Tensor]) -> Any:
    """``tree`` with leaf i replaced by ``replacements[i]``."""
    leaves, spec = pytree.tree_flatten(tree)
    for i, t in replacements.items():
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)
