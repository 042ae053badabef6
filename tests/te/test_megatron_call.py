"""Megatron-LM's call, as its TECudaGraphHelper makes it (megatron/core/transformer/cuda_graphs.py):
TransformerEngine's make_graphed_callables with ``_order``, ``_num_layers_per_chunk``, buffer
reuse, ``sample_kwargs``, ``retain_graph_in_backward`` and ``fp8_enabled=False``, then the returned
graphs handed to each layer per microbatch by Megatron's own index arithmetic. On both engines."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import gograph

from te_models import ScaledBlock, init_grads, run_pipeline

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FEATURES, ROWS = 8, 4
PP, CHUNKS, LAYERS, MICRO = 2, 2, 2, 4  # rank 0 of a 2-stage pipeline, 2 virtual chunks of 2 layers


def _megatron_graphs(device: str, fp8: dict[str, Any]) -> tuple[list[list[ScaledBlock]], Any, dict[str, Any]]:
    chunks = [[ScaledBlock(FEATURES, seed=c * LAYERS + i).to(device) for i in range(LAYERS)] for c in range(CHUNKS)]
    flat = [layer for chunk in chunks for layer in chunk]
    scale = torch.full((ROWS, FEATURES), 0.5, device=device)
    sample_args, sample_kwargs = [], []
    for chunk in chunks:  # Megatron's order of sample args: per chunk, per microbatch, per layer
        for _m in range(MICRO):
            for _layer in chunk:
                sample_args.append((torch.randn(ROWS, FEATURES, device=device, requires_grad=True),))
                sample_kwargs.append({"scale": scale})
    init_grads(*flat)
    graphs = gograph.make_graphed_callables(
        tuple(flat),
        tuple(sample_args),
        allow_unused_input=True,
        _order=gograph.megatron_order(PP, 0, CHUNKS, MICRO),
        retain_graph_in_backward=False,
        num_warmup_iters=1,
        _num_layers_per_chunk=[LAYERS] * CHUNKS,
        _reuse_graph_input_output_buffers=True,
        sample_kwargs=tuple(sample_kwargs),
        **fp8,
    )
    return chunks, graphs, {"scale": scale}


def _assign_like_megatron(chunks: list[list[ScaledBlock]], graphs: Any) -> None:
    """TECudaGraphHelper.create_cudagraphs: layer.cuda_graphs[microbatch]."""
    accumulated = 0
    for layers in chunks:
        for number, layer in enumerate(layers):
            layer.cuda_graphs = [graphs[accumulated * MICRO + b * len(layers) + number] for b in range(MICRO)]
        accumulated += len(layers)


@pytest.mark.parametrize("device", DEVICES)
def test_megatrons_call_trains_like_eager(device: str) -> None:
    fp8 = {"fp8_enabled": False, "fp8_calibrating": False, "fp8_recipe": None, "fp8_weight_caching": False}
    chunks, graphs, kwargs = _megatron_graphs(device, fp8)
    ref_chunks = [[copy.deepcopy(layer) for layer in chunk] for chunk in chunks]
    assert isinstance(graphs, tuple) and len(graphs) == CHUNKS * LAYERS * MICRO
    _assign_like_megatron(chunks, graphs)
    flat = [layer for chunk in chunks for layer in chunk]
    ref_flat = [layer for chunk in ref_chunks for layer in chunk]
    for layer in flat:
        for p in layer.parameters():
            p.grad.zero_()
    init_grads(*ref_flat)

    def pass_of(p: int) -> tuple[int, int]:  # pass index -> (flat layer, microbatch)
        c, rest = divmod(p, LAYERS * MICRO)
        m, li = divmod(rest, LAYERS)
        return c * LAYERS + li, m

    def graphed_call(p: int, x: torch.Tensor) -> torch.Tensor:
        layer, m = pass_of(p)
        return flat[layer].cuda_graphs[m](x, **kwargs)

    gen = torch.Generator().manual_seed(3)
    keys = [(c, m) for c in range(CHUNKS) for m in range(MICRO)]
    xs = {k: torch.randn(ROWS, FEATURES, generator=gen).to(device) for k in keys}
    dys = {k: torch.randn(ROWS, FEATURES, generator=gen).to(device) for k in keys}
    order = gograph.megatron_order(PP, 0, CHUNKS, MICRO)
    layers = [LAYERS] * CHUNKS
    out_g = run_pipeline(order, layers, MICRO, graphed_call, {k: v.clone().requires_grad_() for k, v in xs.items()},
                         dys, chain=True)  # fmt: skip
    out_r = run_pipeline(order, layers, MICRO, lambda p, x: ref_flat[pass_of(p)[0]](x, **kwargs),
                         {k: v.clone().requires_grad_() for k, v in xs.items()}, dys, chain=True)  # fmt: skip
    assert all(torch.equal(out_g[k], out_r[k]) for k in keys)
    for a, b in zip(flat, ref_flat):
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    for g in graphs:
        g.reset()


@pytest.mark.parametrize(
    ("name", "value"),
    [("fp8_enabled", True), ("fp8_enabled", (False, True)), ("enabled", True), ("fp8_calibrating", True)],
)
def test_an_fp8_request_is_refused_by_name(name: str, value: Any) -> None:
    with pytest.raises(NotImplementedError, match=f"{name}=.* asks for FP8/FP4 quantization"):
        _megatron_graphs("cpu", {name: value})
    assert gograph.live_passes() == 0 and gograph.live_plans() == 0


def test_quantization_off_in_every_spelling_is_accepted() -> None:
    off = {"enabled": (False, False), "calibrating": False, "recipe": None, "amax_reduction_group": None,
           "cache_quantized_params": False}  # fmt: skip
    _, graphs, _ = _megatron_graphs("cpu", off)
    for g in graphs:
        g.reset()
    with pytest.raises(TypeError, match="fp8_enabled must be a bool"):
        _megatron_graphs("cpu", {"fp8_enabled": "no"})
