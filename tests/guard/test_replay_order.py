"""The replay-order guard (``debug_replay_order=True`` / ``GOGRAPH_DEBUG=1``), on the eager engine.

Graphs that share a memory pool are safe only when replayed in capture order; with the guard on,
the Go core refuses (RuntimeError, naming both graphed callables) the first replay that could
overwrite memory another pass still needs. The rule's table tests are in Go
(internal/state/order_test.go); these check the wiring end to end.
"""

from __future__ import annotations

import pytest
import torch

import gograph
from gograph.core import _native

from helpers import make_mlp, twin


def _layers(n: int, seed: int = 0, training: bool = True) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    mods = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(n)]
    for m in mods:
        m.train(training)
    return mods


def _graph(mods, debug=True, **kw):
    args = tuple((torch.randn(4, 8, requires_grad=m.training),) for m in mods)
    return gograph.make_graphed_callables(tuple(mods), args, engine="eager", debug_replay_order=debug, **kw)


def _step(mods, x):
    h = x
    for m in mods:
        h = m(h)
    h.square().mean().backward()
    return h


def _guard_on(m) -> bool:
    return bool(_native.core.replay_order_check(m.forward.pass_id))


def _open(m) -> str:
    return str(_native.core.replay_order_state(_native.core.pass_pool(m.forward.pass_id)))


def test_training_order_repeated_passes_and_matches_eager():
    mods = _layers(4)
    refs = [twin(m) for m in mods]
    _graph(mods)
    assert all(_guard_on(m) for m in mods)
    for i in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
        out = _step(mods, x)
        out_ref = _step(refs, x.detach().requires_grad_())
        assert torch.equal(out, out_ref)
    assert _open(mods[0]) == ""  # every pass closed by its backward
    for m, r in zip(mods, refs):
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), r.parameters()))


def test_eval_only_chains_pass():
    # Graphed in eval mode: forward-only passes never stay open.
    mods = _layers(3, training=False)
    with torch.no_grad():
        _graph(mods)
    x = torch.randn(4, 8)
    for _ in range(3):
        for order in (mods, mods[::-1], [mods[2], mods[0]]):
            h = x
            for m in order:
                h = m(h)
    assert _open(mods[0]) == ""


def test_forward_only_use_of_training_graphs_under_no_grad_passes():
    mods = _layers(3)
    _graph(mods)
    x = torch.randn(4, 8, requires_grad=True)
    _step(mods, x)
    with torch.no_grad():  # evaluation between training steps
        for _ in range(3):
            h = x
            for m in mods:
                h = m(h)
    assert _open(mods[0]) == ""
    _step(mods, x)


def test_out_of_order_forward_raises_naming_both_callables():
    mods = _layers(2)
    _graph(mods)
    x = torch.randn(4, 8, requires_grad=True)
    h = mods[1](mods[0](x))  # both open, backwards pending
    static_in = mods[0].forward.static_input_surface[0]
    version = static_in._version
    with pytest.raises(RuntimeError) as info:
        mods[0](x + 1)  # its forward was captured before callable 1's: may overwrite its activations
    assert static_in._version == version, "a refused replay wrote the static input"
    msg = str(info.value)
    assert "replay order" in msg and 'forward of graphed callable 0 ("Sequential"' in msg
    assert 'graphed callable 1 ("Sequential"' in msg and "backward has not run since" in msg
    # The refused replay changed nothing: finishing the step in order works, and so does training.
    h.square().mean().backward()
    assert _open(mods[0]) == ""
    _step(mods, x)


def test_out_of_order_backward_raises():
    a, b = _layers(2)
    _graph([a, b])
    x = torch.randn(4, 8, requires_grad=True)
    ya = a(x)
    yb = b(torch.randn(4, 8, requires_grad=True))  # independent: autograd would allow either order
    with pytest.raises(RuntimeError, match=r"refusing to replay the backward of graphed callable 0") as info:
        ya.sum().backward()
    assert str(info.value).startswith("gograph: replay order: ")  # the prefix of every gograph error
    yb.sum().backward()
    # ya's graph is spent (its backward raised); a fresh step in order works.
    _step([a, b], x)


def test_abandoned_forward_with_grad_is_reported_and_no_grad_is_the_fix():
    mods = _layers(2)
    _graph(mods)
    x = torch.randn(4, 8, requires_grad=True)
    mods[1](mods[0](x))  # outputs dropped, no backward: both passes stay open
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        mods[0](x)
    mods[1].reset()  # resetting (or re-running) a pass closes it
    mods[0](x)


def test_guard_is_off_by_default(monkeypatch):
    monkeypatch.delenv("GOGRAPH_DEBUG", raising=False)
    mods = _layers(2)
    _graph(mods, debug=None)
    assert not any(_guard_on(m) for m in mods)
    assert not mods[0].forward._check_replay_order
    x = torch.randn(4, 8, requires_grad=True)
    mods[1](mods[0](x))
    mods[0](x)  # out of order, but unchecked


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False)])
def test_gograph_debug_env_is_read_at_graphing_time(monkeypatch, value, on):
    monkeypatch.setenv("GOGRAPH_DEBUG", value)
    mods = _layers(1)
    _graph(mods, debug=None)
    monkeypatch.delenv("GOGRAPH_DEBUG")  # later changes do not matter
    assert _guard_on(mods[0]) is on
    assert mods[0].forward.build_stats.debug_replay_order is on


def test_explicit_argument_overrides_env(monkeypatch):
    monkeypatch.setenv("GOGRAPH_DEBUG", "1")
    mods = _layers(1)
    _graph(mods, debug=False)
    assert not _guard_on(mods[0])


def test_separate_calls_sharing_a_pool_follow_the_shared_capture_order():
    """Per-layer make_graphed_callables calls sharing one pool (as Megatron does): the captures
    are ordered across the calls. Graphed one after the other (fwd A, bwd A, fwd B, bwd B), B's
    forward may reuse memory A's backward capture freed -- A's activations -- so running the
    usual fwd A, fwd B, bwd B, bwd A order is refused; capturing all forwards first is the fix."""
    pool = gograph.graph_pool_handle()
    a, b = _layers(2)
    x = torch.randn(4, 8, requires_grad=True)
    for m in (a, b):
        gograph.make_graphed_callables(
            m, (torch.randn(4, 8, requires_grad=True),), pool=pool, engine="eager", debug_replay_order=True
        )
    seq = _native.core.capture_seq
    assert [seq(a.forward.pass_id, 0), seq(a.forward.pass_id, 1), seq(b.forward.pass_id, 0)] == [1, 2, 3]
    # The order they were captured in is fine ...
    for _ in range(2):
        a(x).sum().backward()
        b(x).sum().backward()
    # ... the interleaved one is not.
    ya = a(x)
    with pytest.raises(RuntimeError, match=r"captured after that pass's backward \(capture #3 > #2"):
        b(ya)
    ya.sum().backward()
    a.reset(), b.reset()

    # One call capturing both in training order: the interleaved order is the captured one.
    a2, b2 = _layers(2, seed=3)
    _graph([a2, b2], pool=gograph.graph_pool_handle())
    for _ in range(2):
        _step([a2, b2], x)


def test_reset_pass_leaves_the_guard():
    mods = _layers(2)
    _graph(mods)
    x = torch.randn(4, 8, requires_grad=True)
    mods[1](mods[0](x))
    assert "pass" in _open(mods[0])
    mods[1].reset()
    assert f'"Sequential", pass {mods[1].forward.pass_id}' not in _open(mods[0])


def test_functions_and_single_module():
    f = gograph.make_graphed_callables(
        lambda t: (t * 2).sin(), (torch.randn(3, requires_grad=True),), engine="eager", debug_replay_order=True
    )
    for _ in range(3):
        f(torch.randn(3, requires_grad=True)).sum().backward()
    with torch.no_grad():
        f(torch.randn(3))
    model = make_mlp()
    gograph.make_graphed_callables(model, (torch.randn(2, 8),), debug_replay_order=True)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()


def test_pipeline_schedule_replayed_in_capture_order_passes_and_deviation_is_refused():
    from te_models import Block, run_pipeline

    order = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
    layers, micro, d = [1, 1], 3, 6
    blocks = [Block(d, seed=s) for s in range(2)]
    samples = [(torch.randn(2, d, requires_grad=True),) for _ in range(2 * micro)]
    graphed = gograph.make_graphed_callables(
        tuple(blocks),
        tuple(samples),
        _order=order,
        _num_layers_per_chunk=layers,
        engine="eager",
        debug_replay_order=True,
    )
    g = torch.Generator().manual_seed(0)
    inputs = {(c, m): torch.randn(2, d, generator=g, requires_grad=True) for c in range(2) for m in range(micro)}
    dys = {(c, m): torch.randn(2, d, generator=g) for c in range(2) for m in range(micro)}
    for _ in range(3):
        run_pipeline(order, layers, micro, lambda i, x: graphed[i](x), inputs, dys, chain=True)
    assert _native.core.replay_order_state(_native.core.pass_pool(graphed[0].pass_id)) == ""
    # Deviating: the third microbatch's forward before the first microbatch's backward.
    early = [1, 2, 1, 2, 1]
    with pytest.raises(RuntimeError, match="replay order"):
        run_pipeline(early, layers, micro, lambda i, x: graphed[i](x), inputs, dys, chain=True)
