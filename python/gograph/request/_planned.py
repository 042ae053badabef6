"""A request planned: the second step of the front door's straight line.

``make_graphed_callables`` runs ``normalize`` (:mod:`gograph.request._args`: every check that
needs neither the core nor an engine, once), then :func:`planned`: the core plans the schedule
once; a buffer-reuse request's sample entries are reorganised over that schedule as
TransformerEngine does (:mod:`gograph.request._entries`: the caller's lists in place, before any
warmup); one spec per pass; the engine the tensors resolve to, checked against the request
(:mod:`gograph.request._fit`). The build (:mod:`gograph.build._build`) then runs what it yields,
and nothing returns to the argument checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from ..core import _plan
from ..runtime.engines import Engine, resolve_engine
from . import _entries, _fit
from ._args import PassSpec, Request, pass_specs, schedule_training

__all__ = ["Planned", "planned"]


@dataclass(frozen=True)
class Planned:
    """A request with its schedule (a core handle, freed when :func:`planned` exits), one spec
    per pass and its engine. ``req`` is the request as built: a buffer-reuse request's
    sample entries as TransformerEngine reorganises them."""

    req: Request
    schedule: _plan.Schedule
    specs: tuple[PassSpec, ...]
    engine: Engine


@contextlib.contextmanager
def planned(req: Request) -> Iterator[Planned]:
    """Plans ``req`` in the core once and yields it with its specs and engine."""
    schedule = _plan.plan_schedule(
        req.order, req.layers, len(req.callables), len(req.sample_args), schedule_training(req), req.num_warmup_iters
    )
    try:
        if req.reuse:  # with an _order, in training: TransformerEngine's canonical entries
            args, kwargs = _entries.reuse_sample_entries(
                req.given_sample_args,
                req.given_sample_kwargs,
                req.sample_args,
                req.sample_kwargs,
                schedule,
                chain=bool(req.chain),
                share=req.share,
            )
            req = dataclasses.replace(req, sample_args=args, sample_kwargs=kwargs)
        specs = pass_specs(req, schedule)
        engine = resolve_engine(req.engine, [t for s in specs for t in (*s.flat_args, *s.params)])
        _fit.check_for_engine(req, specs, engine)
        yield Planned(req, schedule, specs, engine)
    finally:
        schedule.free()
