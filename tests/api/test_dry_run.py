"""The eager engine's capture is a dry run of a CUDA capture: what a CUDA graph cannot contain is
refused there with CUDA's error, and what it can contain still builds and trains."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import gograph

CUDA_MESSAGE = "operation not permitted when stream is capturing"


def _item(y: torch.Tensor) -> torch.Tensor:
    return y * y.sum().item()


def _branch(y: torch.Tensor) -> torch.Tensor:
    return y * 2 if y.sum() > 0 else y


def _print(y: torch.Tensor) -> torch.Tensor:
    print(y)
    return y


def _tolist(y: torch.Tensor) -> torch.Tensor:
    return y + len(y.tolist())


def _cpu(y: torch.Tensor) -> torch.Tensor:
    return y.cpu()


def _numpy(y: torch.Tensor) -> torch.Tensor:
    return y + float(y.detach().numpy().sum())


def _mask_index(y: torch.Tensor) -> torch.Tensor:
    return y + y[y > 0].sum()


def _mask_set(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[y > 0] = 0
    return y


def _where_one(y: torch.Tensor) -> torch.Tensor:
    return y + torch.where(y > 0)[0].numel()


def _unique(y: torch.Tensor) -> torch.Tensor:
    return y + torch.unique(y.detach()).sum()


def _equal(y: torch.Tensor) -> torch.Tensor:
    return y * 2 if torch.equal(y, y) else y


REFUSED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "item": (_item, "_local_scalar_dense"),
    "branch on a tensor": (_branch, "on the host"),
    "print": (_print, "printing a tensor"),
    "tolist": (_tolist, ".tolist()"),
    "cpu": (_cpu, ".cpu()"),
    "numpy": (_numpy, ".numpy()"),
    "boolean mask index": (_mask_index, "boolean mask"),
    "boolean mask assignment": (_mask_set, "boolean mask"),
    "where(cond)": (_where_one, "nonzero"),
    "unique": (_unique, "unique"),
    "torch.equal": (_equal, "torch.equal"),
}


def _masked_fill(y: torch.Tensor) -> torch.Tensor:
    return y.masked_fill(y > 0, 0.0)


def _where_three(y: torch.Tensor) -> torch.Tensor:
    return torch.where(y > 0, y, -y)


def _dropout(y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(y, 0.5)


def _nonzero_static(y: torch.Tensor) -> torch.Tensor:
    return y + torch.nonzero_static(y > 0, size=4).sum()


ALLOWED = {"masked_fill": _masked_fill, "where(cond, a, b)": _where_three, "dropout": _dropout}
ALLOWED["nonzero_static"] = _nonzero_static


class Tail(torch.nn.Module):
    """A linear layer followed by ``tail`` (the work under test)."""

    def __init__(self, tail: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.tail = tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.lin(x))


def _graph(tail: Callable[[torch.Tensor], torch.Tensor]) -> gograph.GraphedCallable:
    torch.manual_seed(0)
    return gograph.make_graphed_callables(
        Tail(tail), (torch.randn(4, 4, requires_grad=True),), engine=gograph.EagerEngine(dry_run=True)
    )


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_capture_refuses_what_a_cuda_graph_cannot_contain(case: str) -> None:
    tail, what = REFUSED[case]
    graphs, passes = gograph.live_graphs(), gograph.live_passes()
    with pytest.raises(gograph.CaptureUnsupportedError, match=CUDA_MESSAGE) as info:
        _graph(tail)
    message = str(info.value)
    assert what in message
    assert "failed during forward capture" in message and "callable 0 (Tail)" in message
    assert isinstance(info.value, RuntimeError)  # as a CUDA capture's error is
    assert (gograph.live_graphs(), gograph.live_passes()) == (graphs, passes)


def _trains_like_eager(g: torch.nn.Module, twin: torch.nn.Module, steps: int = 2) -> None:
    """``steps`` forwards and backwards of graphed ``g`` and of its eager ``twin`` (same seed before
    each, for dropout): outputs, input grads and parameter grads bitwise equal."""
    for step in range(steps):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step), requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        outs = []
        for module, inp in ((g, x), (twin, x_twin)):
            torch.manual_seed(100 + step)
            y = module(inp)
            y.sum().backward()
            outs.append(y.detach())
        assert torch.equal(outs[0], outs[1]), f"step {step}: output"
        assert torch.equal(x.grad, x_twin.grad), f"step {step}: input grad"  # type: ignore[arg-type]
        for (name, p), q in zip(g.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}.grad"  # type: ignore[arg-type]


@pytest.mark.parametrize("case", sorted(ALLOWED))
def test_what_a_cuda_graph_contains_still_trains(case: str) -> None:
    torch.manual_seed(0)
    twin = Tail(ALLOWED[case])
    g = _graph(ALLOWED[case])
    _trains_like_eager(g, twin)
    g.reset()


def test_warmup_may_read_the_host() -> None:
    """Warmup synchronizes on CUDA too; only the captures run as a CUDA capture would."""
    calls = []

    class CountsWarmups(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if len(calls) < 3:  # warmup's three forwards read the host, the capture does not
                calls.append(x.sum().item())
            return self.lin(x)

    torch.manual_seed(0)
    module = CountsWarmups()
    twin = copy.deepcopy(module)
    g = gograph.make_graphed_callables(
        module, (torch.randn(4, 4, requires_grad=True),), engine=gograph.EagerEngine(dry_run=True)
    )
    assert len(calls) == 3
    _trains_like_eager(g, twin)
    g.reset()


def test_a_backward_that_reads_the_host_is_refused() -> None:
    class HostBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
            return g * float(g.sum().item() != 0)

    with pytest.raises(gograph.CaptureUnsupportedError, match="failed during backward capture"):
        _graph(HostBackward.apply)


def test_synchronize_is_refused_on_the_capturing_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))  # a GPU machine's

    def sync(y: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        return y

    before = torch.cuda.synchronize
    with pytest.raises(gograph.CaptureUnsupportedError, match=r"torch\.cuda\.synchronize\(\) waits"):
        _graph(sync)
    assert torch.cuda.synchronize is before  # unwrapped after the capture
    assert len(synced) == 3  # warmup's three forwards synchronized


def test_a_draw_from_a_generator_the_capture_does_not_carry_is_refused() -> None:
    """A random op on a generator of the caller's own (a tensor-parallel RNG tracker's) captures
    on CUDA only once the engine carries it (``CudaEngine(generators=[g])``): the dry run takes
    the same list and refuses a draw from any other generator."""
    tracker = torch.Generator().manual_seed(3)

    def noisy(y: torch.Tensor) -> torch.Tensor:
        return y + torch.rand(y.shape, generator=tracker)

    sample = (torch.randn(4, 4, requires_grad=True),)
    with pytest.raises(gograph.CaptureUnsupportedError, match="draws from a generator the capture does not carry"):
        gograph.make_graphed_callables(Tail(noisy), sample, engine=gograph.EagerEngine(dry_run=True))
    g = gograph.make_graphed_callables(
        Tail(noisy), sample, engine=gograph.EagerEngine(dry_run=True, generators=[tracker])
    )
    g(torch.randn(4, 4)).sum().backward()
    g.reset()
    with pytest.raises(TypeError, match="generators must be torch.Generator"):
        gograph.EagerEngine(dry_run=True, generators=[3])  # type: ignore[list-item]
