"""TransformerEngine's extensions to make_graphed_callables, planned by the Go core.

Every test runs on the eager engine (CPU: it exercises the same plan and lifecycle as the CUDA
engine) and, marked ``cuda``, on the CUDA engine: pipeline schedules (_order,
_num_layers_per_chunk) with and without buffer reuse trained for 3 SGD iterations and compared
bitwise with eager execution; sample_kwargs; capture-time and warmup hooks; delayed weight
gradients through the generic need_backward_dw()/backward_dw() protocol; validation errors.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import gograph
from gograph.core import _plan
from gograph.engines import capturing_on_this_thread
from gograph.request import _te

from te_models import Block, DelayedLinear, ScaledBlock, init_grads, run_pipeline

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FEATURES = 8
ROWS = 4

# TransformerEngine's test_make_graphed_callables_with_interleaved_pipeline_parallelism order.
ORDER_2x1x3 = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
# 2 chunks x 2 layers x 2 microbatches, interleaved (chunk 2 is fed chunk 1's output).
ORDER_2x2x2 = [1, 1, 2, -2, 2, -1, -2, -1]
# PP=2, VPP=2, rank 0, 4 microbatches (TransformerEngine's slot-memory test order).
ORDER_PP2_VPP2 = [1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1]


def _callable_of(layers: list[int], microbatches: int) -> list[int]:
    out = []
    for c, n in enumerate(layers):
        out += [sum(layers[:c]) + li for _ in range(microbatches) for li in range(n)]
    return out


def _data(device: str, seed: int, keys: list[tuple[int, int]]) -> dict[tuple[int, int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(ROWS, FEATURES, generator=g).to(device) for k in keys}


def _assert_same(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None:
        assert torch.equal(a, b), f"{what} differs: max |diff| {(a - b).abs().max().item()}"


def _train_pipeline(
    device: str,
    order: list[float],
    layers: list[int],
    microbatches: int,
    reuse: bool,
    chain: bool,
    make_layer: Any = Block,
    iters: int = 3,
    chain_buffers: bool = False,
) -> tuple[Any, ...]:
    """Trains a ref (eager) and a graphed copy of the same layers through ``order`` for
    ``iters`` SGD iterations and checks outputs, input grads, params and grads bitwise."""
    n = sum(layers)
    ref = [make_layer(FEATURES, seed=i).to(device) for i in range(n)]
    mods = copy.deepcopy(ref)
    init_grads(*ref, *mods)
    samples = tuple((torch.randn(ROWS, FEATURES, device=device, requires_grad=True),) for _ in range(n * microbatches))
    graphed = gograph.make_graphed_callables(
        tuple(mods),
        samples,
        num_warmup_iters=2,
        allow_unused_input=True,
        _order=order,
        _num_layers_per_chunk=layers,
        _reuse_graph_input_output_buffers=reuse,
        chain_buffers=chain_buffers,
    )
    assert isinstance(graphed, tuple) and len(graphed) == n * microbatches
    assert all(isinstance(g, gograph.GraphedCallable) for g in graphed)
    assert all(m.forward.__func__ is type(m).forward for m in mods)  # modules keep their forward
    for m in mods:  # warmup may have run backward_dw into .grad
        for p in m.parameters():
            p.grad.zero_()
    callable_of = _callable_of(layers, microbatches)
    opt_ref = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    opt_g = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
    chunks = len(layers)
    keys = [(c, m) for c in range(chunks) for m in range(microbatches)]
    for it in range(iters):
        xs = _data(device, 100 + it, keys)
        dys = _data(device, 200 + it, keys)
        inputs_ref = {k: v.clone().requires_grad_() for k, v in xs.items()}
        inputs_g = {k: v.clone().requires_grad_() for k, v in xs.items()}
        opt_ref.zero_grad(set_to_none=False)
        opt_g.zero_grad(set_to_none=False)
        grads_ref: dict[tuple[int, int], torch.Tensor] = {}
        grads_g: dict[tuple[int, int], torch.Tensor] = {}
        out_ref = run_pipeline(
            order,
            layers,
            microbatches,
            lambda p, x: ref[callable_of[p]](x),
            inputs_ref,
            dys,
            chain,
            wgrad=lambda p: ref[callable_of[p]].backward_dw(),
            grads=grads_ref,
        )
        out_g = run_pipeline(
            order,
            layers,
            microbatches,
            lambda p, x: graphed[p](x),
            inputs_g,
            dys,
            chain,
            wgrad=lambda p: graphed[p].backward_dw(),
            grads=grads_g,
        )
        opt_ref.step()
        opt_g.step()
        for k in out_ref:
            _assert_same(out_ref[k], out_g[k], f"iteration {it}: output of chunk/microbatch {k}")
        assert grads_ref.keys() == grads_g.keys() and len(grads_ref) == len(keys)
        for k in grads_ref:
            _assert_same(grads_ref[k], grads_g[k], f"iteration {it}: input grad of chunk/microbatch {k}")
    for i, (a, b) in enumerate(zip(ref, mods)):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            _assert_same(p, q, f"layer {i} {name}")
            _assert_same(p.grad, q.grad, f"layer {i} {name}.grad")
    return graphed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reuse", [False, True], ids=["no-reuse", "reuse"])
def test_interleaved_2_chunks_1_layer_3_microbatches(device: str, reuse: bool) -> None:
    graphed = _train_pipeline(device, ORDER_2x1x3, [1, 1], 3, reuse, chain=False)
    stats = graphed[0].buffer_reuse
    if not reuse:
        assert stats is None
    else:
        assert all(g.buffer_reuse is stats for g in graphed)
        # 4 microbatch-chunks live at once (after 1, 2, 1, 2) plus one grad output buffer,
        # of 6 inputs + 6 grad outputs; TransformerEngine's FIFO keeps 4 + 1 too.
        ((sig, counts),) = stats.signatures.items()
        assert sig.startswith(f"[{ROWS}, {FEATURES}] float32")
        assert counts == {"buffers": 12, "slots": 5, "te_fifo": 5}
        assert (stats.slots, stats.te_fifo, stats.buffers) == (5, 5, 12)
        ptrs = {g.static_input_surface[0].data_ptr() for g in graphed}
        assert len(ptrs) == 4, "6 passes share 4 input buffers"
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reuse", [False, True], ids=["no-reuse", "reuse"])
def test_interleaved_2_chunks_2_layers_2_microbatches(device: str, reuse: bool) -> None:
    graphed = _train_pipeline(device, ORDER_2x2x2, [2, 2], 2, reuse, chain=True)
    if reuse:
        stats = graphed[0].buffer_reuse
        assert stats.slots <= stats.te_fifo < stats.buffers
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reuse", [False, True], ids=["no-reuse", "reuse"])
def test_chained_layers_in_an_interleaved_pipeline(device: str, reuse: bool) -> None:
    """chain_buffers on a schedule: layer 2 of a chunk reads layer 1's output buffer of the same
    microbatch; the pipeline stays bitwise eager, with and without slot reuse."""
    graphed = _train_pipeline(device, ORDER_2x2x2, [2, 2], 2, reuse, chain=True, chain_buffers=True)
    # pass index: chunk prefix * microbatches + microbatch * layers + layer
    for first in (0, 2, 4, 6):
        a, b = graphed[first], graphed[first + 1]
        assert b.chained_inputs == {0} and a.chained_grad_outputs == {0}
        assert b.static_input_surface[0].data_ptr() == a.static_outputs[0].data_ptr()
        assert a.chained_inputs == frozenset()  # a chunk's first layer takes a received tensor
    assert all(g.lent_param_grads == 0 for g in graphed)  # .grad stays owned on schedules
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_pp2_vpp2_rank0_with_reuse(device: str) -> None:
    graphed = _train_pipeline(device, ORDER_PP2_VPP2, [1, 1], 4, True, chain=True)
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_layers_inferred_and_int(device: str) -> None:
    # _num_layers_per_chunk omitted (len(sample_args) / (chunks * microbatches)) or one int.
    for layers_arg in (None, 2):
        mods = [Block(FEATURES, seed=i).to(device) for i in range(4)]
        samples = tuple((torch.randn(ROWS, FEATURES, device=device, requires_grad=True),) for _ in range(8))
        graphed = gograph.make_graphed_callables(
            tuple(mods), samples, _order=ORDER_2x2x2, _num_layers_per_chunk=layers_arg, num_warmup_iters=1
        )
        assert len(graphed) == 8
        # TE's indexing: pass prefix[c]*M + m*L + l runs callable prefix[c] + l.
        assert [g.module for g in graphed] == [mods[i] for i in _callable_of([2, 2], 2)]
        for g in graphed:
            g.reset()


def test_megatron_schedule_plan() -> None:
    # bench/pipeline.py's rank: 4 stages, rank 0, 4 virtual chunks x 2 layers, 8 microbatches.
    order = gograph.megatron_order(4, 0, 4, 8)
    assert len(order) == 64 and order[:18] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [1, 1]
    sched = _plan.plan_schedule(order, 2, 8, 64, True, 1)
    sched.free()
    sched.free()  # harmless twice
    assert gograph.live_plans() == 0
    assert sched.num_passes == 64 and sched.chunks == 4 and sched.microbatches == 8
    assert [s.kind for s in sched.steps].count("F") == 64
    # The first backward is chunk 4's microbatch 0, layers in reverse: passes 3*16 + 1, 3*16.
    first_b = next(s for s in sched.steps if s.kind == "B")
    assert (first_b.pass_index, first_b.callable_index, first_b.chunk) == (49, 7, 4)


# ---------------------------------------------------------------------------------------------
# sample_kwargs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_sample_kwargs(device: str) -> None:
    ref = ScaledBlock(FEATURES, seed=3).to(device)
    mod = copy.deepcopy(ref)
    x = torch.randn(ROWS, FEATURES, device=device, requires_grad=True)
    bias = torch.randn(ROWS, FEATURES, device=device)
    scale = torch.randn(FEATURES, device=device)
    graphed = gograph.make_graphed_callables(mod, (x,), sample_kwargs={"bias": bias, "scale": scale})
    gc = mod.forward
    # kwargs' leaves follow the positional ones, in the dict's key order
    assert gc.static_input_surface[0] is x and gc.static_input_surface[1] is bias
    assert gc.static_input_surface[2] is scale
    for it in range(3):
        g = torch.Generator().manual_seed(it)
        xv, bv, sv, dy = (
            torch.randn(s, generator=g).to(device)
            for s in ((ROWS, FEATURES), (ROWS, FEATURES), (FEATURES,), (ROWS, FEATURES))
        )
        xr, xg = xv.clone().requires_grad_(), xv.clone().requires_grad_()
        out_r = ref(xr, scale=sv, bias=bv)
        out_g = graphed(xg, scale=sv, bias=bv)
        _assert_same(out_r, out_g, "output")
        out_r.backward(dy)
        out_g.backward(dy)
        _assert_same(xr.grad, xg.grad, "input grad")
    for p, q in zip(ref.parameters(), mod.parameters()):
        _assert_same(p.grad, q.grad, "param grad")
    with pytest.raises(TypeError, match="was initialized with kwarg bias, but it was not provided in graph replay"):
        graphed(x, scale=scale)
    with pytest.warns(UserWarning, match=r"ignores keyword argument\(s\) \['other'\]: they hold tensors but were not"):
        out_other = graphed(x, scale=scale, bias=bias, other=bias, is_first_microbatch=True)  # ignored, as in TE
    assert torch.equal(out_other, graphed(x, scale=scale, bias=bias))
    # replay kwargs of TransformerEngine: the current stream / no event
    out = graphed(x, scale=scale, bias=bias, cuda_graph_stream=None, cuda_graph_event=None)
    assert out.shape == (ROWS, FEATURES)
    mod.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_sample_kwargs_with_order(device: str) -> None:
    ref = ScaledBlock(FEATURES, seed=4).to(device)
    mod = copy.deepcopy(ref)
    samples = tuple((torch.randn(ROWS, FEATURES, device=device, requires_grad=True),) for _ in range(2))
    kwargs = tuple({"scale": torch.randn(FEATURES, device=device)} for _ in range(2))
    graphed = gograph.make_graphed_callables(
        (mod,), samples, sample_kwargs=kwargs, _order=[1, -1, 1, -1], _reuse_graph_input_output_buffers=True
    )
    for m in range(2):
        sv = torch.randn(FEATURES, device=device)
        xv = torch.randn(ROWS, FEATURES, device=device)
        xr, xg = xv.clone().requires_grad_(), xv.clone().requires_grad_()
        out_r, out_g = ref(xr, scale=sv), graphed[m](xg, scale=sv)
        _assert_same(out_r, out_g, f"microbatch {m}")
        out_r.sum().backward()
        out_g.sum().backward()
        _assert_same(xr.grad, xg.grad, f"microbatch {m} input grad")
    # both passes' x and scale share slots (their lifetimes do not overlap)
    assert graphed[0].static_input_surface[0].data_ptr() == graphed[1].static_input_surface[0].data_ptr()
    assert graphed[0].static_input_surface[1].data_ptr() == graphed[1].static_input_surface[1].data_ptr()
    for g in graphed:
        g.reset()


def test_fewer_slots_than_te_fifo() -> None:
    # Chunk 1's sample tuple (x, bias) differs from chunk 2's (x): TransformerEngine's FIFO keys
    # whole tuples and keeps two x buffers; per-tensor slots share one.
    mods = (ScaledBlock(FEATURES, seed=0), ScaledBlock(FEATURES, seed=1))
    samples = tuple((torch.randn(ROWS, FEATURES, requires_grad=True),) for _ in range(2))
    kwargs = ({"scale": torch.randn(FEATURES), "bias": torch.randn(ROWS, FEATURES)}, {"scale": torch.randn(FEATURES)})
    graphed = gograph.make_graphed_callables(
        mods,
        samples,
        sample_kwargs=kwargs,
        _order=[1, -1, 2, -2],
        _num_layers_per_chunk=[1, 1],
        _reuse_graph_input_output_buffers=True,
    )
    sig = f"[{ROWS}, {FEATURES}] float32 cpu"
    counts = graphed[0].buffer_reuse.signatures[sig]
    # x of both passes, chunk 1's bias and both grad outputs: 5 buffers; x/bias/dy of chunk 1
    # are live together (3 slots); TE keeps x twice, bias once and one dy (4).
    assert counts == {"buffers": 5, "slots": 3, "te_fifo": 4}
    for g in graphed:
        g.reset()


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------
def _capturing() -> bool:
    if capturing_on_this_thread():
        return True
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@pytest.mark.parametrize("device", DEVICES)
def test_capture_time_hooks_order_and_semantics(device: str) -> None:
    events: list[Any] = []

    def hooks_for(i: int) -> dict[str, dict[Any, Any]]:
        def rec(kind: str) -> Any:
            def hook(module: Any, *args: Any) -> None:
                assert isinstance(module, Block)
                events.append((kind, i, _capturing()))

            return hook

        return {
            "forward_pre_hooks": {0: rec("fwd_pre")},
            "forward_hooks": {0: rec("fwd")},
            "backward_pre_hooks": {0: rec("bwd_pre")},
            "backward_hooks": {0: rec("bwd")},
        }

    mods = tuple(Block(FEATURES, seed=i).to(device) for i in range(3))
    samples = tuple((torch.randn(ROWS, FEATURES, device=device, requires_grad=True),) for _ in range(3))
    gograph.make_graphed_callables(
        mods,
        samples,
        num_warmup_iters=2,
        capture_time_hooks=[hooks_for(0), None, hooks_for(2)],
        pre_warmup_hook=lambda: events.append(("pre_warmup",)),
        post_warmup_hook=lambda: events.append(("post_warmup",)),
    )
    assert not any(e[-1] for e in events if len(e) == 3), "a hook ran inside a capture"
    one = [
        ("fwd_pre", 0),
        ("fwd", 0),
        ("fwd_pre", 2),
        ("fwd", 2),
        ("bwd_pre", 2),
        ("bwd", 2),
        ("bwd_pre", 0),
        ("bwd", 0),
    ]  # forwards 0..n, then backwards n..0
    got = [e[:2] if len(e) == 3 else e for e in events]
    assert got == [("pre_warmup",), *one, *one, ("post_warmup",), *one]  # 2 warmups, then capture
    events.clear()
    mods[2](mods[1](mods[0](samples[0][0]))).sum().backward()  # replays run no hooks
    assert events == []
    for m in mods:
        m.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_capture_time_hooks_follow_transformer_engines_protocol(device: str) -> None:
    """TransformerEngine (graph.py, _run_capture_time_hooks) calls every capture-time hook as
    hook(module), with sample_kwargs too; a hook written for TE runs unchanged."""
    seen: list[Any] = []
    mod = ScaledBlock(FEATURES, seed=0).to(device)
    scale = torch.randn(FEATURES, device=device)
    hooks = [
        {
            "forward_pre_hooks": {"a": lambda m: seen.append(("pre", type(m).__name__))},
            "forward_hooks": {"b": lambda m: seen.append(("fwd", m is mod))},
            "backward_pre_hooks": None,  # None entries are allowed, as in TE
        }
    ]
    gograph.make_graphed_callables(
        mod,
        (torch.randn(ROWS, FEATURES, device=device, requires_grad=True),),
        sample_kwargs={"scale": scale},
        num_warmup_iters=1,
        capture_time_hooks=hooks,
    )
    assert seen == [("pre", "ScaledBlock"), ("fwd", True)] * 2  # one warmup, one capture
    mod.reset()


def test_capture_time_hook_validation() -> None:
    mods = (Block(FEATURES, 0), Block(FEATURES, 1))
    samples = tuple((torch.randn(ROWS, FEATURES, requires_grad=True),) for _ in range(2))
    cases = [
        ([None], ValueError, "capture_time_hooks has 1 entries, but there are 2 callables."),
        ([[], None], TypeError, r"capture_time_hooks\[0\] must be a dict or None, got list"),
        ([{"bogus": {}}, None], ValueError, r"Found unexpected keys in capture_time_hooks \(\{'bogus'\}\)"),
        ([{"forward_pre_hooks_with_kwargs": {}}, None], ValueError, "Found unexpected keys"),
        (
            [None, {"forward_hooks": []}],
            TypeError,
            r"capture_time_hooks\[1\]\['forward_hooks'\] must be a dict of hook functions",
        ),
        (
            [{"forward_hooks": {0: lambda m: m}}, None],
            RuntimeError,
            r"capture_time_hooks forward_hooks must not return a value\.$",
        ),
        (
            [{"backward_pre_hooks": {0: lambda m: 1}}, None],
            RuntimeError,
            "capture_time_hooks backward_pre_hooks must not return a value",
        ),
    ]
    for hooks, exc, match in cases:
        with pytest.raises(exc, match=match):
            gograph.make_graphed_callables(mods, samples, capture_time_hooks=hooks, num_warmup_iters=1)
    with pytest.raises(TypeError, match="pre_warmup_hook must be callable"):
        gograph.make_graphed_callables(mods, samples, pre_warmup_hook=3)


def test_post_warmup_hook_runs_when_warmup_fails() -> None:
    calls: list[str] = []

    def boom(module: Any) -> None:
        raise KeyError("hook failed")

    with pytest.raises(KeyError, match="hook failed"):
        gograph.make_graphed_callables(
            Block(FEATURES, 0),
            (torch.randn(ROWS, FEATURES, requires_grad=True),),
            capture_time_hooks=[{"forward_pre_hooks": {0: boom}}],
            pre_warmup_hook=lambda: calls.append("pre"),
            post_warmup_hook=lambda: calls.append("post"),
        )
    assert calls == ["pre", "post"]


def test_a_pre_warmup_hook_error_is_raised_as_the_hooks_not_a_callables() -> None:
    """No callable has run yet: the error must not name one (it named the last callable set up)."""

    def broken() -> None:
        raise ValueError("hook broke")

    live = gograph.live_passes()
    blocks = (Block(FEATURES, 0), Block(FEATURES, 1))
    samples = tuple((torch.randn(ROWS, FEATURES, requires_grad=True),) for _ in blocks)
    with pytest.raises(ValueError) as info:
        gograph.make_graphed_callables(blocks, samples, pre_warmup_hook=broken)
    assert str(info.value) == "hook broke"
    assert gograph.live_passes() == live  # rolled back


# ---------------------------------------------------------------------------------------------
# Delayed weight gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_delayed_wgrad_protocol(device: str) -> None:
    ref = DelayedLinear(FEATURES, seed=5).to(device)
    mod = copy.deepcopy(ref)
    init_grads(ref, mod)
    x = torch.randn(ROWS, FEATURES, device=device, requires_grad=True)
    graphed = gograph.make_graphed_callables(mod, (x,), num_warmup_iters=2)
    assert graphed is mod and callable(mod.backward_dw)
    # the weight gets its grad from backward_dw: it left the static input surface
    assert mod.forward.module_params == (mod.bias,)
    for p in mod.parameters():
        p.grad.zero_()
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(mod.parameters(), lr=0.1)
    for it in range(3):
        g = torch.Generator().manual_seed(it)
        xv, dy = (torch.randn(ROWS, FEATURES, generator=g).to(device) for _ in range(2))
        xr, xg = xv.clone().requires_grad_(), xv.clone().requires_grad_()
        opt_r.zero_grad(set_to_none=False)
        opt_g.zero_grad(set_to_none=False)
        out_r, out_g = ref(xr), mod(xg)
        _assert_same(out_r, out_g, "output")
        out_r.backward(dy)
        out_g.backward(dy)
        assert torch.count_nonzero(mod.weight.grad) == 0, "the weight grad waits for backward_dw()"
        ref.backward_dw()
        mod.backward_dw()
        _assert_same(xr.grad, xg.grad, "input grad")
        _assert_same(ref.weight.grad, mod.weight.grad, "weight grad")
        _assert_same(ref.bias.grad, mod.bias.grad, "bias grad")
        opt_r.step()
        opt_g.step()
    mod.reset()
    with pytest.raises(RuntimeError, match="was reset"):
        mod.backward_dw()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reuse", [False, True], ids=["no-reuse", "reuse"])
def test_delayed_wgrad_in_order(device: str, reuse: bool) -> None:
    # Weight-gradient entries -(c+0.5) right after their backward, and one after the next forward.
    order = [1, 2, 1, 2, -2, -2.5, -1, -1.5, -2, -1, -1.5, -2.5]
    graphed = _train_pipeline(device, order, [1, 1], 2, reuse, chain=True, make_layer=DelayedLinear)
    for g in graphed:
        assert g._wgrad is not None
        g.reset()
        with pytest.raises(RuntimeError, match="was reset"):
            g.backward_dw()


class _WithProtocol(torch.nn.Linear):
    def need_backward_dw(self) -> bool:
        return True

    def backward_dw(self) -> None:
        pass


def _instance_protocol() -> torch.nn.Module:
    m = torch.nn.Linear(2, 2)
    m.need_backward_dw = lambda: True  # type: ignore[method-assign]
    m.backward_dw = lambda: None  # type: ignore[method-assign]
    return m


def _half_protocol() -> torch.nn.Module:
    m = torch.nn.Linear(2, 2)
    m.backward_dw = lambda: None  # type: ignore[method-assign]  # as a graphed module gets it
    return m


def _non_callable_protocol() -> torch.nn.Module:
    m = torch.nn.Linear(2, 2)
    m.need_backward_dw = True  # type: ignore[assignment]
    m.backward_dw = lambda: None  # type: ignore[method-assign]
    return m


class _PlainProtocol:
    def need_backward_dw(self) -> bool:
        return False

    def backward_dw(self) -> None:
        pass


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: _WithProtocol(2, 2), True),
        (_instance_protocol, True),
        (lambda: torch.nn.Linear(2, 2), False),
        (_half_protocol, False),
        (_non_callable_protocol, False),
        (_PlainProtocol, True),
        (lambda: lambda: None, False),
    ],
    ids=["class-methods", "instance-methods", "none", "only-backward_dw", "non-callable", "plain-object", "function"],
)
def test_wgrad_protocol_detection(make: Any, expected: bool) -> None:
    obj = make()
    assert _te.has_wgrad_protocol(obj) is expected
    # As the warmup looks for them: submodules first, then the graphed module itself.
    wrapper = torch.nn.Sequential(torch.nn.ReLU(), obj) if isinstance(obj, torch.nn.Module) else obj
    found = _te.wgrad_candidates(wrapper)
    assert found == ((obj,) if expected and isinstance(obj, torch.nn.Module) else ())
    if isinstance(obj, torch.nn.Module):
        assert _te.wgrad_candidates(obj) == ((obj,) if expected else ())


def test_backward_dw_is_a_noop_without_delayed_wgrad() -> None:
    mods = (Block(FEATURES, 0),)
    samples = tuple((torch.randn(ROWS, FEATURES, requires_grad=True),) for _ in range(2))
    graphed = gograph.make_graphed_callables(mods, samples, _order=[1, -1, 1, -1])
    for g in graphed:
        g.backward_dw()  # nothing to replay
    graphed[0].reset()
    with pytest.raises(RuntimeError, match="was reset"):
        graphed[0].backward_dw()
    # the other pass is untouched by its sibling's reset
    graphed[1](torch.randn(ROWS, FEATURES, requires_grad=True)).sum().backward()
    graphed[1].reset()
    graphed[1].reset()  # harmless


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _two_layers(delay: bool = False) -> tuple[torch.nn.Module, ...]:
    if delay:
        return (DelayedLinear(FEATURES, seed=0), DelayedLinear(FEATURES, seed=1))
    return (Block(FEATURES, 0), Block(FEATURES, 1))


def _samples(n: int) -> tuple[tuple[torch.Tensor], ...]:
    return tuple((torch.randn(ROWS, FEATURES, requires_grad=True),) for _ in range(n))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (
            dict(_order=[-1, 1, 2, -2]),
            ValueError,
            r"_order entry 0 \(-1\): backward of chunk 1, microbatch 0, comes before its forward",
        ),
        (dict(_order=[1, 2, -2, -1], num_warmup_iters=0), ValueError, r"num_warmup_iters=0 with _order"),
        (dict(_order=[1, 2, -2, True]), TypeError, r"_order entry 3 \(True\) is a bool"),
        (
            dict(_order=[1, 2, -2, -1.25], _num_layers_per_chunk=[1, 1]),
            ValueError,
            r"entry 3 \(-1.25\): a weight-gradient entry must be exactly -\(c\+0.5\)",
        ),
        (
            dict(_order=[1, 2, -2, -1, -1.5], _num_layers_per_chunk=[1, 1]),
            ValueError,
            r"_order entry 4 \(-1.5\): a weight-gradient entry for pass 0 .* no submodule",
        ),
        (
            dict(_order=[1, 2, -2, -1, -1.5]),
            ValueError,
            r"entry 4 \(-1.5\): weight-gradient entries need _num_layers_per_chunk",
        ),
        (
            dict(_order=[1, 2, -2, -1], _num_layers_per_chunk=[1]),
            ValueError,
            r"_num_layers_per_chunk has 1 entries but _order has 2 chunks",
        ),
        (dict(_order=[1, 2, -2]), ValueError, "dimension mismatch"),
        (
            dict(_order=[1, 2, -2, -1], sample_kwargs=({},)),
            ValueError,
            "Pipeline-parallel schedule requires sample_kwargs and sample_args to have the same length, "
            "but got 1 sample_kwargs for 2 sample_args",
        ),
        (
            dict(sample_kwargs=({},)),
            ValueError,
            "Expected sample_kwargs to have the same length as callables, but got 1 sample_kwargs for 2 callables",
        ),
        (dict(sample_kwargs=({"x": 3}, {})), AssertionError, r"leaf 1 of the sample_kwargs of callable 0 .* is a int"),
        (
            dict(_reuse_graph_input_output_buffers=True),
            ValueError,
            "`_order` must be provided when `_reuse_graph_input_output_buffers` is True.",
        ),
        (dict(retain_graph_in_backward="yes"), TypeError, "retain_graph_in_backward must be a bool"),
    ],
)
def test_validation_errors(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        gograph.make_graphed_callables(_two_layers(), _samples(2), **kwargs)


def test_validation_errors_wgrad_and_modes() -> None:
    with pytest.raises(
        ValueError,
        # warmup runs pass by pass (no capture-time hooks): pass 0's backward is the first one
        match=r"_order entry 3 \(-1\): pass 0 .* needs a delayed weight gradient "
        r"\(need_backward_dw\(\) of DelayedLinear is True\), but no -\(c\+0.5\) entry",
    ):
        gograph.make_graphed_callables(
            _two_layers(delay=True), _samples(2), _order=[1, 2, -2, -1], _num_layers_per_chunk=[1, 1]
        )
    with pytest.raises(ValueError, match=r"already has its weight-gradient pass"):
        gograph.make_graphed_callables(
            (DelayedLinear(FEATURES),), _samples(2), _order=[1, 1, -1, -1, -1.5, -1.5], _num_layers_per_chunk=[1]
        )
    evals = tuple(m.eval() for m in _two_layers())
    with pytest.raises(ValueError, match=r"_order entry 2 \(-2\): the callables are in eval mode"):
        gograph.make_graphed_callables(evals, _samples(2), _order=[1, 2, -2, -1])
    with pytest.raises(RuntimeError, match="`_reuse_graph_input_output_buffers` is only available in training mode."):
        gograph.make_graphed_callables(evals, _samples(2), _order=[1, 2], _reuse_graph_input_output_buffers=True)
    with pytest.raises(ValueError, match=r"expected 4 sample_args \(one per layer per microbatch"):
        gograph.make_graphed_callables(
            _two_layers(), _samples(2), _order=[1, 1, 2, 2, -2, -2, -1, -1], _num_layers_per_chunk=1
        )


@pytest.mark.parametrize("device", DEVICES)
def test_eval_order_forward_only(device: str) -> None:
    mods = tuple(Block(FEATURES, i).to(device).eval() for i in range(2))
    samples = tuple((torch.randn(ROWS, FEATURES, device=device),) for _ in range(4))
    graphed = gograph.make_graphed_callables(mods, samples, _order=[1, 2, 1, 2])
    with torch.no_grad():
        for p, g in enumerate(graphed):
            x = torch.randn(ROWS, FEATURES, device=device)
            _assert_same(mods[p // 2](x), g(x), f"pass {p}")
    for g in graphed:
        assert not g.has_backward
        g.reset()


def test_same_module_in_several_chunks() -> None:
    # TransformerEngine's tests graph (module,) * variants with _order.
    block = Block(FEATURES, 0)
    graphed = gograph.make_graphed_callables(
        (block, block), _samples(2), _order=[1, 2, -2, -1], _num_layers_per_chunk=[1, 1], num_warmup_iters=1
    )
    x = torch.randn(ROWS, FEATURES, requires_grad=True)
    expected = block(x)
    _assert_same(graphed[0](x), expected, "chunk 1")
    _assert_same(graphed[1](x), expected, "chunk 2")
    for g in graphed:
        g.reset()


def test_retain_graph_in_backward() -> None:
    mod = Block(FEATURES, 0)
    x = torch.randn(ROWS, FEATURES, requires_grad=True)
    gograph.make_graphed_callables(mod, (x,), retain_graph_in_backward=True, num_warmup_iters=1)
    assert mod.forward.engine.name == "eager"
    out = mod(x)
    out.sum().backward()
    assert x.grad is not None
    mod.reset()


def test_encode_order() -> None:
    assert _plan.encode_order([1, 2, -2, -2.5, -1.0]) == "1,2,-2,-2.5,-1.0"
    with pytest.raises(TypeError, match="is a str"):
        _plan.encode_order([1, "2"])
    with pytest.raises(TypeError, match="must be a list"):
        _plan.encode_order("1,2")
    assert _plan.encode_layers(None) == "" and _plan.encode_layers(3) == "*3"
    assert _plan.encode_layers([1, 2]) == "1,2"


@pytest.mark.parametrize("debug", [False, True], ids=["shared-input-guard", "debug-guard"])
def test_eager_engine_catches_replays_outside_the_schedule(debug: bool) -> None:
    # Buffer reuse is only valid for replays in schedule order: two passes that share an input
    # slot, run overlapping, would have the second forward overwrite the slot the first one's
    # backward still reads (a graph would silently compute from it). The shared-input guard
    # refuses that copy-in, naming both callables; in debug mode the replay-order guard refuses
    # the second forward before that.
    mods = (Block(FEATURES, 0), Block(FEATURES, 1))
    graphed = gograph.make_graphed_callables(
        mods,
        _samples(6),
        _order=ORDER_2x1x3,
        num_warmup_iters=1,
        _reuse_graph_input_output_buffers=True,
        debug_replay_order=debug,
    )
    by_ptr: dict[int, list[int]] = {}
    for p, g in enumerate(graphed):
        by_ptr.setdefault(g.static_input_surface[0].data_ptr(), []).append(p)
    a, b = next(v for v in by_ptr.values() if len(v) > 1)[:2]
    assert 0 in graphed[a].shared_inputs and 0 in graphed[b].shared_inputs
    out_a = graphed[a](torch.randn(ROWS, FEATURES, requires_grad=True))
    before = graphed[a].static_input_surface[0].clone()
    if debug:
        with pytest.raises(RuntimeError, match="replay order: refusing to replay the forward"):
            graphed[b](torch.randn(ROWS, FEATURES, requires_grad=True))
    else:
        with pytest.raises(gograph.SharedInputError, match=rf"callable {b} .*callable {a} .*backward has not run"):
            graphed[b](torch.randn(ROWS, FEATURES, requires_grad=True))
    assert torch.equal(graphed[a].static_input_surface[0], before)  # nothing written
    out_a.sum().backward()  # the first forward's backward still computes from its input
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_keyword_only_inputs(device: str) -> None:
    # TransformerEngine's FSDP tests graph modules called with kwargs only: sample_args == ().
    ref = Block(FEATURES, seed=2).to(device)
    mod = copy.deepcopy(ref)
    sample = torch.randn(ROWS, FEATURES, device=device, requires_grad=True)
    graphed = gograph.make_graphed_callables(mod, (), sample_kwargs={"x": sample}, num_warmup_iters=1)
    assert mod.forward.static_input_surface[0] is sample
    xv = torch.randn(ROWS, FEATURES, device=device)
    xr, xg = xv.clone().requires_grad_(), xv.clone().requires_grad_()
    out_r, out_g = ref(x=xr), graphed(x=xg)
    _assert_same(out_r, out_g, "output")
    out_r.sum().backward()
    out_g.sum().backward()
    _assert_same(xr.grad, xg.grad, "input grad")
    with pytest.raises(TypeError, match="was initialized with kwarg x"):
        graphed(xg)
    mod.reset()
