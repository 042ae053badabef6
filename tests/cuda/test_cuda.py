"""CUDA engine tests: need a GPU and the cuda flavor of the core (marker ``cuda``)."""

from __future__ import annotations

import gc

import pytest
import torch

import gograph
from gograph.engines import BACKWARD, FORWARD, CudaEngine

from helpers import batches, grads_equal, make_mlp, params_equal, twin

pytestmark = pytest.mark.cuda


def _train(model: torch.nn.Module, xs, ys, lr: float = 0.05) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    torch.cuda.synchronize()
    return losses


def test_train_five_steps_bitwise_equal_to_eager(cuda_device, no_tf32):
    model = make_mlp(d_in=64, d_hidden=128, d_out=32, device=cuda_device)
    ref = twin(model)
    xs = batches(5, (16, 64), seed=3, device=cuda_device)
    ys = batches(5, (16, 32), seed=4, device=cuda_device)
    base_graphs = gograph.live_graphs()
    gograph.make_graphed_callables(model, (torch.randn(16, 64, device=cuda_device),))
    gcall = model.forward
    assert isinstance(gcall.engine, CudaEngine)
    assert gograph.live_graphs() == base_graphs + 2  # forward + backward
    assert gograph.core._native.core.pass_graph(gcall.pass_id, FORWARD) != 0
    assert gograph.core._native.core.pass_graph(gcall.pass_id, BACKWARD) != 0

    losses = _train(model, xs, ys)
    losses_ref = _train(ref, xs, ys)
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_ref))
    assert params_equal(model, ref)
    assert grads_equal(model, ref)
    model.reset()
    assert gograph.live_graphs() == base_graphs


def test_outputs_alias_static_buffers_on_cuda(cuda_device, no_tf32):
    model = make_mlp(device=cuda_device)
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8, device=cuda_device),))
    x1, x2 = batches(2, (4, 8), device=cuda_device)
    o1 = model(x1)
    first = o1.clone()
    o2 = model(x2)
    assert o1.data_ptr() == o2.data_ptr() == model.forward.static_outputs[0].data_ptr()
    assert torch.equal(o2, ref(x2))
    assert torch.equal(first, ref(x1))
    model.reset()


def test_live_graphs_back_to_baseline_after_reset_and_delete(cuda_device):
    base_graphs, base_passes = gograph.live_graphs(), gograph.live_passes()
    m1, m2 = make_mlp(seed=1, device=cuda_device), make_mlp(seed=2, device=cuda_device)
    fn = gograph.make_graphed_callables(
        lambda a: a.sin() * 2, (torch.randn(8, device=cuda_device, requires_grad=True),)
    )
    gograph.make_graphed_callables(
        (m1, m2), ((torch.randn(2, 8, device=cuda_device),), (torch.randn(2, 8, device=cuda_device),))
    )
    assert gograph.live_graphs() == base_graphs + 6
    assert gograph.live_passes() == base_passes + 3
    m1.reset()
    assert gograph.live_graphs() == base_graphs + 4
    out = m2(torch.randn(2, 8, device=cuda_device))  # the other callable still works
    out.sum().backward()
    del fn, out
    gc.collect()
    assert gograph.live_graphs() == base_graphs + 2
    del m1, m2
    gc.collect()
    assert gograph.live_graphs() == base_graphs
    assert gograph.live_passes() == base_passes


def test_sync_inside_capture_fails_cleanly_and_next_capture_works(cuda_device):
    base_graphs, base_passes = gograph.live_graphs(), gograph.live_passes()

    def bad(a):
        y = a * 2
        torch.cuda.current_stream().synchronize()  # fine in warmup, illegal during capture
        return y

    with pytest.raises(RuntimeError) as info:
        gograph.make_graphed_callables(bad, (torch.randn(16, device=cuda_device, requires_grad=True),))
    msg = str(info.value)
    assert "callable 0" in msg and "forward capture" in msg
    assert gograph.live_graphs() == base_graphs
    assert gograph.live_passes() == base_passes
    assert not torch.cuda.is_current_stream_capturing()

    model = make_mlp(device=cuda_device)
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8, device=cuda_device),))
    x = torch.randn(4, 8, device=cuda_device)
    assert torch.allclose(model(x), ref(x))
    model.reset()


def test_dropout_bitwise_equal_to_eager_with_same_seed(cuda_device, no_tf32):
    model = make_mlp(d_in=32, d_hidden=256, d_out=16, dropout=0.3, device=cuda_device)
    ref = twin(model)
    xs = batches(5, (64, 32), seed=11, device=cuda_device)
    ys = batches(5, (64, 16), seed=12, device=cuda_device)
    sample = torch.randn(64, 32, device=cuda_device)

    torch.cuda.manual_seed(99)
    state_before = torch.cuda.get_rng_state()
    gograph.make_graphed_callables(model, (sample,))
    assert torch.equal(torch.cuda.get_rng_state(), state_before), "graphing shifted the CUDA RNG"

    torch.cuda.manual_seed(2024)
    losses = _train(model, xs, ys)
    torch.cuda.manual_seed(2024)
    losses_ref = _train(ref, xs, ys)
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_ref))
    assert params_equal(model, ref)
    # masks differ between replays
    a = model(xs[0]).clone()
    b = model(xs[0]).clone()
    assert not torch.equal(a, b)
    model.reset()


def _settled(device: torch.device) -> int:
    """Allocated bytes with nothing cached: cuBLAS keeps a workspace per (handle, stream) for the
    process's lifetime (the first capture on the engine's side stream makes one), which is the
    process's, not the graphs'."""
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def test_memory_back_to_baseline_after_reset_delete_empty_cache(cuda_device):
    base = _settled(cuda_device)
    model = make_mlp(d_in=256, d_hidden=1024, d_out=256, device=cuda_device)
    with_model = torch.cuda.memory_allocated(cuda_device)
    gograph.make_graphed_callables(model, (torch.randn(128, 256, device=cuda_device, requires_grad=True),))
    out = model(torch.randn(128, 256, device=cuda_device))
    out.sum().backward()
    del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(cuda_device) > with_model
    model.reset()
    del model
    assert _settled(cuda_device) == base


def test_tuple_of_callables_on_cuda_matches_eager(cuda_device, no_tf32):
    m1, m2 = make_mlp(seed=1, d_out=8, device=cuda_device), make_mlp(seed=2, device=cuda_device)
    r1, r2 = twin(m1), twin(m2)
    gograph.make_graphed_callables(
        (m1, m2),
        (
            (torch.randn(4, 8, device=cuda_device, requires_grad=False),),
            (torch.randn(4, 8, device=cuda_device, requires_grad=True),),
        ),
    )
    for x in batches(3, (4, 8), device=cuda_device):
        m2(m1(x)).sum().backward()
        r2(r1(x)).sum().backward()
    torch.cuda.synchronize()
    assert grads_equal(m1, r1) and grads_equal(m2, r2)
    m1.reset()
    m2.reset()


def test_eval_mode_on_cuda_and_training_flag_fallback(cuda_device, no_tf32):
    model = make_mlp(dropout=0.5, device=cuda_device).eval()
    ref = twin(model)
    with torch.no_grad():  # forward-only: under grad mode an eval module gets a backward, as eagerly
        gograph.make_graphed_callables(model, (torch.randn(4, 8, device=cuda_device),))
    gcall = model.forward
    assert not gcall.has_backward
    assert gograph.core._native.core.pass_graph(gcall.pass_id, FORWARD) != 0
    assert gograph.core._native.core.pass_graph(gcall.pass_id, BACKWARD) == 0
    x = torch.randn(4, 8, device=cuda_device)
    with torch.no_grad():
        out = model(x)
    assert not out.requires_grad and torch.equal(out, ref(x))
    model.train()
    out_train = model(x)  # original forward, eagerly, with dropout and autograd
    assert out_train.requires_grad
    assert out_train.data_ptr() != gcall.static_outputs[0].data_ptr()
    model.reset()


@pytest.mark.parametrize("sync", ["stream", "device"])
def test_failed_capture_with_rng_leaves_generators_usable(cuda_device, sync):
    """A capture that uses dropout (so it has an RNG companion) and then synchronizes: the
    capture fails, and afterwards eager dropout, the RNG state and the next graph all work."""
    base_graphs, base_passes = gograph.live_graphs(), gograph.live_passes()

    def bad(a):
        y = torch.nn.functional.dropout(a, 0.5, training=True)
        if sync == "stream":
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda.synchronize()
        return y * 2

    sample = torch.randn(64, device=cuda_device, requires_grad=True)
    torch.cuda.manual_seed(3)
    state = torch.cuda.get_rng_state()
    with pytest.raises(RuntimeError, match="forward capture"):
        gograph.make_graphed_callables(bad, (sample,))
    assert gograph.live_graphs() == base_graphs and gograph.live_passes() == base_passes
    assert torch.equal(torch.cuda.get_rng_state(), state)
    # eager RNG still works (the generators are not left in capture mode)
    d = torch.nn.functional.dropout(torch.ones(1000, device=cuda_device), 0.5, training=True)
    assert 0 < int((d == 0).sum()) < 1000
    # the allocator is not left with a capture underway (empty_cache would then free nothing)
    reserved = torch.cuda.memory_reserved(cuda_device)
    big = torch.empty(512 * 2**20, dtype=torch.uint8, device=cuda_device)
    del big
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(cuda_device) <= reserved

    model = make_mlp(dropout=0.5, device=cuda_device)
    ref = twin(model)
    gograph.make_graphed_callables(model, (torch.randn(4, 8, device=cuda_device),))
    x = torch.randn(4, 8, device=cuda_device)
    torch.cuda.manual_seed(8)
    out = model(x).clone()
    torch.cuda.manual_seed(8)
    assert torch.equal(out, ref(x))
    model.reset()


def test_no_warmup_on_cuda_uses_rng_companion(cuda_device, no_tf32):
    model = make_mlp(dropout=0.25, device=cuda_device)
    ref = twin(model)
    gograph.make_graphed_callables(
        model, (torch.randn(8, 8, device=cuda_device, requires_grad=True),), num_warmup_iters=0
    )
    for seed in (1, 2):
        x = torch.randn(8, 8, device=cuda_device, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        torch.cuda.manual_seed(seed)
        out = model(x)
        out.square().sum().backward()
        torch.cuda.manual_seed(seed)
        out_r = ref(xr)
        out_r.square().sum().backward()
        assert torch.equal(out, out_r)
        assert torch.equal(x.grad, xr.grad)
    assert grads_equal(model, ref)
    model.reset()


def test_extra_generator_registered_with_the_engine(cuda_device):
    gen = torch.Generator(device=cuda_device)
    gen.manual_seed(5)
    engine = CudaEngine(cuda_device, generators=[gen])

    def noisy(a):
        return a + torch.rand(a.shape, device=a.device, generator=gen)

    graphed = gograph.make_graphed_callables(noisy, (torch.zeros(16, device=cuda_device),), engine=engine)
    gen.manual_seed(11)
    got = [graphed(torch.zeros(16, device=cuda_device)).clone() for _ in range(2)]
    gen.manual_seed(11)
    want = [torch.rand(16, device=cuda_device, generator=gen) for _ in range(2)]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graphed.reset()


def test_cyclic_garbage_holding_torch_graphs_collected_during_capture_does_not_break_it(cuda_device):
    """A torch CUDAGraph whose last reference sits in a reference cycle becomes garbage while
    gograph captures; allocations inside the capture would trigger the cyclic collector, whose
    finalizer destroys the graph mid-capture (CUDA refuses that and invalidates the capture).
    The CUDA engine keeps the collector off during a capture, so the capture succeeds and the
    garbage is collected afterwards."""
    lin = torch.nn.Linear(8, 8).to(cuda_device)
    side = torch.cuda.Stream(cuda_device)
    xs = torch.randn(2, 8, device=cuda_device)
    side.wait_stream(torch.cuda.current_stream(cuda_device))
    with torch.cuda.stream(side):
        lin(xs)
    torch.cuda.current_stream(cuda_device).wait_stream(side)
    torch_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(torch_graph):
        lin(xs)
    keep = [torch_graph]
    del torch_graph
    freed = []

    class Cycle:
        def __init__(self, graph):
            self.graph, self.me = graph, self

        def __del__(self):
            freed.append(torch.cuda.is_current_stream_capturing())

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            if torch.cuda.is_current_stream_capturing() and keep:
                Cycle(keep.pop())  # now garbage, reachable only from its own cycle
                junk = [[] for _ in range(5000)]  # enough container allocations to trigger a collection
                del junk
            return self.lin(x).relu()

    model = Body().to(cuda_device)
    gograph.make_graphed_callables(model, (torch.randn(4, 8, device=cuda_device, requires_grad=True),))
    gc.collect()
    assert freed == [False], "the cycle must be collected, and only once the capture was over"
    x = torch.randn(4, 8, device=cuda_device, requires_grad=True)
    y = model(x)
    y.sum().backward()
    ref = torch.nn.Linear(8, 8).to(cuda_device)
    ref.load_state_dict(model.lin.state_dict())
    xr = x.detach().requires_grad_()
    ref(xr).relu().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    model.reset()


def test_rng_companions_share_the_engine_pool_even_after_all_were_reset(cuda_device):
    """Every RNG companion of an engine captures into the engine's one anchored pool (a fresh
    pool per companion cost ~42 KB of host memory per capture, never returned): the pool stays
    usable after every companion captured into it was reset."""
    eng = gograph.engines.default_cuda_engine(cuda_device)
    a = make_mlp(seed=1, dropout=0.5, device=cuda_device)
    gograph.make_graphed_callables(a, (torch.randn(4, 8, device=cuda_device, requires_grad=True),))
    pool = eng.rng.pool
    assert pool is not None and eng.rng.companions
    a.reset()
    assert not eng.rng.companions
    b = make_mlp(seed=2, dropout=0.5, device=cuda_device)
    ref = twin(b)
    gograph.make_graphed_callables(b, (torch.randn(4, 8, device=cuda_device, requires_grad=True),))
    assert eng.rng.pool == pool
    x = torch.randn(4, 8, device=cuda_device)
    torch.cuda.manual_seed(11)
    y = b(x)
    torch.cuda.manual_seed(11)
    assert torch.equal(y, ref(x))
    b.reset()
