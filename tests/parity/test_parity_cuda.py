"""torch.cuda.make_graphed_callables parity on the GPU (marker ``cuda``): multi-callable training
with dict inputs and dropout, AMP, shared pools, RNG state, release points measured on
torch.cuda.memory_allocated."""

from __future__ import annotations

import gc

import pytest
import torch

import gograph

from helpers import make_mlp, twin
from parity_models import OutputRecorder, two_blocks

pytestmark = pytest.mark.cuda


def _train_blocks(head, tail, data, seed: int) -> None:
    params = list(head.parameters()) + list(tail.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    torch.cuda.manual_seed(seed)
    for x, shift, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(tail(head({"x": x, "shift": shift})), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()


def test_dict_inputs_dropout_relu_mse_ten_steps_bitwise_equal(cuda_device, no_tf32):
    head, tail = two_blocks(64, 16, p=0.3, device=cuda_device)
    ref_head, ref_tail = twin(head), twin(tail)
    sample = ({"x": torch.randn(32, 64, device=cuda_device), "shift": torch.randn(32, 64, device=cuda_device)},)
    h = torch.randn(32, 64, device=cuda_device, requires_grad=True)
    gograph.make_graphed_callables((head, tail), (sample, (h,)))
    g = torch.Generator(device="cpu").manual_seed(5)
    data = [
        tuple(torch.randn(*s, generator=g).to(cuda_device) for s in ((32, 64), (32, 64), (32, 16))) for _ in range(10)
    ]
    _train_blocks(head, tail, data, seed=123)
    _train_blocks(ref_head, ref_tail, data, seed=123)
    for p, q in zip(
        list(head.parameters()) + list(tail.parameters()), list(ref_head.parameters()) + list(ref_tail.parameters())
    ):
        assert torch.equal(p, q)
    head.reset()
    tail.reset()


def test_rng_state_unchanged_by_graphing(cuda_device):
    model = make_mlp(d_in=32, d_hidden=64, d_out=8, dropout=0.5, device=cuda_device)
    sample = torch.randn(16, 32, device=cuda_device)
    torch.cuda.manual_seed(99)
    before = torch.cuda.get_rng_state()
    gograph.make_graphed_callables(model, (sample,))
    assert torch.equal(torch.cuda.get_rng_state(), before)
    model.reset()


def test_amp_without_cache_matches_eager_and_cache_raises_torchs_error(cuda_device, no_tf32):
    model = make_mlp(d_in=64, d_hidden=128, d_out=32, device=cuda_device)
    ref = twin(model)
    sample = torch.randn(16, 64, device=cuda_device)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=True):
        with pytest.raises(RuntimeError, match="does not support the autocast caching"):
            gograph.make_graphed_callables(twin(model), (sample,))
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        gograph.make_graphed_callables(model, (sample,))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(16, 64, generator=g).to(cuda_device), torch.randn(16, 32, generator=g).to(cuda_device)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                out = m(x)
            assert out.dtype == torch.bfloat16
            torch.nn.functional.mse_loss(out.float(), y).backward()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    model.reset()


@pytest.mark.parametrize("pool_maker", [gograph.graph_pool_handle, torch.cuda.graph_pool_handle])
def test_separate_calls_share_one_pool(cuda_device, no_tf32, pool_maker):
    pool = pool_maker()
    a = make_mlp(seed=1, d_in=64, d_hidden=256, d_out=64, device=cuda_device)
    b = make_mlp(seed=2, d_in=64, d_hidden=256, d_out=64, device=cuda_device)
    ra, rb = twin(a), twin(b)
    gograph.make_graphed_callables(a, (torch.randn(32, 64, device=cuda_device),), pool=pool)
    gograph.make_graphed_callables(b, (torch.randn(32, 64, device=cuda_device),), pool=pool)
    segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool)]
    in_pool = lambda t: any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"] for s in segments)
    assert in_pool(a.forward.static_outputs[0]) and in_pool(b.forward.static_outputs[0])
    x = torch.randn(32, 64, device=cuda_device)
    # Captured in one pool, in this order: replay in the same order (as torch requires). b was
    # graphed with an input that does not require grad, so it is fed one that does not either.
    with torch.no_grad():
        assert torch.equal(b(a(x)), rb(ra(x)))
    a.reset()
    b.reset()


def test_eval_graphing_releases_warmup_activations_immediately(cuda_device):
    rec = OutputRecorder(width=1024).to(cuda_device).eval()
    x = torch.randn(4096, 1024, device=cuda_device, requires_grad=True)
    with torch.no_grad():  # forward-only (an eval module under grad mode gets a backward, as eagerly)
        gograph.make_graphed_callables(rec, (x,), num_warmup_iters=3)
    assert rec.alive_at_call == [0, 0, 0, 0]
    assert rec.forward.has_backward is False
    rec.reset()


def test_retained_memory_is_static_buffers_and_returns_to_baseline(cuda_device):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = OutputRecorder(width=1024).to(cuda_device)
    x = torch.randn(4096, 1024, device=cuda_device, requires_grad=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    act = x.numel() * x.element_size()  # 16 MiB per activation-sized tensor
    gograph.make_graphed_callables(model, (x,), num_warmup_iters=3)
    torch.cuda.synchronize()
    assert model.alive_at_call == [0, 0, 0, 0]
    retained = torch.cuda.memory_allocated() - base - params - act
    # static output + its saved activation (the relu output is the same tensor), the static
    # grad output, the input grad and the parameter grads: a few activations, not the warmups'
    assert retained < 5 * act, f"{retained / 2**20:.1f} MiB retained"
    model.reset()
    del model, x
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - base <= 2**20
