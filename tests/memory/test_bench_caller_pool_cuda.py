"""bench/workloads.py's CallerPool (the footprint bench's eager ``pools=1`` floor arm) on the GPU:
the batch and the loss with its backward land in a pool of their own, the layers' memory stays in
the default pool, and training is unchanged (bitwise) by where the memory sits."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
workloads: Any = pytest.importorskip("workloads")


def _pool_of(t: torch.Tensor) -> tuple[int, int]:
    """The allocator pool of the segment holding ``t`` ((0, 0): the default pool)."""
    ptr = t.untyped_storage().data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg.get("segment_pool_id", (0, 0)))  # type: ignore[return-value]
    raise AssertionError("tensor not found in any segment")


def _train(name: str, pooled: bool) -> tuple[str, dict[str, Any]]:
    device = torch.device("cuda", torch.cuda.current_device())
    wl = workloads.workload(name, small=True)
    layers = wl.build(device)
    calls = wl.eager_calls(layers)
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.01)
    pool = workloads.CallerPool(device) if pooled else None
    gen = torch.Generator(device=device).manual_seed(1)
    seen: dict[str, Any] = {}
    for _ in range(2):
        with workloads.CallerPool.routing(pool):
            batch = wl.batch(gen, device)
        batch.pool = pool
        seen["input"] = _pool_of(batch.inputs[0])
        first = layers[0]
        hook = first.register_forward_hook(lambda _m, _a, out: seen.__setitem__("activation", _pool_of(out)))
        wl.step(calls, batch)
        hook.remove()
        seen["grad"] = _pool_of(next(first.parameters()).grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return str(workloads.param_digest(layers)), seen


@pytest.mark.parametrize("name", ["chain", "pipeline"])
def test_the_caller_pool_holds_the_batch_and_leaves_the_layers(name: str) -> None:
    plain, where = _train(name, pooled=False)
    pooled, routed = _train(name, pooled=True)
    assert pooled == plain
    assert where == {"input": (0, 0), "activation": (0, 0), "grad": (0, 0)}
    assert routed["input"] != (0, 0)
    assert routed["activation"] == (0, 0) and routed["grad"] == (0, 0)


def test_routing_stops_when_the_last_output_has_its_grad() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    pool = workloads.CallerPool(device)
    w = torch.randn(64, 64, device=device, requires_grad=True)
    x = torch.randn(64, 64, device=device) @ w
    after: list[tuple[int, int]] = []
    w.register_hook(lambda g: after.append(_pool_of(g)))  # the layers' backward: after x's grad
    pool.loss_backward(x)
    assert after == [(0, 0)]
    late = torch.empty(1 << 20, device=device)
    assert _pool_of(late) == (0, 0)  # routing ended
