"""The configurations the API refuses, and how: what a lifetime-fuzz case expects of a build
that must (or may) fail with a documented error instead of graphing."""

from __future__ import annotations

import re
from dataclasses import dataclass

from _fuzz_config import Case, inference_build
from _fuzz_models import DELAYED_KINDS

import gograph

__all__ = ["Refusal", "expected_refusals"]


@dataclass(frozen=True)
class Refusal:
    """A documented refusal: the error type, a pattern of its message, and (for errors raised by a
    callable during the build) the label of the callable the message must name."""

    error: type[BaseException]
    pattern: str
    label: str | None = None

    def matches(self, e: BaseException) -> bool:
        if not isinstance(e, self.error) or not re.search(self.pattern, str(e)):
            return False
        return self.label is None or re.search(rf"callable \d+ \({self.label}\) failed", str(e)) is not None


def expected_refusals(case: Case, device: str = "cpu") -> tuple[list[Refusal], list[Refusal]]:
    """(refusals one of which must happen, refusals that may happen) for ``case`` on ``device``:
    the configurations docs/API.md (and torch's or TransformerEngine's checks) refuse."""
    must, may = [], []
    if case.reuse and case.pipeline is None:
        must.append(Refusal(ValueError, r"`_order` must be provided when `_reuse_graph_input_output_buffers`"))
    if case.chain_buffers and case.num_warmup_iters < 1:
        must.append(Refusal(ValueError, r"chain_buffers needs num_warmup_iters >= 1"))
    if not case.allow_unused_input and any(layer.kind == "unused" for layer in case.layers):
        may.append(Refusal(RuntimeError, r"appears to not have been used in the graph", "Unused"))
    p = case.pipeline
    if case.share and p is None:
        must.append(Refusal(ValueError, r"share_microbatch_graphs needs _order"))
    if case.share and p is not None and case.chain_buffers:
        must.append(Refusal(ValueError, r"share_microbatch_graphs cannot be combined with"))
    elif case.share and p is not None and not case.clone_param_grads:
        must.append(Refusal(ValueError, r"share_microbatch_graphs needs clone_param_grads_on_return=True"))
    if p is None:
        return must, may
    if inference_build(case):  # forward entries only: no weight-gradient entry, nothing delayed to find
        if case.reuse:  # TransformerEngine's rule
            must.append(
                Refusal(RuntimeError, r"`_reuse_graph_input_output_buffers` is only available in training mode")
            )
        return must, may
    if case.num_warmup_iters == 0:
        must.append(Refusal(gograph.ScheduleError, r"num_warmup_iters=0 with _order: warmup must run at least once"))
    delayed = any(layer.kind in DELAYED_KINDS for layer in case.layers)
    if delayed and p.wgrad_entries and max(p.layers) > 1:
        must.append(
            Refusal(gograph.ScheduleError, r"with weight-gradient entries every chunk must have exactly one layer")
        )
    if delayed and not p.wgrad_entries:
        must.append(Refusal(gograph.ScheduleError, r"needs a delayed weight gradient"))
    return must, may
