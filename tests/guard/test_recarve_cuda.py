"""The shared-pool checker on the GPU, with what each graph really writes and reads (recorded
from the allocator during the debug-mode captures).

The bug class (sglang#37606, TensorRT-LLM#17010, Megatron-LM#4433): a later capture re-carves
pool memory an earlier graph's content still occupies at replay time. Here build B shares build
A's pool and its forward capture takes the blocks A's saved activations occupied (free once A's
backward was captured); replaying B's forward between A's forward and A's backward would
overwrite what A's backward reads -- silently, without the checker. A build whose memory is
disjoint from A's interleaves freely, which the capture-order rule used to refuse.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gograph

from te_models import Block, run_pipeline

pytestmark = pytest.mark.cuda


def _mlp(width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)).cuda()


def test_training_order_passes_with_the_checker() -> None:
    torch.manual_seed(0)
    layers = [_mlp(512, i) for i in range(3)]
    refs = copy.deepcopy(layers)
    samples = tuple((torch.randn(256, 512, device="cuda", requires_grad=i > 0),) for i in range(3))
    graphed = gograph.make_graphed_callables(tuple(layers), samples, debug_replay_order=True, chain_buffers=True)
    for step in range(3):
        x = torch.randn(256, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for calls in (graphed, refs):
            h = x
            for c in calls:
                h = c(h)
            h.square().mean().backward()
    assert all(
        torch.equal(p.grad, q.grad) for a, b in zip(layers, refs) for p, q in zip(a.parameters(), b.parameters())
    )
    for g in graphed:
        g.reset()


class ExpSum(torch.nn.Module):
    """``x.exp().sum()``: its forward saves one block (exp's result), its backward allocates
    only the input grad -- so after its capture the saved block is the pool's one free block of
    that size, and the next build's forward of the same shape takes exactly it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp().sum()


def _exp_sum(rows: int, pool: object) -> tuple[torch.nn.Module, torch.Tensor]:
    x = torch.randn(rows, 4096, device="cuda", requires_grad=True)  # rows x 16 KiB: >= 10 MiB, exact segments
    return gograph.make_graphed_callables(ExpSum(), (x,), pool=pool, debug_replay_order=True), x


def test_a_recarved_activation_is_caught_before_it_is_overwritten() -> None:
    pool = gograph.graph_pool_handle()
    (a, x), (b, _) = _exp_sum(2048, pool), _exp_sum(2048, pool)
    a(x).backward()
    b(x).backward()  # each alone: fine
    ya = a(x)
    pa = a.forward.pass_id
    want = (
        rf'forward is about to overwrite pool bytes .* which hold the content pass {pa} \("ExpSum"\) forward '
        rf'wrote and pass {pa} \("ExpSum"\) backward still needs'
    )
    with pytest.raises(RuntimeError, match=want):
        b(x)
    (grad,) = torch.autograd.grad(ya, x)  # A's backward reads what A's forward saved: the refused replay ran nothing
    assert torch.equal(grad, x.detach().exp())
    a.reset()
    b.reset()


def test_buckets_captured_largest_first_sglang_37606() -> None:
    """sglang#37606's shape: one graph per batch-size bucket, captured largest to smallest in one
    shared pool, so every later (smaller) capture re-carves memory an earlier bucket freed. Each
    bucket run through (forward, backward) passes in any bucket order and matches eager; starting
    a smaller bucket while the largest still holds activations its backward reads is caught."""
    pool = gograph.graph_pool_handle()
    buckets = [_exp_sum(rows, pool) for rows in (4096, 2048, 1024)]
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        for i in order:
            g, x = buckets[i]
            xi = torch.randn_like(x).requires_grad_()
            (grad,) = torch.autograd.grad(g(xi), xi)
            assert torch.equal(grad, xi.detach().exp())
    (big, xb), (small, xs) = buckets[0], buckets[1]
    y = big(xb)
    with pytest.raises(RuntimeError, match=r"forward is about to overwrite pool bytes .* backward still needs"):
        small(xs)
    (grad,) = torch.autograd.grad(y, xb)
    assert torch.equal(grad, xb.detach().exp())
    for g, _ in buckets:
        g.reset()


def test_disjoint_builds_interleave_and_train_like_eager() -> None:
    pool = gograph.graph_pool_handle()
    (a, _), (b, _) = _exp_sum(2048, pool), _exp_sum(4096, pool)  # B's 64 MiB fit nowhere A freed
    for step in range(3):
        gen = torch.Generator("cuda").manual_seed(step)
        xa = torch.randn(2048, 4096, device="cuda", generator=gen, requires_grad=True)
        xb = torch.randn(4096, 4096, device="cuda", generator=gen, requires_grad=True)
        ya = a(xa)
        b(xb).backward()  # between A's forward and backward: refused by the capture-order rule
        ya.backward()
        assert torch.equal(xa.grad, xa.detach().exp()) and torch.equal(xb.grad, xb.detach().exp())
    a.reset()
    b.reset()


def test_held_pool_planned_outputs_are_right_or_raise() -> None:
    """TransformerEngine's ``_reuse_graph_input_output_buffers``: a returned output is valid until
    the schedule reuses its memory -- the contract behind "accessing tensor output of CUDAGraphs
    that has been overwritten" (vllm#9724's weak-referenced outputs, TensorRT-LLM#17010). A caller
    that keeps every output of an interleaved pipeline iteration and reads them afterwards gets,
    for each, either exactly what the replay returned or the checker's error naming both graphs,
    never another graph's bytes; at least one was re-carved by a later capture."""
    order, layers, micro = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1], [1, 1], 3
    mods = [Block(64, seed=i).cuda() for i in range(2)]
    samples = tuple((torch.randn(32, 64, device="cuda", requires_grad=True),) for _ in range(6))
    graphed = gograph.make_graphed_callables(
        tuple(mods), samples, _order=order, _num_layers_per_chunk=layers, num_warmup_iters=1,
        _reuse_graph_input_output_buffers=True, debug_replay_order=True,
    )  # fmt: skip
    assert sum(len(g.released_outputs) for g in graphed) > 0
    held: list[tuple[torch.Tensor, torch.Tensor]] = []

    def call(p: int, x: torch.Tensor) -> torch.Tensor:
        y = graphed[p](x)
        held.append((y, y.detach().clone()))
        return y

    keys = [(c, m) for c in range(2) for m in range(micro)]
    inputs = {k: torch.randn(32, 64, device="cuda", requires_grad=True) for k in keys}
    dys = {k: torch.randn(32, 64, device="cuda") for k in keys}
    run_pipeline(order, layers, micro, call, inputs, dys, chain=False)
    caught = 0
    for y, value in held:
        try:
            same = torch.equal(y, value)
        except RuntimeError as e:
            assert "a pool-planned buffer, and pass" in str(e) and "replay overwrote it" in str(e), str(e)
            caught += 1
        else:
            assert same, "a held output changed without the checker noticing"
    assert caught > 0
    held.clear()
    for g in graphed:
        g.reset()
