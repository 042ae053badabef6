"""Megatron-Core's training path on the CPU: where it hard-codes CUDA, redirected to the host.

Megatron-Core (0.19.2) assumes a GPU in a few places on the path of a small GPT trained with
``forward_backward_no_pipelining`` or the interleaved pipeline schedule, DDP and the
``transformer_engine`` graph path. :func:`redirected` sends each to the host for one run (and
puts everything back afterwards), so that run executes gograph's eager engine:

* ``device="cuda"`` / ``device=<int>`` arguments of torch's tensor factories and
  ``Tensor.cuda()`` / ``Tensor.to("cuda")`` (``schedules.py``'s token counter, DDP's buffers,
  ``get_layer_static_inputs``' sample tensors, the replay's zero attention mask) -> the CPU,
  through a ``TorchFunctionMode``;
* ``torch.cuda.current_device()`` -> ``torch.device("cpu")`` (the device those sites pass);
* ``torch.cuda.synchronize``, ``current_stream``, ``Stream``, ``stream``, ``set_stream``,
  ``Event`` (the graph helper's synchronizations, DDP's and the pipeline's stream waits) ->
  no-ops on a host stream;
* the CUDA generator of the model-parallel RNG tracker (``tensor_parallel.random``'s
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``, ``torch.cuda.get_rng_state`` and
  ``torch.cuda.manual_seed`` for ``model_parallel_cuda_manual_seed``) -> the CPU generator.

Megatron's own optimizer checks ``torch.cuda`` tensor types and is not redirected: CPU runs step
with :class:`HostMixedPrecisionSGD` (megatron_train.py) instead.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostStream", "redirected"]

_HOST = torch.device("cpu")


def _host(device: Any) -> Any:
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _HOST
    if isinstance(device, str) and device.startswith("cuda"):
        return _HOST
    if isinstance(device, torch.device) and device.type == "cuda":
        return _HOST
    return device


class _CudaOnHost(TorchFunctionMode):
    """Tensor factories and moves that name a CUDA device make or keep CPU tensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.Tensor, torch.dtype)):
            args = (args[0], _host(args[1]), *args[2:])
        return func(*args, **kwargs)


class HostStream:
    """A stream on the host: every wait and record is a no-op (host work is in order)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _HOST

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> HostEvent:
        return HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostEvent:
    """An event on the host: always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


@contextlib.contextmanager
def redirected() -> Iterator[None]:
    """Megatron's CUDA hard-codings sent to the host while active (see the module docstring)."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: _HOST),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "current_stream", lambda *a, **k: HostStream()),
        (torch.cuda, "default_stream", lambda *a, **k: HostStream()),
        (torch.cuda, "Stream", HostStream),
        (torch.cuda, "Event", HostEvent),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "set_stream", lambda *a, **k: None),
        (torch.cuda, "get_rng_state", _get_rng_state),
        (torch.cuda, "manual_seed", _manual_seed),
        (random, "_get_cuda_rng_state", _get_rng_state),
        (random, "_set_cuda_rng_state", _set_rng_state),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        with _CudaOnHost():
            yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
