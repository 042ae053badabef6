"""Every private ``torch._C`` entry point gograph uses, in one place.

torch's public wrappers resolve their arguments through several Python layers on every call,
which showed on the capture and replay paths (docs/BENCHMARKS.md, *Capture time*); these are the
raw calls underneath. Each was checked on torch 2.9, 2.10 and 2.11 (CUDA 12.x/13.0 builds) and
is used with the signature given here; when a torch release moves one, this module is the only
place to change.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "allocator_history_enabled",
    "autograd_log_quiet",
    "begin_allocate_to_pool",
    "clear_cublas_workspaces",
    "cpp_function_apply",
    "current_raw_stream",
    "current_stream",
    "empty_cache",
    "end_allocate_to_pool",
    "functorch_transforms_active",
    "get_device",
    "has_torch_function",
    "is_current_stream_capturing",
    "memory_stats",
    "module_hooks_suspended",
    "nonowning_view",
    "poison_storage",
    "release_pool",
    "run_backward",
    "set_device",
    "set_stream",
    "storage_use_count",
    "synchronize",
    "tensor_hooks_suspended",
]

# -- devices and streams (torch.cuda.device / torch.cuda.stream, without their Python layers) --
get_device: Callable[[], int] = torch._C._cuda_getDevice
set_device: Callable[[int], None] = torch._C._cuda_setDevice
synchronize: Callable[[], None] = torch._C._cuda_synchronize
empty_cache: Callable[[], None] = torch._C._cuda_emptyCache


def current_stream(device_index: int) -> tuple[int, int, int]:
    """(stream_id, device_index, device_type) of the device's current stream."""
    sid, dev, typ = torch._C._cuda_getCurrentStream(device_index)
    return int(sid), int(dev), int(typ)


def set_stream(stream_id: int, device_index: int, device_type: int) -> None:
    """Makes the stream current on its device (what ``torch.cuda.set_stream`` does)."""
    torch._C._cuda_setStream(stream_id=stream_id, device_index=device_index, device_type=device_type)


def current_raw_stream(device_index: int) -> int:
    """The device's current ``cudaStream_t`` as an int (what graphs are launched on)."""
    return int(torch._C._cuda_getCurrentRawStream(device_index))


is_current_stream_capturing: Callable[[], bool] = torch._C._cuda_isCurrentStreamCapturing

# -- graph pools (torch's CUDAGraph::capture_begin/end do the same) -----------------------------


def begin_allocate_to_pool(device_index: int, pool: Any) -> None:
    """Routes the current stream's allocations to ``pool`` (a ``graph_pool_handle()`` pair),
    taking one reference on it (creating the private pool on first use). Stream-scoped, so
    autograd's device thread running backward ops on this stream is routed too."""
    torch._C._cuda_beginAllocateCurrentStreamToPool(device_index, pool)


def end_allocate_to_pool(device_index: int, pool: Any) -> None:
    """Stops routing to ``pool`` (the reference stays: :func:`release_pool` returns it)."""
    torch._C._cuda_endAllocateToPool(device_index, pool)


def pool_free_blocks(device_index: int, pool: Any, stream: int) -> list[tuple[int, int, bool]]:
    """The free blocks ``(start, end, small pool?)`` of private pool ``pool`` that allocations on
    ``stream`` may be given (the caching allocator's per-pool snapshot, without traces: a walk of
    the pool's segments; checked on torch 2.9-2.11)."""
    out = []
    with torch.cuda.device(device_index):
        segments = torch.cuda.memory_snapshot(mempool_id=pool, include_traces=False)
    for seg in segments:
        if int(seg["stream"]) != stream:
            continue
        small = seg["segment_type"] == "small"
        for block in seg["blocks"]:
            if block["state"] == "inactive":
                out.append((int(block["address"]), int(block["address"]) + int(block["size"]), small))
    return out


def release_pool(device_index: int, pool: Any) -> None:
    """Returns one reference on ``pool``; with the last one its free blocks go back to the
    device at the next ``empty_cache``."""
    torch._C._cuda_releasePool(device_index, pool)


def memory_stats(device_index: int) -> dict[str, Any]:
    """The allocator's raw statistics tree (``torch.cuda.memory_stats`` flattens it into a new
    dict on every call: ~0.3 ms on the H200)."""
    return dict(torch._C._cuda_memoryStats(device_index))


# -- storages ---------------------------------------------------------------------------------
def allocator_history_enabled() -> bool:
    """Whether ``torch.cuda.memory._record_memory_history`` is recording (torch >= 2.1)."""
    return bool(torch._C._cuda_isHistoryEnabled())


def clear_cublas_workspaces() -> None:
    """Frees the cuBLAS / cuBLASLt workspaces torch caches per (handle, stream); the next matmul
    on a stream allocates its workspace again (``torch._C._cuda_clearCublasWorkspaces``)."""
    torch._C._cuda_clearCublasWorkspaces()


def nonowning_view(t: Tensor) -> Tensor:
    """A tensor over ``t``'s memory that does not own it: dropping every owning reference hands a
    graph-pool block back to its pool for later captures, while graphs keep writing the same
    addresses at replay (TransformerEngine's ``make_weak_ref``)."""
    st = t.untyped_storage()
    ws = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    view = torch.empty((0,), dtype=t.dtype, device=t.device)
    view.set_(ws, t.storage_offset(), t.size(), t.stride())
    return view


def poison_storage(storage: torch.UntypedStorage, message: str) -> None:
    """Makes every later access to ``storage``'s data (by any tensor over it) raise RuntimeError
    with ``message`` (torch.compile's check for overwritten CUDA-graph outputs). Only for a
    non-owning storage: its memory belongs to someone else and is not freed."""
    torch._C._set_storage_data_ptr_access_error_msg(storage._cdata, message)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references (tensors, storage objects) hold ``storage``'s StorageImpl now."""
    return int(torch._C._storage_Use_Count(storage._cdata))


# -- autograd ---------------------------------------------------------------------------------
# autograd's engine entry point, as torch.autograd.grad calls it (stable since torch 1.8: tensors,
# grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad).
run_backward: Callable[..., tuple[Tensor | None, ...]] | None = getattr(
    getattr(torch.autograd.Variable, "_execution_engine", None), "run_backward", None
)
has_torch_function: Callable[[Any], bool] = torch._C._has_torch_function
functorch_transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active
_autograd_log = logging.getLogger("torch.autograd.graph")


def autograd_log_quiet() -> bool:
    """True when autograd's debug log (which torch.autograd.grad feeds) is off."""
    return _autograd_log.getEffectiveLevel() > logging.DEBUG


def cpp_function_apply(function_class: type) -> Callable[..., Any]:
    """The C++ ``apply`` of an autograd Function class, below torch's Python classmethod (which
    maps pytree over every argument to unwrap functorch wrappers: more than half of a small
    graphed call's host time). Use only outside functorch transforms."""
    apply: Callable[..., Any] = super(torch.autograd.Function, function_class).apply  # type: ignore[misc]
    return apply


def will_engine_execute_node(node: Any) -> bool:
    """Inside a backward: whether the running autograd pass executes ``node`` (a
    ``torch.autograd.grad`` call skips the nodes its outputs do not need)."""
    return bool(torch._C._will_engine_execute_node(node))


# -- tensor hooks (Tensor.register_hook) --
@contextlib.contextmanager
def tensor_hooks_suspended(tensors: Iterable[Tensor | None]) -> Iterator[None]:
    """Hooks registered with ``Tensor.register_hook`` on ``tensors`` do not fire inside.

    The eager engine replays a backward by running autograd over the real parameters; the
    graphed backward's result then reaches each parameter through the outer autograd, which fires
    its hooks. Running them inside as well would fire each hook twice (and apply a hook that
    changes the grad twice), where a CUDA replay runs no autograd at all. A tensor's
    ``_backward_hooks`` dict is what autograd's C++ pre-hook iterates at call time, so emptying
    that same dict suspends them (checked on torch 2.9-2.11); the items go back in order."""
    with _hook_dicts_emptied(getattr(t, "_backward_hooks", None) if t is not None else None for t in tensors):
        yield


# -- module hooks (Module.register_forward_hook and the like) --
_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def module_hooks_suspended(module: torch.nn.Module) -> Iterator[None]:
    """The module's own forward and backward hooks do not fire inside (global hooks and its
    submodules' do).

    The eager engine replays a module's pass by calling it again from inside the outer call,
    which already ran the hooks registered since graphing (torch's rule: none before); a CUDA
    replay runs none. ``nn.Module._call_impl`` reads these four dicts at call time (the
    ``*_with_kwargs`` / ``*_always_called`` companions are looked up by their ids), so emptying
    them suspends the hooks (checked on torch 2.9-2.11); the items go back in order."""
    with _hook_dicts_emptied(module.__dict__.get(name) for name in _MODULE_HOOK_DICTS):
        yield


@contextlib.contextmanager
def _hook_dicts_emptied(dicts: Iterable[dict[Any, Any] | None]) -> Iterator[None]:
    """Empties each non-empty hook dict inside; its items go back in order after, followed by any
    registered while it was empty."""
    saved: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
    for hooks in dicts:
        if hooks:
            saved.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            added = list(hooks.items())  # registered while suspended: keep them, after the old ones
            hooks.clear()
            hooks.update(items)
            hooks.update(added)
