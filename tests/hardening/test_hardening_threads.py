"""Hardening: threads. Independent graphed callables replayed from several Python threads give
the right results; a replay racing a reset of the same callable gets an error saying it was
reset -- never a crash, an IndexError from half-cleared buffers, or a launch of a destroyed
graph; builds on several threads do not see each other's captures. (The Go registry and ledger
themselves are hammered under -race by internal/*/TestConcurrent.)"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import gograph
from gograph.engines import EagerEngine

from helpers import make_mlp, twin

mgc = gograph.make_graphed_callables


@pytest.fixture
def fast_switching():
    """Switch threads as often as possible, to shake out interleavings."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _run_threads(targets) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported to the test thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a thread hung"
    return errors


def test_two_threads_replay_independent_callables(fast_switching):
    engine = EagerEngine()
    models = [make_mlp(seed=s) for s in (1, 2)]
    refs = [twin(m) for m in models]
    for m in models:
        mgc(m, (torch.randn(4, 8, requires_grad=True),), engine=engine)
    inputs = [[torch.randn(4, 8) for _ in range(200)] for _ in models]

    def worker(k: int):
        def run():
            m, r = models[k], refs[k]
            for x in inputs[k]:
                xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
                out = m(xg)
                expect = r(xr)
                assert torch.equal(out, expect)
                out.square().sum().backward()
                expect.square().sum().backward()
                assert torch.equal(xg.grad, xr.grad)

        return run

    errors = _run_threads([worker(0), worker(1)])
    assert not errors, errors
    for m, r in zip(models, refs):
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.equal(p.grad, q.grad)
        m.reset()


@pytest.mark.parametrize("rounds", [40])
def test_replay_racing_reset_gets_a_reset_error(fast_switching, rounds):
    """One thread replays (forward and backward) in a loop while another resets the callable."""
    engine = EagerEngine()
    outcomes: dict[str, int] = {}
    for i in range(rounds):
        m = make_mlp(seed=i)
        mgc(m, (torch.randn(4, 8, requires_grad=True),), engine=engine)
        g = m.forward
        pool = g.pool
        started = threading.Event()
        stop = threading.Event()

        def replay():
            x = torch.randn(4, 8, requires_grad=True)
            n = 0
            while not stop.is_set():
                try:
                    m(x).sum().backward()
                    n += 1
                    started.set()
                except RuntimeError as e:
                    msg = str(e)
                    assert "reset" in msg, f"unexpected error racing a reset: {msg}"
                    outcomes["reset error"] = outcomes.get("reset error", 0) + 1
                    started.set()
                    return
            outcomes["finished before reset"] = outcomes.get("finished before reset", 0) + 1

        def reset():
            started.wait(10)
            for _ in range(i % 7):  # vary the moment
                pass
            g.reset()

        errors = _run_threads([replay, reset, lambda: (started.wait(10), stop.wait(0.05), stop.set())])
        assert not errors, errors
        assert g.is_reset and g.state == "reset"
        assert engine.pool_refs(pool) == 0
        with pytest.raises(RuntimeError, match="was reset"):
            m(torch.randn(4, 8))
    assert outcomes.get("reset error", 0) > 0, outcomes


def test_backward_racing_reset(fast_switching):
    """The forward ran; the reset lands before or during its backward: a reset error or a
    completed backward, nothing else."""
    engine = EagerEngine()
    for i in range(30):
        m = make_mlp(seed=i)
        mgc(m, (torch.randn(4, 8, requires_grad=True),), engine=engine)
        out = m(torch.randn(4, 8, requires_grad=True))
        results: list[str] = []

        def backward():
            try:
                out.sum().backward()
                results.append("done")
            except RuntimeError as e:
                assert "reset" in str(e), str(e)
                results.append("reset")

        errors = _run_threads([backward, m.reset])
        assert not errors, errors
        assert results and results[0] in ("done", "reset")


def test_builds_on_two_threads(fast_switching):
    """make_graphed_callables on two threads at once (sharing the default eager engine): each
    build sees only its own captures (no nested-capture error), and all graphs work."""
    built: list[list[torch.nn.Module]] = [[], []]

    def builder(k: int):
        def run():
            for j in range(10):
                m = make_mlp(seed=10 * k + j)
                mgc(m, (torch.randn(2, 8, requires_grad=True),))
                built[k].append(m)

        return run

    errors = _run_threads([builder(0), builder(1)])
    assert not errors, errors
    for ms in built:
        for m in ms:
            assert m.forward.state == "ready"
            ref = make_mlp(seed=0)
            ref.load_state_dict({k: v for k, v in m.state_dict().items()})
            x = torch.randn(2, 8)
            assert torch.equal(m(x), ref(x))
            m.reset()


def test_finalizers_on_another_thread_while_replaying(fast_switching):
    """Graphed callables dropped (and collected) on one thread while another replays its own."""
    import gc

    keep = make_mlp(seed=99)
    ref = twin(keep)
    mgc(keep, (torch.randn(4, 8),))
    base = gograph.live_passes()

    def churn():
        for i in range(30):
            m = make_mlp(seed=i)
            mgc(m, (torch.randn(4, 8),))
            m(torch.randn(4, 8))
            del m
            gc.collect()

    def replay():
        for _ in range(300):
            x = torch.randn(4, 8)
            assert torch.equal(keep(x), ref(x))

    errors = _run_threads([churn, replay])
    assert not errors, errors
    gc.collect()
    assert gograph.live_passes() == base
    keep.reset()


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_two_threads_on_their_own_streams(cuda_device, no_tf32, fast_switching):
    models = [make_mlp(seed=s, d_in=64, d_hidden=256, d_out=64, device=cuda_device) for s in (1, 2)]
    refs = [twin(m) for m in models]
    for m in models:
        mgc(m, (torch.randn(32, 64, device=cuda_device, requires_grad=True),))
    streams = [torch.cuda.Stream(cuda_device) for _ in models]
    inputs = [[torch.randn(32, 64, device=cuda_device) for _ in range(100)] for _ in models]
    torch.cuda.synchronize(cuda_device)
    results: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]

    def worker(k: int):
        def run():
            m = models[k]
            with torch.cuda.stream(streams[k]):
                for x in inputs[k]:
                    x = x.clone().requires_grad_()
                    out = m(x)
                    out.square().sum().backward()
                    results[k].append((out.detach().clone(), x.grad.clone()))
            streams[k].synchronize()

        return run

    errors = _run_threads([worker(0), worker(1)])
    assert not errors, errors
    torch.cuda.synchronize(cuda_device)
    for k, (m, r) in enumerate(zip(models, refs)):
        for x, (out, gx) in zip(inputs[k], results[k]):
            xr = x.clone().requires_grad_()
            expect = r(xr)
            expect.square().sum().backward()
            assert torch.equal(out, expect.detach())
            assert torch.equal(gx, xr.grad)
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.equal(p.grad, q.grad)
        m.reset()


@pytest.mark.cuda
def test_cuda_replay_on_another_stream_waits_for_the_previous_one(cuda_device, no_tf32):
    """Graphs captured on one stream share its cuBLAS workspace (pytorch#193402): a replay on
    another stream than the previous replay's waits for that stream instead of running beside it."""
    models = [make_mlp(seed=s, d_in=64, d_hidden=256, d_out=64, device=cuda_device) for s in (1, 2)]
    ref = twin(models[1])
    for m in models:
        mgc(m, (torch.randn(32, 64, device=cuda_device),))
    x = torch.randn(32, 64, device=cuda_device)
    a, b = torch.cuda.Stream(cuda_device), torch.cuda.Stream(cuda_device)
    torch.cuda.synchronize(cuda_device)
    with torch.cuda.stream(a):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on stream a, then the first replay
        models[0](x)
    with torch.cuda.stream(b):
        out = models[1](x)
    assert not b.query(), "the replay on stream b ran beside stream a's replay"
    torch.cuda.synchronize(cuda_device)
    assert torch.equal(out, ref(x).detach())
    for m in models:
        m.reset()


@pytest.mark.cuda
def test_cuda_dropout_replay_on_another_stream_keeps_its_mask(cuda_device, no_tf32):
    """The RNG companion of a dropout graph writes the generator's seed/offset holders, which the
    previous replay's kernels read from device memory: a replay on another stream orders those
    writes after the previous replay too, so each replay draws the mask eager draws."""
    model = make_mlp(seed=3, d_in=64, d_hidden=256, d_out=64, dropout=0.3, device=cuda_device)
    ref = twin(model)
    mgc(model, (torch.randn(32, 64, device=cuda_device),))
    x = torch.randn(32, 64, device=cuda_device)
    torch.cuda.manual_seed(7)
    want = [ref(x).detach(), ref(x).detach()]
    a, b = torch.cuda.Stream(cuda_device), torch.cuda.Stream(cuda_device)
    torch.cuda.synchronize(cuda_device)
    torch.cuda.manual_seed(7)
    with torch.no_grad():
        with torch.cuda.stream(a):
            torch.cuda._sleep(200_000_000)  # stream a is busy when stream b's companion replays
            first = model(x).clone()
        with torch.cuda.stream(b):
            second = model(x).clone()
    torch.cuda.synchronize(cuda_device)
    assert not torch.equal(want[0], want[1])
    assert torch.equal(first, want[0]), "the first replay read the second replay's RNG offset"
    assert torch.equal(second, want[1])
    model.reset()


@pytest.mark.cuda
def test_cuda_replay_racing_reset(cuda_device, fast_switching):
    base_graphs = gograph.live_graphs()
    for i in range(20):
        m = make_mlp(seed=i, device=cuda_device)
        mgc(m, (torch.randn(4, 8, device=cuda_device, requires_grad=True),))
        g = m.forward
        started = threading.Event()
        seen: list[str] = []

        def replay():
            x = torch.randn(4, 8, device=cuda_device, requires_grad=True)
            for _ in range(2000):
                try:
                    m(x).sum().backward()
                    started.set()
                except RuntimeError as e:
                    assert "reset" in str(e), str(e)
                    seen.append("reset")
                    started.set()
                    return
            seen.append("finished")

        def reset():
            started.wait(10)
            g.reset()

        errors = _run_threads([replay, reset])
        assert not errors, errors
        torch.cuda.synchronize(cuda_device)
        assert g.state == "reset"
        m = g = None
    import gc

    gc.collect()
    assert gograph.live_graphs() == base_graphs
