"""TransformerEngine's reorganisation of an ``_order``'s sample entries for buffer reuse.

With ``_reuse_graph_input_output_buffers``, TransformerEngine walks the schedule before warmup
and replaces each entry of ``sample_args`` (and ``sample_kwargs``) whose static inputs an earlier
microbatch, whose backward already ran, can lend by that earlier entry: ``sample_args[i] =
sample_args[j]``. When the caller passed lists, that happens in the caller's own lists, so the
samples no graph will read are freed during the call, before warmup: the call's memory is then
flat in the microbatch count. gograph does the same (the walk is the core's,
``lifetime.ReuseSampleEntries``), with a stricter key: entries are one only when their leaves
agree in shape, strides, dtype, layout, device and ``requires_grad`` and their structure and
keyword names match, so no graph reads an entry differently than its own. Tuples are left as
they are (their samples then live until the call returns), as in TransformerEngine.

With ``chain_buffers`` a chunk's later layers read the previous layer's output in place and no
sample: each of their ``sample_args`` entries becomes its microbatch's previous layer's entry as
well (when the two match; its ``sample_kwargs`` entry stays its own), so one sample per
microbatch in flight is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor

from ..core import _core, _plan

__all__ = ["reuse_sample_entries"]


def entry_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What must be equal for two entries to be one: the structure, the keyword names and, per
    tensor leaf, shape, strides, dtype, layout, device and requires_grad."""
    leaves, spec = pytree.tree_flatten((args, [kwargs[k] for k in sorted(kwargs)]))
    sigs = tuple(
        (tuple(t.shape), tuple(t.stride()), t.dtype, t.layout, str(t.device), t.requires_grad)
        if isinstance(t, Tensor)
        else ("not a tensor", type(t).__name__)
        for t in leaves
    )
    return (str(spec), tuple(sorted(kwargs)), sigs)


def reuse_sample_entries(
    given_args: Any,
    given_kwargs: Any,
    args: tuple[tuple[Any, ...], ...],
    kwargs: tuple[dict[str, Any], ...],
    schedule: _plan.Schedule,
    chain: bool = False,
    share: bool = False,
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """The entries after TransformerEngine's reorganisation over ``schedule`` (see the module
    docstring); with ``chain`` (``chain_buffers``) a chunk's later layer whose entry matches its
    previous layer's takes that layer's entry too (it reads the previous output, no sample); with
    ``share`` (``share_microbatch_graphs``) entries are reused per callable only, so that the
    microbatches replaying one set of graphs take its first member's entry.
    ``given_args`` / ``given_kwargs`` are what the caller passed: when lists, their entries are
    replaced in place, as TransformerEngine replaces them."""
    ids: dict[tuple[Any, ...], int] = {}
    owner = schedule.callable_of if share else (0,) * len(args)
    keys = [ids.setdefault((owner[p], entry_key(a, k)), len(ids)) for p, (a, k) in enumerate(zip(args, kwargs))]
    text = str(_core.plan_sample_entries(schedule.handle, ",".join(map(str, keys)), bool(chain)))
    tokens = text.split(",") if text else []
    entries = [int(t.rstrip("c")) for t in tokens]
    # a chained pass takes its previous layer's sample args only: its keyword args (a mask, a
    # scale) may differ from that layer's while both are in flight
    kw_entries = [p if t.endswith("c") else e for p, (t, e) in enumerate(zip(tokens, entries))]
    _replace_in(given_args, entries)
    _replace_in(given_kwargs, kw_entries)
    return tuple(args[e] for e in entries), tuple(kwargs[e] for e in kw_entries)


def _replace_in(given: Any, entries: Sequence[int]) -> None:
    """Entry ``p`` of the caller's list becomes entry ``entries[p]`` (which keeps its own)."""
    if not isinstance(given, list) or len(given) != len(entries):
        return
    for p, e in enumerate(entries):
        if e != p:
            given[p] = given[e]
