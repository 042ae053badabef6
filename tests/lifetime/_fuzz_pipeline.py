"""The training program of a pipeline case (``_order``), run the same way by both worlds.

One iteration of the schedule per step, as a pipeline rank runs it (TransformerEngine's and
Megatron-LM's use of ``_order``): a forward of chunk ``c`` runs its layers on micro-batch ``m``
(chunk 0 reads data, chunk ``c > 0`` receives chunk ``c - 1``'s output, copied when it was made,
as a send copies it); a backward runs ``backward(dy)`` from the chunk's output (``dy`` received
from chunk ``c + 1``'s input grad, or data for the last chunk); a ``-(c+0.5)`` entry replays the
chunk's delayed weight gradients. After the steps the case's passes are reset and the others run
forward once more, under ``torch.no_grad()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from _fuzz_config import STEPS, Case, inference_build
from _fuzz_models import DELAYED_KINDS
from _fuzz_program import Data
from _fuzz_world import World
from torch import Tensor

import gograph

__all__ = ["PipelineProgram", "pipeline_order"]


def pipeline_order(case: Case, delayed_chunks: set[int]) -> list[float]:
    """``megatron_order`` of the case, with a weight-gradient entry after each backward of a
    chunk with delayed layers when the case asks for them (its forward entries alone for an
    inference case)."""
    p = case.pipeline
    assert p is not None
    order: list[float] = []
    for e in gograph.megatron_order(p.pipeline_size, p.rank, len(p.layers), p.microbatches):
        if inference_build(case) and e < 0:
            continue  # TransformerEngine's inference rule: forward entries only
        order.append(e)
        if e < 0 and p.wgrad_entries and (-e - 1) in delayed_chunks:
            order.append(e - 0.5)
    return order


@dataclass(eq=False)
class PipelineProgram:
    """Runs ``order`` in ``world`` (calls are per pass: ``prefix[c] * M + m * layers[c] + l``)."""

    world: World
    case: Case
    order: Sequence[float]
    data: Data
    kinds: Sequence[str]
    sent: dict[tuple[int, int], Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = self.case.pipeline
        assert p is not None
        self.layers, self.micro = p.layers, p.microbatches
        self.prefix = [sum(self.layers[:c]) for c in range(len(self.layers))]

    def pass_of(self, c: int, m: int, layer: int) -> int:
        return self.prefix[c] * self.micro + m * self.layers[c] + layer

    def run(self) -> None:
        for s in range(STEPS):
            self._iteration(s)
            delayed = [m for m, k in zip(self.world.modules, self.kinds) if k == "delayed"]
            self.world.step(f"step {s}", delayed)
        self._after_resets()

    def _chunk_forward(self, s: int, c: int, m: int, x: Tensor) -> Tensor:
        for layer in range(self.layers[c]):
            p = self.pass_of(c, m, layer)
            kwargs = {"scale": self._scale(s, c, m, layer)} if self.kinds[self.prefix[c] + layer] == "kwblock" else {}
            x = self.world.call(p, (x,), kwargs)
            where = f"step {s} chunk {c} micro-batch {m} layer {layer}"
            self.world.record_outputs(where, p, [x])
            self.world.checkpoint(f"{where}, after its forward")
        return x

    def _scale(self, s: int, c: int, m: int, layer: int) -> Tensor:
        """A kwblock layer's scale: with shared samples one per step for every pass (the same
        contents for every layer and micro-batch, as a mask shared by the graphs must be)."""
        return self.data.get("scale", s) if self.case.shared_samples else self.data.get("scale", s, c, m, layer)

    def _iteration(self, s: int) -> None:
        chunks = len(self.layers)
        fwd, bwd = [0] * chunks, [0] * chunks
        outs: dict[tuple[int, int], Tensor] = {}
        inputs: dict[tuple[int, int], Tensor] = {}
        grads: dict[tuple[int, int], Tensor] = {}
        for e in self.order:
            if e > 0:
                c = int(e) - 1
                m, fwd[c] = fwd[c], fwd[c] + 1
                first = self.case.layers[0].input_grad
                x = self.data.leaf(first, "x", s, m) if c == 0 else self.sent.pop((c - 1, m)).requires_grad_()
                inputs[(c, m)] = x
                outs[(c, m)] = y = self._chunk_forward(s, c, m, x)
                if c < chunks - 1:
                    self.sent[(c, m)] = y.detach().clone()  # the pipeline send
            elif float(e).is_integer():
                c = -int(e) - 1
                m, bwd[c] = bwd[c], bwd[c] + 1
                self._backward(s, c, m, outs.pop((c, m)), inputs.pop((c, m)), grads)
            else:
                c = int(-e - 0.5) - 1
                self._wgrad(s, c, bwd[c] - 1)

    def _backward(self, s: int, c: int, m: int, y: Tensor, x: Tensor, grads: dict[tuple[int, int], Tensor]) -> None:
        where = f"step {s} chunk {c} micro-batch {m}"
        dy = grads.pop((c, m)) if c < len(self.layers) - 1 else self.data.get("dy", s, m)
        if y.requires_grad:
            y.backward(dy)
            self.world.checkpoint(f"{where}, after its backward")
        del y
        self.world.trace.add(f"{where} input grad", x.grad)
        if c > 0:  # the pipeline send of the input grad
            grads[(c - 1, m)] = x.grad.clone() if x.grad is not None else torch.zeros_like(x)
        for name, p in self.world.params:
            self.world.trace.add(f"{where}: {name}.grad", p.grad)

    def _wgrad(self, s: int, c: int, m: int) -> None:
        slots = self.world.slot_refs()
        for layer in reversed(range(self.layers[c])):
            i = self.prefix[c] + layer
            if self.world.is_graphed:
                self.world.backward_dw(self.pass_of(c, m, layer))  # a no-op for a layer without one
            elif self.kinds[i] in DELAYED_KINDS:
                self.world.backward_dw(i)
            self.world.checkpoint(f"step {s} chunk {c} micro-batch {m} layer {layer}, after backward_dw()")
        self.world.trace_slots(slots, f"step {s} chunk {c} micro-batch {m} weight gradients")

    def _after_resets(self) -> None:
        p = self.case.pipeline
        assert p is not None
        for q in p.reset_after:
            layer = self._layer_of(q)
            args = (self.data.leaf(True, "x-reset", q),)
            kwargs = {"scale": self.data.get("scale-reset", q)} if self.kinds[layer] == "kwblock" else {}
            self.world.reset(q, None, lambda name, layer=layer: name.startswith(f"m{layer}."), args, kwargs)
        with torch.no_grad():
            for c in range(len(self.layers)):
                for m in range(self.micro):
                    self._forward_only(c, m, set(p.reset_after))

    def _forward_only(self, c: int, m: int, reset: set[int]) -> None:
        x: Any = self.data.get("x-after", c, m)
        for layer in range(self.layers[c]):
            q = self.pass_of(c, m, layer)
            if q in reset:
                return
            kwargs = (
                {"scale": self.data.get("scale-after", c, m, layer)}
                if self.kinds[self.prefix[c] + layer] == "kwblock"
                else {}
            )
            x = self.world.call(q, (x,), kwargs)
            self.world.trace.add(f"after the resets: chunk {c} micro-batch {m} layer {layer} output", x)

    def _layer_of(self, q: int) -> int:
        for c in reversed(range(len(self.layers))):
            base = self.prefix[c] * self.micro
            if q >= base:
                return self.prefix[c] + (q - base) % self.layers[c]
        raise AssertionError(q)
