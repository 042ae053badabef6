"""A capture that fails because work on the legacy default stream had to wait for it (autograd
nodes made while the default stream was current, as a DDP wrapper's gradient accumulators) says
what to do, not only the CUDA error."""

from __future__ import annotations

import pytest
import torch

import gograph
from gograph.runtime.engines import explain_capture_error

from helpers import make_mlp

TORCH_906 = "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
CORE_906 = (
    "end_pass_capture: cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (906): operation would make the "
    "legacy stream depend on a capturing blocking stream"
)


@pytest.mark.parametrize("text", [TORCH_906, CORE_906])
def test_the_implicit_legacy_stream_error_says_what_to_do(text: str) -> None:
    err = explain_capture_error(RuntimeError(text))
    assert type(err) is RuntimeError
    msg = str(err)
    assert msg.startswith(text)
    assert "nodes created while the default stream was current" in msg
    assert "torch.cuda.set_stream(torch.cuda.Stream())" in msg and "CudaEngine(device, stream=side)" in msg


def test_other_capture_errors_are_left_alone() -> None:
    assert explain_capture_error(RuntimeError("operation not permitted when stream is capturing")) is None
    assert explain_capture_error(ValueError("shape mismatch")) is None


@pytest.mark.cuda
def test_a_backward_tied_to_the_legacy_stream_fails_with_the_hint(cuda_device: torch.device) -> None:
    """Gradient accumulators held from a default-stream moment, as DDP built on the default stream
    holds them: every backward capture makes the legacy stream wait for it."""
    current = torch.cuda.current_stream(cuda_device)
    torch.cuda.set_stream(torch.cuda.default_stream(cuda_device))
    try:
        model = make_mlp(device=cuda_device)
        accumulators = [p.expand_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
        passes = gograph.live_passes()
        hint = r"(?s)legacy .*stream.*\[the capture made the legacy default stream wait"  # torch's message spans lines
        with pytest.raises(RuntimeError, match=hint):
            gograph.make_graphed_callables(model, (torch.randn(4, 8, device=cuda_device, requires_grad=True),))
        assert gograph.live_passes() == passes
        del accumulators
    finally:
        torch.cuda.set_stream(current)
