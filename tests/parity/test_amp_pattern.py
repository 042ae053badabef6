"""PyTorch's own AMP pattern (test_cuda.py, test_graph_make_graphed_callables with AMP): two MLPs
graphed with fp32 sample args, then trained under autocast, so the second callable receives the
first one's low-precision output and the copy into its fp32 static input casts it (as torch's
does). Dropout included; graphed and eager training end bitwise equal. On both engines."""

from __future__ import annotations

import copy

import pytest
import torch

import gograph

D_IN, H, D_OUT, N = 32, 64, 16, 8


def _models(device: str) -> list[torch.nn.Module]:
    torch.manual_seed(5)
    return [
        torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.Dropout(0.1)).to(device),
        torch.nn.Sequential(torch.nn.Linear(H, D_OUT), torch.nn.Dropout(0.2)).to(device),
    ]


def _train(models: list[torch.nn.Module], device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(9)
    losses = []
    for _ in range(4):
        x, y = torch.randn(N, D_IN, generator=gen).to(device), torch.randn(N, D_OUT, generator=gen).to(device)
        with torch.autocast(device, dtype=dtype, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(models[1](models[0](x)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.bfloat16), pytest.param("cuda", torch.float16, marks=pytest.mark.cuda)],
)
def test_torchs_amp_pattern_trains_like_eager(device: str, dtype: torch.dtype) -> None:
    models = _models(device)
    ref = copy.deepcopy(models)
    samples = ((torch.randn(N, D_IN, device=device),), (torch.randn(N, H, device=device, requires_grad=True),))
    with torch.autocast(device, dtype=dtype, cache_enabled=False):  # as torch's test: capture under autocast
        graphed = gograph.make_graphed_callables(tuple(models), samples)
    torch.manual_seed(1)
    if device == "cuda":
        torch.cuda.manual_seed(1)
    got = _train(list(graphed), device, dtype)
    torch.manual_seed(1)
    if device == "cuda":
        torch.cuda.manual_seed(1)
    want = _train(ref, device, dtype)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(p, q) for a, b in zip(models, ref) for p, q in zip(a.parameters(), b.parameters()))
    for m in graphed:
        m.reset()


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.bfloat16), pytest.param("cuda", torch.float16, marks=pytest.mark.cuda)],
)
def test_a_replay_computes_as_captured_whatever_autocast_says_at_the_call(device: str, dtype: torch.dtype) -> None:
    """A CUDA graph replays the kernels it recorded; the eager engine re-runs under the capture's
    autocast state, so both engines give the autocast result outside autocast, and the fp32 one
    inside autocast for a callable captured without it."""
    lin, plain = torch.nn.Linear(D_IN, H).to(device), torch.nn.Linear(D_IN, H).to(device)
    ref, ref_plain = copy.deepcopy(lin), copy.deepcopy(plain)
    x = torch.randn(N, D_IN, device=device)
    with torch.autocast(device, dtype=dtype, cache_enabled=False):
        gograph.make_graphed_callables(lin, (torch.randn(N, D_IN, device=device),))
        want = ref(x)
    gograph.make_graphed_callables(plain, (torch.randn(N, D_IN, device=device),))
    got = lin(x)  # outside autocast
    assert got.dtype == dtype and torch.equal(got, want)
    with torch.autocast(device, dtype=dtype, cache_enabled=False):
        got_plain = plain(x)
    assert got_plain.dtype == torch.float32 and torch.equal(got_plain, ref_plain(x))
    lin.reset()
    plain.reset()
