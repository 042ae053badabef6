"""With ``_reuse_graph_input_output_buffers`` a ``sample_args`` list is reorganised in place as
TransformerEngine reorganises it, so the samples no graph reads are freed before warmup.

The reference below is TransformerEngine's rule written out for the test (a FIFO of consumed
entries per sample key, filled at each chunk's backward entry with the passes of its oldest
microbatch in flight); gograph's walk is the core's (``lifetime.ReuseSampleEntries``). With
``chain_buffers`` a chunk's later layers take their microbatch's first entry (they read the
previous output, no sample); with ``share_microbatch_graphs`` the entries are reused per layer.
The training that follows is bitwise eager's; an _order warms up pass by pass.
"""

from __future__ import annotations

import copy
import gc
import weakref
from math import ceil
from typing import Any

import pytest
import torch

import gograph
from gograph import megatron_order

from te_models import Block, init_grads, run_pipeline

F = 8


def te_reorganised(n: int, order: list[int], per_chunk: int, micro: int) -> list[int]:
    """TransformerEngine's mapping, entry -> the entry it becomes, all keys equal."""
    entry, queued, consumed = list(range(n)), {}, []
    fwd = [0] * (max(abs(e) for e in order))
    for c_id in order:
        c = abs(ceil(c_id)) - 1
        if c_id > 0:
            start = c * per_chunk * micro + fwd[c] * per_chunk
            for p in range(start, start + per_chunk):
                queued.setdefault(c, []).append(p)
                if consumed:
                    entry[p] = entry[consumed.pop(0)]
            fwd[c] += 1
        else:
            k = min(len(queued[c]), per_chunk)
            consumed += queued[c][:k]
            queued[c] = queued[c][k:]
    return entry


def _layers(n: int) -> list[torch.nn.Module]:
    return [Block(F, seed=10 + i) for i in range(n)]


def _samples(n: int) -> list[tuple[torch.Tensor, ...]]:
    return [(torch.randn(4, F, requires_grad=True),) for _ in range(n)]


def _which(samples: list[tuple[torch.Tensor, ...]], ids: list[int]) -> list[int]:
    return [ids.index(id(s)) for s in samples]


def _graph_two_layers(samples: Any, micro: int, **options: Any) -> tuple[Any, ...]:
    """One chunk of two layers on rank 0 of two stages, with buffer reuse and ``options``."""
    return gograph.make_graphed_callables(
        tuple(_layers(2)),
        samples,
        _order=megatron_order(2, 0, 1, micro),
        _num_layers_per_chunk=2,
        _reuse_graph_input_output_buffers=True,
        **options,
    )


@pytest.mark.parametrize(("stages", "chunks", "micro"), [(2, 1, 4), (4, 4, 8), (2, 2, 4)])
def test_a_list_is_reorganised_as_transformer_engine_reorganises_it(stages: int, chunks: int, micro: int) -> None:
    order = megatron_order(stages, 0, chunks, micro)
    layers = _layers(chunks * 2)
    samples = _samples(len(layers) * micro)
    ids = [id(s) for s in samples]
    graphed = gograph.make_graphed_callables(
        tuple(layers), samples, _order=order, _num_layers_per_chunk=2, _reuse_graph_input_output_buffers=True
    )
    assert _which(samples, ids) == te_reorganised(len(samples), order, 2, micro)
    stats = graphed[0].buffer_reuse
    assert stats is not None and stats.slots == stats.te_fifo  # one buffer per entry kept, and TE's count
    for g in graphed:
        g.reset()


def test_the_samples_no_graph_reads_are_freed_before_warmup() -> None:
    samples = _samples(2 * 6)
    refs = [weakref.ref(s[0]) for s in samples]
    seen: list[int] = []

    def pre_warmup() -> None:
        gc.collect()
        seen.append(sum(r() is not None for r in refs))

    graphed = _graph_two_layers(samples, 6, pre_warmup_hook=pre_warmup)
    kept = len({id(s) for s in samples})
    assert seen == [kept] and kept < len(refs)  # before warmup, only the entries the list keeps live
    for g in graphed:
        g.reset()


def test_a_tuple_is_left_as_it_is() -> None:
    samples = tuple(_samples(2 * 4))
    before = list(samples)
    graphed = _graph_two_layers(samples, 4)
    assert all(a is b for a, b in zip(samples, before))
    for g in graphed:
        g.reset()


def test_entries_a_graph_reads_differently_are_not_merged() -> None:
    """Unlike TransformerEngine's key (shape, dtype, layout), requires_grad and strides count: an
    entry never becomes one a graph would read differently."""
    samples = _samples(2 * 4)
    for p in range(0, 8, 2):  # every first layer's sample needs no grad
        samples[p] = (samples[p][0].detach(),)
    ids = [id(s) for s in samples]
    graphed = _graph_two_layers(samples, 4)
    got = _which(samples, ids)
    assert all(samples[p][0].requires_grad == (p % 2 == 1) for p in range(8))
    assert all(got[p] % 2 == p % 2 for p in range(8))  # a first layer takes a first layer's entry
    for g in graphed:
        g.reset()


def test_chained_layers_take_their_microbatchs_first_entry() -> None:
    samples = _samples(2 * 6)
    ids = [id(s) for s in samples]
    graphed = _graph_two_layers(samples, 6, chain_buffers=True)
    got = _which(samples, ids)
    assert all(got[p] == got[p - 1] for p in range(1, 12, 2))  # layer 1 -> its microbatch's layer 0
    assert len(set(got)) == 3  # one sample per microbatch in flight (two stages: three in flight)
    assert sum(1 for g in graphed if g.chained_inputs) == 6
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("options", [{}, {"chain_buffers": True}, {"share_microbatch_graphs": True}])
def test_reorganised_builds_train_as_eager(options: dict[str, Any]) -> None:
    micro, order = 6, megatron_order(2, 0, 2, 6)
    graphed_layers = _layers(4)
    eager = copy.deepcopy(graphed_layers)
    init_grads(*graphed_layers, *eager)
    graphed = gograph.make_graphed_callables(
        tuple(graphed_layers),
        _samples(4 * micro),
        _order=order,
        _num_layers_per_chunk=2,
        _reuse_graph_input_output_buffers=True,
        **options,
    )
    if options.get("share_microbatch_graphs"):
        assert len({g.pass_id for g in graphed}) < len(graphed)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        inputs = {(c, m): torch.randn(4, F, generator=gen).requires_grad_() for c in range(2) for m in range(micro)}
        dys = {(c, m): torch.randn(4, F, generator=gen) for c in range(2) for m in range(micro)}
        out_g = run_pipeline(order, [2, 2], micro, lambda p, x: graphed[p](x), inputs, dys, chain=True)
        out_e = run_pipeline(
            order, [2, 2], micro, lambda p, x: eager[(p // (2 * micro)) * 2 + p % 2](x), inputs, dys, chain=True
        )
        assert all(torch.equal(out_g[k], out_e[k]) for k in out_e)
    for a, b in zip(graphed_layers, eager):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    for g in graphed:
        g.reset()


def test_share_with_reuse_keeps_one_sample_per_set_of_graphs() -> None:
    samples = _samples(2 * 8)
    graphed = _graph_two_layers(samples, 8, share_microbatch_graphs=True)
    sets = {g.pass_id for g in graphed}
    assert len({id(s) for s in samples}) == len(sets) == 2 * 3  # three in flight x two layers
    for g in graphed:
        g.reset()


class _Recorder(torch.nn.Module):
    """A layer recording the order of its forwards and backwards while warmup runs."""

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.lin, self.name, self.log = torch.nn.Linear(F, F), name, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(f"f{self.name}")
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(lambda g: self.log.append(f"b{self.name}"))
        return y


def test_an_order_warms_up_pass_by_pass_unless_hooks_need_its_order() -> None:
    """Warmup holds one pass's activations at a time (each pass's forward and backward before the
    next pass); capture-time hooks keep the schedule's order (TransformerEngine's warmup)."""
    order = [1, 1, -1, -1]  # two microbatches of one layer in flight together
    log: list[str] = []
    mod = _Recorder("0", log)
    graphed = gograph.make_graphed_callables((mod,), _samples(2), _order=order, num_warmup_iters=1)
    assert log[:4] == ["f0", "b0", "f0", "b0"]
    for g in graphed:
        g.reset()
    log.clear()
    hooks = ({"forward_pre_hooks": {0: lambda m: None}},)
    graphed = gograph.make_graphed_callables(
        (mod,), _samples(2), _order=order, num_warmup_iters=1, capture_time_hooks=hooks
    )
    assert log[:4] == ["f0", "f0", "b0", "b0"]
    for g in graphed:
        g.reset()
