"""One backward's owned parameter-grad copies (gograph.replay._grad_pack): packed in one allocation
(``_order`` schedules), or in their natural sizes with only the small ones packed (the default
schedule)."""

from __future__ import annotations

import copy

import pytest
import torch

import gograph
from gograph.replay._grad_pack import MIN_OWN_BYTES, owned_copies

WIDTH = 512  # a 512x512 fp32 weight is 1 MiB: a layer's grads are worth packing


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_contiguous_grads_share_one_new_buffer() -> None:
    grads = [torch.randn(WIDTH, WIDTH), torch.randn(WIDTH), torch.randn(3, dtype=torch.float64)]
    with torch.no_grad():  # as in a backward without create_graph
        copies = owned_copies(grads)
    assert len({_storage(c) for c in copies}) == 1
    assert all(_storage(c) != _storage(g) for c, g in zip(copies, grads))
    for c, g in zip(copies, grads):
        assert c.dtype == g.dtype and c.shape == g.shape and c.is_contiguous() and torch.equal(c, g)
        assert (c.data_ptr() - _storage(c)) % 512 == 0  # where the caching allocator would start a block
    grads[0].add_(1)  # copies, not views of the inputs
    assert not torch.equal(copies[0], grads[0])


@pytest.mark.parametrize(
    "grads",
    [
        pytest.param([torch.randn(8, 8), torch.randn(8)], id="below MIN_OWN_BYTES"),
        pytest.param([torch.randn(WIDTH, WIDTH).t(), torch.randn(WIDTH)], id="non-contiguous"),
        pytest.param([torch.randn(WIDTH, WIDTH)], id="one grad"),
    ],
)
def test_clones_each_when_packing_saves_nothing_or_cannot_keep_the_layout(grads: list[torch.Tensor]) -> None:
    with torch.no_grad():
        copies = owned_copies(grads)
    assert len({_storage(c) for c in copies}) == len(grads)
    for c, g in zip(copies, grads):
        assert c.stride() == g.stride() and torch.equal(c, g)


def test_recording_autograd_clones_so_the_copies_stay_differentiable() -> None:
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    grads = [w * 2, w * 3]
    assert sum(g.nbytes for g in grads) >= MIN_OWN_BYTES
    copies = owned_copies(grads)
    assert all(c.grad_fn is not None for c in copies)
    assert len({_storage(c) for c in copies}) == 2


def _layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH)) for _ in range(2)]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_pipeline_grads_pack_per_backward_and_train_like_eager(set_to_none: bool) -> None:
    """An ``_order`` build clones each layer's grads at its first microbatch's backward: one
    allocation per backward, accumulation over microbatches and steps equal to eager's."""
    layers = _layers()
    ref = copy.deepcopy(layers)
    microbatches = 2
    samples = tuple((torch.randn(4, WIDTH, requires_grad=True),) for _ in range(2 * microbatches))
    graphed = gograph.make_graphed_callables(
        tuple(layers), samples, _order=[1, 1, -1, -1], _num_layers_per_chunk=[2], _reuse_graph_input_output_buffers=True
    )
    for _ in range(2):
        xs = [torch.randn(4, WIDTH) for _ in range(microbatches)]
        for calls in ([[graphed[m * 2 + k] for k in range(2)] for m in range(microbatches)], [ref] * microbatches):
            outs = []
            for m, chunk in enumerate(calls):
                h = xs[m].clone().requires_grad_()
                for f in chunk:
                    h = f(h)
                outs.append(h)
            for o in outs:
                o.sum().backward()
        for a, b in zip(layers, ref):
            assert len({_storage(p.grad) for p in a.parameters()}) == 1
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p.grad, q.grad)
        for layer in layers + ref:
            layer.zero_grad(set_to_none=set_to_none)


def test_natural_copies_are_allocations_of_their_own_and_the_small_ones_are_packed() -> None:
    big = [torch.randn(WIDTH, WIDTH), torch.randn(WIDTH, WIDTH)]  # 1 MiB each
    small = [torch.randn(WIDTH * 64), torch.randn(WIDTH * 64)]  # 128 KiB each, 256 KiB together
    many = [torch.randn(WIDTH * 128) for _ in range(5)]  # 256 KiB each, 1.25 MiB together
    with torch.no_grad():
        copies = owned_copies([*big, *small], natural=True)
        packed = owned_copies([*big, *many], natural=True)
    assert len({_storage(c) for c in copies}) == 4  # below 1 MiB together: each cloned
    assert all(c.untyped_storage().nbytes() == g.nbytes for c, g in zip(copies, [*big, *small]))
    assert len({_storage(c) for c in packed[2:]}) == 1  # the small ones: one buffer
    assert len({_storage(c) for c in packed[:2]}) == 2 and _storage(packed[0]) != _storage(packed[2])
    for c, g in zip(packed, [*big, *many]):
        assert torch.equal(c, g) and _storage(c) != _storage(g)


def test_the_default_schedule_copies_a_first_grad_in_its_natural_size() -> None:
    layer = torch.nn.Linear(WIDTH, WIDTH)
    gograph.make_graphed_callables(layer, (torch.randn(4, WIDTH, requires_grad=True),))
    layer(torch.randn(4, WIDTH, requires_grad=True)).sum().backward()
    weight_grad = layer.weight.grad
    assert weight_grad is not None and weight_grad.untyped_storage().nbytes() == weight_grad.nbytes
    assert _storage(weight_grad) != _storage(layer.forward.static_grad_inputs[1])
