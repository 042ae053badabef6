"""Hardening: faults while graphing (warmup, forward capture, backward capture, seal) leave nothing
behind -- no pass record, no graph, no pool reference, no allocator routing, no replaced forward,
no hook -- restore the generator state, name the callable index and phase, and the same process
can then graph the same model successfully.

The eager-engine tests run everywhere; the ``cuda`` tests need a GPU and also check device
memory, capture status and RNG companion cleanup (illegal syncs, OOM inside capture)."""

from __future__ import annotations

import gc

import pytest
import torch

import gograph
from gograph.engines import EagerEngine

from helpers import make_mlp, twin

mgc = gograph.make_graphed_callables


class Fault(RuntimeError):
    """Raised by an injected fault."""


class FaultyLayer(torch.nn.Module):
    """A small layer whose forward or backward raises on a chosen call (1-based), counting calls
    so a test can aim at warmup (calls 1..warmup) or capture (call warmup+1)."""

    def __init__(
        self,
        d: int = 8,
        seed: int = 0,
        fail_fwd_at: int = 0,
        fail_bwd_at: int = 0,
        exc: type[BaseException] = Fault,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(d, d, device=device)
        self.fail_fwd_at, self.fail_bwd_at, self.exc = fail_fwd_at, fail_bwd_at, exc
        self.fwd_calls = 0
        self.bwd_calls = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fwd_calls += 1
        if self.fwd_calls == self.fail_fwd_at:
            raise self.exc(f"injected forward fault #{self.fwd_calls}")
        return _BackwardProbe.apply(self.lin(x).tanh(), self)

    def disarm(self) -> None:
        self.fail_fwd_at = self.fail_bwd_at = 0


class _BackwardProbe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, layer):
        ctx.layer = layer
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        layer = ctx.layer
        layer.bwd_calls[0] += 1
        if layer.bwd_calls[0] == layer.fail_bwd_at:
            raise layer.exc(f"injected backward fault #{layer.bwd_calls[0]}")
        return g, None


class _State:
    """What must be back to its value after a failed make_graphed_callables."""

    def __init__(self, engine: EagerEngine | None, pool: object, modules: list[torch.nn.Module]) -> None:
        gc.collect()
        self.engine, self.pool, self.modules = engine, pool, modules
        self.passes, self.graphs = gograph.live_passes(), gograph.live_graphs()
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        self.forwards = [m.__dict__.get("forward") for m in modules]
        self.hooks = _hook_counts(modules)
        self.global_hooks = _global_hook_counts()

    def check(self) -> None:
        gc.collect()
        assert gograph.live_passes() == self.passes, "pass records left behind"
        assert gograph.live_graphs() == self.graphs, "graphs left behind"
        if self.engine is not None:
            assert self.engine.pool_refs(self.pool) == 0, "pool references left behind"
        assert torch.equal(torch.get_rng_state(), self.rng), "CPU generator state not restored"
        if self.cuda_rng is not None:
            assert torch.equal(torch.cuda.get_rng_state(), self.cuda_rng), "CUDA generator state not restored"
        assert [m.__dict__.get("forward") for m in self.modules] == self.forwards, "a forward was replaced"
        for m in self.modules:
            assert not isinstance(m.forward, gograph.GraphedCallable)
            assert "reset" not in m.__dict__ and "backward_dw" not in m.__dict__
        assert _hook_counts(self.modules) == self.hooks, "module hooks changed (a temporary hook left behind?)"
        assert _global_hook_counts() == self.global_hooks, "global module hooks changed"


def _hook_counts(modules: list[torch.nn.Module]) -> list[tuple[int, ...]]:
    """Hooks of every module and submodule (gograph's warmup registers temporary ones)."""
    return [
        (len(s._forward_hooks), len(s._forward_pre_hooks), len(s._backward_hooks), len(s._backward_pre_hooks))
        for m in modules
        for s in m.modules()
    ]


def _global_hook_counts() -> tuple[int, ...]:
    from torch.nn.modules import module as M

    return tuple(
        len(getattr(M, n))
        for n in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
        if hasattr(M, n)
    )


def _layers(n: int, target: int, **fault) -> list[FaultyLayer]:
    return [FaultyLayer(seed=i, **(fault if i == target else {})) for i in range(n)]


def _graph_and_check_matches_eager(layers: list[torch.nn.Module], engine=None, device="cpu") -> None:
    """The same layers graph fine after the failure, and compute what their eager twins do."""
    for m in layers:
        if hasattr(m, "disarm"):
            m.disarm()
    refs = [twin(m) for m in layers]
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in layers)
    mgc(tuple(layers), samples, engine=engine)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = x, xr
    for m, r in zip(layers, refs):
        y, yr = m(y), r(yr)
    assert torch.allclose(y, yr)
    y.square().sum().backward()
    yr.square().sum().backward()
    assert torch.allclose(x.grad, xr.grad)
    for m, r in zip(layers, refs):
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.allclose(p.grad, q.grad)
        m.reset()


# ---------------------------------------------------------------------------------------------
# Eager engine (CPU)
# ---------------------------------------------------------------------------------------------
WARMUP = 2


@pytest.mark.parametrize("target", [0, 2])
@pytest.mark.parametrize(
    "fault, phase",
    [
        (dict(fail_fwd_at=1), "warmup"),
        (dict(fail_fwd_at=WARMUP), "warmup"),
        (dict(fail_bwd_at=1), "warmup"),  # the warmup's backward
        (dict(fail_fwd_at=WARMUP + 1), "forward capture"),
        (dict(fail_bwd_at=WARMUP + 1), "backward capture"),
    ],
)
def test_fault_in_callable_rolls_back_everything(target, fault, phase):
    engine = EagerEngine()
    pool = gograph.graph_pool_handle()
    layers = _layers(3, target, **fault)
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in layers)
    state = _State(engine, pool, layers)
    with pytest.raises(Fault) as info:
        mgc(tuple(layers), samples, num_warmup_iters=WARMUP, pool=pool, engine=engine)
    msg = str(info.value)
    assert f"callable {target} (FaultyLayer) failed during {phase}" in msg, msg
    assert "injected" in msg
    assert isinstance(info.value.__cause__, Fault)
    state.check()
    _graph_and_check_matches_eager(layers, engine=engine)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, MemoryError, torch.OutOfMemoryError])
def test_fault_types_are_kept_and_cleanup_still_runs(exc):
    """BaseExceptions propagate unwrapped (after cleanup); exceptions keep their type."""
    engine = EagerEngine()
    pool = gograph.graph_pool_handle()
    layers = _layers(2, 1, fail_fwd_at=WARMUP + 1, exc=exc)
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in layers)
    state = _State(engine, pool, layers)
    with pytest.raises(exc) as info:
        mgc(tuple(layers), samples, num_warmup_iters=WARMUP, pool=pool, engine=engine)
    if issubclass(exc, Exception):
        assert "callable 1 (FaultyLayer) failed during forward capture" in str(info.value)
    state.check()
    _graph_and_check_matches_eager(layers, engine=engine)


class FaultyEngine(EagerEngine):
    """An eager engine whose own steps fail on demand: {method name: call number}."""

    def __init__(self, fail: dict[str, int]) -> None:
        super().__init__()
        self.fail = dict(fail)
        self.calls: dict[str, int] = {}

    def _tick(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.fail.get(name) == self.calls[name]:
            raise Fault(f"engine step {name} #{self.calls[name]} failed")

    def new_pass(self, callable_index, label):
        self._tick("new_pass")
        return super().new_pass(callable_index, label)

    def _capture(self, pass_id, kind, body, *body_args, pool, uses_rng, mode):
        result = super()._capture(pass_id, kind, body, *body_args, pool=pool, uses_rng=uses_rng, mode=mode)
        self._tick(f"capture{kind}")  # after the kind was attached and the pool ref taken
        return result

    def seal(self, pass_id):
        self._tick("seal")
        return super().seal(pass_id)

    def synchronize(self):
        self._tick("synchronize")


@pytest.mark.parametrize(
    "fail, phase",
    [
        ({"new_pass": 3}, "setup"),
        ({"capture0": 2}, "forward capture"),
        ({"capture1": 3}, "backward capture"),
        ({"seal": 2}, "seal"),
        ({"synchronize": 1}, "warmup"),
        ({"synchronize": 2}, "seal"),
    ],
)
def test_engine_step_failure_rolls_back(fail, phase):
    engine = FaultyEngine(fail)
    pool = gograph.graph_pool_handle()
    layers = _layers(3, -1)
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in layers)
    state = _State(engine, pool, layers)
    with pytest.raises(Fault) as info:
        mgc(tuple(layers), samples, num_warmup_iters=1, pool=pool, engine=engine)
    assert f"failed during {phase}" in str(info.value)
    state.check()
    assert engine.pool_refs(pool) == 0
    engine.fail.clear()
    _graph_and_check_matches_eager(layers, engine=engine)


def test_failure_in_a_later_call_leaves_earlier_graphs_alone():
    engine = EagerEngine()
    first = make_mlp(seed=1)
    ref = twin(first)
    mgc(first, (torch.randn(4, 8),), engine=engine)
    pool = first.forward.pool
    layers = _layers(2, 1, fail_fwd_at=1)
    with pytest.raises(Fault):
        mgc(tuple(layers), tuple((torch.randn(4, 8),) for _ in layers), pool=pool, engine=engine)
    assert engine.pool_refs(pool) == 2 and first.forward.state == "ready"
    x = torch.randn(4, 8)
    assert torch.equal(first(x), ref(x))
    first.reset()


def test_rng_consumed_by_a_failing_warmup_is_restored():
    def noisy(a):
        torch.rand(100)  # consumes the CPU generator
        raise Fault("after consuming RNG")

    torch.manual_seed(7)
    x = torch.randn(3)
    expected = torch.rand(5)
    torch.manual_seed(7)
    x = torch.randn(3)
    with pytest.raises(Fault):
        mgc(noisy, (x,))
    assert torch.equal(torch.rand(5), expected)


def test_hooks_added_by_the_callable_during_a_failed_build_are_the_users_business():
    """gograph adds no hooks of its own: a failed build leaves module hooks as they were."""
    m = FaultyLayer(fail_fwd_at=WARMUP + 1)
    x = torch.randn(4, 8)
    state = _State(None, None, [m])
    with pytest.raises(Fault):
        mgc(m, (x,), num_warmup_iters=WARMUP)
    state.check()


class WgradLinear(torch.nn.Linear):
    """A submodule with the delayed weight-gradient protocol (gograph's warmup hooks it to
    discover such modules), which can fail in forward."""

    def __init__(self, fail_at: int = 0) -> None:
        super().__init__(8, 8)
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise Fault(f"wgrad submodule fault #{self.calls}")
        return super().forward(x)

    def need_backward_dw(self) -> bool:
        return False

    def backward_dw(self) -> None:
        pass


@pytest.mark.parametrize("fail_at, phase", [(1, "warmup"), (2, "warmup"), (WARMUP + 1, "forward capture")])
def test_temporary_warmup_hooks_are_removed_after_a_fault(fail_at, phase):
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), WgradLinear(fail_at=fail_at), torch.nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    state = _State(None, None, [m])
    with pytest.raises(Fault, match=f"callable 0 .* {phase}"):
        mgc(m, (x,), num_warmup_iters=WARMUP)
    state.check()
    m[1].fail_at = 0
    mgc(m, (x,), num_warmup_iters=WARMUP)
    assert _hook_counts([m]) == state.hooks  # and after a successful build too
    m(x).sum().backward()
    m.reset()


def test_hundred_layers_with_one_faulty_then_all_graph():
    """The training-job shape: 100 layers in one call, layer 57 faults in backward capture."""
    engine = EagerEngine()
    pool = gograph.graph_pool_handle()
    layers = _layers(100, 57, fail_bwd_at=2)
    samples = tuple((torch.randn(2, 8, requires_grad=True),) for _ in layers)
    state = _State(engine, pool, layers)
    with pytest.raises(Fault, match="callable 57 .* backward capture"):
        mgc(tuple(layers), samples, num_warmup_iters=1, pool=pool, engine=engine)
    state.check()
    layers[57].disarm()
    mgc(tuple(layers), samples, num_warmup_iters=1, pool=pool, engine=engine)
    assert engine.pool_refs(pool) == 200
    x = torch.randn(2, 8, requires_grad=True)
    y = x
    for m in layers:
        y = m(y)
    y.sum().backward()
    assert x.grad is not None and all(m.lin.weight.grad is not None for m in layers)
    for m in layers:
        m.reset()
    assert engine.pool_refs(pool) == 0


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------
def _cuda_settle(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


class _CudaState(_State):
    """_State plus device memory and capture status."""

    def __init__(self, device: torch.device, modules: list[torch.nn.Module]) -> None:
        # The engine's RNG-companion anchor holds 1 KiB (the default generator's graph-safe
        # seed/offset slots) for the engine's life, once per process: create it before the
        # baseline, so that the baseline is what a failed call must come back to.
        gograph.engines.default_cuda_engine(device).rng._anchored_pool()
        _cuda_settle(device)
        self.device = device
        self.allocated = torch.cuda.memory_allocated(device)
        super().__init__(None, None, modules)

    def check(self) -> None:
        super().check()
        assert not torch.cuda.is_current_stream_capturing()
        _cuda_settle(self.device)
        assert torch.cuda.memory_allocated(self.device) == self.allocated, "device memory left allocated"
        # Allocator routing ended: an allocation on the engine's side stream is ordinary memory
        # that empty_cache can return (a routed one would sit in a private pool).
        eng = gograph.engines.default_cuda_engine(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        with torch.cuda.stream(eng.stream):
            big = torch.empty(256 * 2**20, dtype=torch.uint8, device=self.device)
        del big
        _cuda_settle(self.device)
        assert torch.cuda.memory_reserved(self.device) <= reserved, "allocations still routed to a pool"
        # eager RNG works (generators not left in capture mode)
        d = torch.nn.functional.dropout(torch.ones(1000, device=self.device), 0.5, training=True)
        assert 0 < int((d == 0).sum()) < 1000


@pytest.fixture
def warm_cuda(cuda_device):
    """cuBLAS and friends initialised before baselines are taken."""
    m = FaultyLayer(device=cuda_device)
    mgc(m, (torch.randn(4, 8, device=cuda_device, requires_grad=True),))
    m(torch.randn(4, 8, device=cuda_device, requires_grad=True)).sum().backward()
    m.reset()
    del m
    _cuda_settle(cuda_device)
    return cuda_device


@pytest.mark.cuda
@pytest.mark.parametrize("target", [0, 2])
@pytest.mark.parametrize(
    "fault, phase",
    [
        (dict(fail_fwd_at=1), "warmup"),
        (dict(fail_bwd_at=1), "warmup"),
        (dict(fail_fwd_at=WARMUP + 1), "forward capture"),
        (dict(fail_bwd_at=WARMUP + 1), "backward capture"),
    ],
)
def test_cuda_fault_in_callable_rolls_back_everything(warm_cuda, target, fault, phase):
    dev = warm_cuda
    layers = [FaultyLayer(seed=i, device=dev, **(fault if i == target else {})) for i in range(3)]
    samples = tuple((torch.randn(4, 8, device=dev, requires_grad=True),) for _ in layers)
    state = _CudaState(dev, layers)
    with pytest.raises(Fault) as info:
        mgc(tuple(layers), samples, num_warmup_iters=WARMUP)
    assert f"callable {target} (FaultyLayer) failed during {phase}" in str(info.value)
    del info
    state.check()
    _graph_and_check_matches_eager(layers, device=dev)


def _sync_fault(kind: str):
    def fault(y: torch.Tensor) -> None:
        if kind == "item":
            y.sum().item()
        elif kind == "stream":
            torch.cuda.current_stream().synchronize()
        elif kind == "device":
            torch.cuda.synchronize()
        elif kind == "cpu":
            y.cpu()
        elif kind == "nonzero":
            torch.nonzero(y)  # data-dependent shape: syncs

    return fault


class SyncsAt(torch.nn.Module):
    """Does an illegal-in-capture sync in forward (at call ``at``) or in backward."""

    def __init__(self, kind: str, where: str, at: int, device, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, device=device)
        self.fault, self.where, self.at, self.dropout = _sync_fault(kind), where, at, dropout
        self.calls = [0, 0]

    def forward(self, x):
        self.calls[0] += 1
        y = self.lin(x)
        if self.dropout:
            y = torch.nn.functional.dropout(y, self.dropout, training=True)
        if self.where == "forward" and self.calls[0] == self.at:
            self.fault(y)
        return _SyncInBackward.apply(y, self)

    def disarm(self):
        self.at = 0


class _SyncInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, mod):
        ctx.mod = mod
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        mod = ctx.mod
        mod.calls[1] += 1
        if mod.where == "backward" and mod.calls[1] == mod.at:
            mod.fault(g)
        return g, None


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["item", "stream", "device", "cpu", "nonzero"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_cuda_illegal_sync_inside_capture(warm_cuda, kind, where, dropout):
    dev = warm_cuda
    mods = [SyncsAt(kind, where, at=WARMUP + 1, device=dev, dropout=dropout), FaultyLayer(seed=1, device=dev)]
    samples = tuple((torch.randn(4, 8, device=dev, requires_grad=True),) for _ in mods)
    state = _CudaState(dev, mods)
    phase = "forward capture" if where == "forward" else "backward capture"
    with pytest.raises(Exception) as info:
        mgc(tuple(mods), samples, num_warmup_iters=WARMUP)
    assert f"callable 0 (SyncsAt) failed during {phase}" in str(info.value), str(info.value)
    del info
    state.check()
    mods[0].disarm()
    refs = [twin(m) for m in mods]
    mgc(tuple(mods), samples, num_warmup_iters=WARMUP)
    if not dropout:
        x = torch.randn(4, 8, device=dev)
        assert torch.allclose(mods[1](mods[0](x)), refs[1](refs[0](x)))
    for m in mods:
        m.reset()


class Allocates(torch.nn.Module):
    def __init__(self, nbytes: int, where: str, at: int, device) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, device=device)
        self.nbytes, self.where, self.at, self.calls = nbytes, where, at, [0, 0]

    def forward(self, x):
        self.calls[0] += 1
        if self.where == "forward" and self.calls[0] == self.at:
            torch.empty(self.nbytes, dtype=torch.uint8, device=x.device)
        return _AllocInBackward.apply(self.lin(x), self)

    def disarm(self):
        self.at = 0


class _AllocInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, mod):
        ctx.mod = mod
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        mod = ctx.mod
        mod.calls[1] += 1
        if mod.where == "backward" and mod.calls[1] == mod.at:
            torch.empty(mod.nbytes, dtype=torch.uint8, device=g.device)
        return g, None


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_cuda_allocation_too_large_inside_capture(warm_cuda, where):
    dev = warm_cuda
    too_big = 4 * torch.cuda.get_device_properties(dev).total_memory
    mods = [FaultyLayer(seed=0, device=dev), Allocates(too_big, where, at=WARMUP + 1, device=dev)]
    samples = tuple((torch.randn(4, 8, device=dev, requires_grad=True),) for _ in mods)
    state = _CudaState(dev, mods)
    phase = "forward capture" if where == "forward" else "backward capture"
    # torch.OutOfMemoryError normally; any RuntimeError is accepted (torch's allocator may report
    # a failure inside a capture differently), as long as it names the callable and the phase
    with pytest.raises(RuntimeError) as info:
        mgc(tuple(mods), samples, num_warmup_iters=WARMUP)
    assert f"callable 1 (Allocates) failed during {phase}" in str(info.value)
    print("allocation failure inside capture raised", type(info.value).__name__)
    del info
    state.check()
    mods[1].disarm()
    mgc(tuple(mods), samples, num_warmup_iters=WARMUP)
    out = mods[1](mods[0](torch.randn(4, 8, device=dev, requires_grad=True)))
    out.sum().backward()
    for m in mods:
        m.reset()


@pytest.mark.cuda
def test_cuda_allocation_too_large_in_warmup(warm_cuda):
    dev = warm_cuda
    too_big = 4 * torch.cuda.get_device_properties(dev).total_memory
    mods = [Allocates(too_big, "forward", at=1, device=dev)]
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    state = _CudaState(dev, mods)
    with pytest.raises(torch.OutOfMemoryError, match="callable 0 .* warmup"):
        mgc(tuple(mods), ((x,),))
    state.check()


@pytest.mark.cuda
def test_cuda_fault_then_same_model_graphs_fifty_times(warm_cuda):
    """Faults and successes interleaved in one process: no drift in graphs, passes or memory."""
    dev = warm_cuda
    layers = [FaultyLayer(seed=i, device=dev) for i in range(4)]
    samples = tuple((torch.randn(4, 8, device=dev, requires_grad=True),) for _ in layers)
    state = _CudaState(dev, layers)
    for i in range(50):
        target = layers[i % 4]
        target.fwd_calls, target.bwd_calls[0] = 0, 0
        if i % 2 == 0:
            target.fail_fwd_at = 2 if i % 4 == 0 else 0
            target.fail_bwd_at = 2 if i % 4 == 2 else 0
            with pytest.raises(Fault):
                mgc(tuple(layers), samples, num_warmup_iters=1)
            target.disarm()
        else:
            mgc(tuple(layers), samples, num_warmup_iters=1)
            y = samples[0][0]
            for m in layers:
                y = m(y)
            y.sum().backward()
            del y
            for m in layers:
                m.reset()
                del m.forward, m.reset, m.backward_dw  # back to the plain module
    for m in layers:
        m.zero_grad(set_to_none=True)
    for s in samples:
        s[0].grad = None
    state.check()


@pytest.mark.cuda
def test_cuda_reset_that_fails_to_destroy_still_releases_the_pool(warm_cuda, monkeypatch):
    """A graph the driver fails to destroy does not make reset_pass raise (the core resets the
    pass and returns its pool references all the same, keeping the failure for
    pass_reset_error): the engine releases the pool, then reports the error."""
    dev = warm_cuda
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    _cuda_settle(dev)
    base = torch.cuda.memory_allocated(dev)
    m = FaultyLayer(device=dev)
    mgc(m, (x,))
    m(x).sum().backward()
    monkeypatch.setattr(
        gograph.core._core,
        "pass_reset_error",
        lambda pass_id: "graphed callable 0: destroying its forward graph: injected failure",
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        m.reset()
    monkeypatch.undo()
    assert m.forward.is_reset and m.forward.state == "reset"
    eng = gograph.engines.default_cuda_engine(dev)
    assert eng.pool_refs(m.forward.pool) == 0
    del m
    x.grad = None
    _cuda_settle(dev)
    assert torch.cuda.memory_allocated(dev) == base  # the pool's memory came back
