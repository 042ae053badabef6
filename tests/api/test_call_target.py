"""What a pass runs: a module through its class's ``__call__``, as torch and TransformerEngine warm
up and capture it -- and what the eager engine re-enters at replay so that a re-run is what the
capture ran (the module's own hooks suspended, states integrations record). Eager engine."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import gograph
from gograph.runtime import _capture_state

from helpers import make_mlp, twin

mgc = gograph.make_graphed_callables


class Routed(torch.nn.Module):
    """A class whose ``__call__`` returns what its graphable work returns, not ``forward``'s
    ``(out, None)`` (the shape of Megatron-Core's ``TransformerLayer`` while graphs are made)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.tanh(self.lin(x)), None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x)[0]


class Bf16Call(torch.nn.Module):
    """A class whose ``__call__`` runs its forward under autocast (as TransformerEngine's graphing
    wraps a module class's ``__call__`` in its FP8 autocast)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().__call__(x)


def _train_like(ref: Any, graphed: Any, params: tuple[Any, Any]) -> None:
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_r, out_g = ref(xr), graphed(xg)
        assert isinstance(out_g, torch.Tensor) and out_g.dtype == out_r.dtype and torch.equal(out_r, out_g)
        out_r.float().square().sum().backward()
        out_g.float().square().sum().backward()
        assert torch.equal(xr.grad, xg.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(params[0].parameters(), params[1].parameters()))


def test_a_pass_runs_the_module_through_its_class_call() -> None:
    mod = Routed()
    ref = copy.deepcopy(mod)
    (graphed,) = mgc((mod,), ((torch.randn(4, 8, requires_grad=True),),), _order=[1, -1])
    _train_like(ref, graphed, (ref, mod))
    graphed.reset()


def test_a_graphed_module_keeps_what_its_class_call_adds() -> None:
    mod = Bf16Call()
    ref = copy.deepcopy(mod)
    graphed = mgc(mod, (torch.randn(4, 8, requires_grad=True),))
    _train_like(ref, graphed, (ref, mod))
    mod.reset()


def test_hooks_registered_after_graphing_run_once_per_call() -> None:
    """The eager engine re-runs the module's __call__ inside the outer call: its own hooks stay
    suspended there (a graph replay runs none), and are back afterwards."""
    model = make_mlp()
    ref = twin(model)
    mgc(model, (torch.randn(2, 8, requires_grad=True),))
    calls: dict[str, int] = {"pre": 0, "post": 0, "bwd": 0}
    for m in (model, ref):
        m.register_forward_pre_hook(lambda m, i: calls.__setitem__("pre", calls["pre"] + 1))
        m.register_forward_hook(lambda m, i, o: calls.__setitem__("post", calls["post"] + 1))
        m.register_full_backward_hook(lambda m, gi, go: calls.__setitem__("bwd", calls["bwd"] + 1))
    for m in (model, ref, model):
        m(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert calls == {"pre": 3, "post": 3, "bwd": 3}
    assert len(model._forward_hooks) == len(model._forward_pre_hooks) == len(model._backward_hooks) == 1
    model.reset()


def test_a_module_graphed_again_after_reset_runs_its_forward() -> None:
    model = make_mlp()
    ref = twin(model)
    x = torch.randn(2, 8)
    mgc(model, (x,))
    model.reset()
    mgc(model, (x,))  # its forward is the reset graphed callable: the body must reach the original
    assert torch.equal(model(x), ref(x))
    model.reset()


# ---------------------------------------------------------------------------------------------
# A class whose __call__ routes on state a framework sets while it makes graphs
# (Megatron-Core's GraphableMegatronModule, in small)
# ---------------------------------------------------------------------------------------------
class Framework:
    capturing = False


class RoutedLayer(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(8, 8)
        self.cuda_graphs: list[Any] = []

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return torch.relu(self.lin(x)) * (1.0 if mask is None else mask), None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and (Framework.capturing or self.cuda_graphs):
            if not self.cuda_graphs:  # what the graphs capture: the outputs only
                return (self.forward(*args, **kwargs)[0],)
            out = self.cuda_graphs[0](*args, is_first_microbatch=True, context=None, **kwargs)
            return out[0], None
        return super().__call__(*args, **kwargs)


def _graph_layers(layers: list[RoutedLayer], mask: torch.Tensor) -> None:
    Framework.capturing = True
    try:
        graphs = mgc(
            tuple(layers),
            tuple((torch.randn(4, 8, requires_grad=True),) for _ in layers),
            sample_kwargs=tuple({"mask": mask} for _ in layers),
            _order=[1, -1],
            _num_layers_per_chunk=[len(layers)],
            num_warmup_iters=1,
        )
    finally:
        Framework.capturing = False
    for layer, g in zip(layers, graphs):
        layer.cuda_graphs = [g]


def _framework_state(module: torch.nn.Module) -> _capture_state.StateFactory | None:
    if not (isinstance(module, RoutedLayer) and Framework.capturing):
        return None

    @contextmanager
    def capturing() -> Iterator[None]:
        graphs, module.cuda_graphs, Framework.capturing = module.cuda_graphs, [], True
        try:
            yield
        finally:
            module.cuda_graphs, Framework.capturing = graphs, False

    return capturing


@pytest.fixture
def framework_recorder() -> Iterator[None]:
    _capture_state.register(_framework_state)
    yield
    _capture_state.unregister(_framework_state)


def _step(layers: list[RoutedLayer], x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    h = x
    for layer in layers:
        h, _ = layer(h, mask=mask)
    h.square().sum().backward()
    return h


def test_a_call_routed_on_capture_state_is_refused_without_it() -> None:
    layers = [RoutedLayer(s) for s in range(2)]
    mask = torch.ones(4, 8)
    _graph_layers(layers, mask)
    with pytest.raises(RuntimeError, match=r"called from inside its own module's __call__.*use_gograph"):
        layers[0](torch.randn(4, 8), mask=mask)
    for layer in layers:
        layer.cuda_graphs = []


def test_recorded_capture_state_is_reentered_at_each_eager_replay(framework_recorder: None) -> None:
    layers = [RoutedLayer(s) for s in range(2)]
    refs = copy.deepcopy(layers)
    mask = torch.full((4, 8), 0.5)
    _graph_layers(layers, mask)
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(_step(refs, x, mask), _step(layers, x, mask))
    for ref, layer in zip(refs, layers):
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), layer.parameters()))
        assert layer.cuda_graphs and not Framework.capturing  # the replays put the state back
    for layer in layers:
        layer.cuda_graphs = []


def test_a_recorder_must_be_callable() -> None:
    with pytest.raises(TypeError, match="recorder must be callable"):
        _capture_state.register(3)  # type: ignore[arg-type]
