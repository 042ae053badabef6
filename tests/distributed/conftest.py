"""Fixtures of the multi-rank suite: spawned worlds of ranks, shared by the tests of a session.

A world (``rank_world.RankWorld``) is spawned the first time a test asks for its layout and
serves every later test with that layout; a rank that crashed or was killed for hanging is
spawned again before the next run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

import gograph

from rank_world import Layout, RankWorld, WorldCache, gloo_skip_reason


@pytest.fixture(scope="session")
def rank_worlds() -> Iterator[WorldCache]:
    """The session's worlds, closed at its end."""
    reason = gloo_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cache = WorldCache()
    yield cache
    cache.close()


@pytest.fixture
def world(rank_worlds: WorldCache) -> Callable[[str], RankWorld]:
    """``world(engine)``: the session's gloo world of 4 processes on that engine (CPU ranks, or
    ranks sharing one GPU); ``run(..., size=2)`` runs on its first two."""

    def get(engine: str = "eager") -> RankWorld:
        return rank_worlds.get(Layout(4, engine))

    return get


@pytest.fixture
def no_process_group() -> Iterator[None]:
    """For in-process groups (the fake group): none before the test, none left after it."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def no_leaked_passes(request: pytest.FixtureRequest) -> Iterator[None]:
    """tests/conftest.py's leak check, for the tests that graph in this process (those using
    ``no_process_group``). The others graph in spawned ranks, which report their own live
    counts after every run; here their two full collections per test (0.1-0.25 s each) would
    check counts nothing in this process changes."""
    if "no_process_group" not in request.fixturenames:
        yield
        return
    gc.collect()
    passes, graphs = gograph.live_passes(), gograph.live_graphs()
    yield
    if not getattr(request.node, "gograph_call_passed", False):
        return
    gc.collect()
    assert gograph.live_passes() <= passes, "the test leaked gograph pass records"
    assert gograph.live_graphs() <= graphs, "the test leaked graphs"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The multi-rank suite spawns rank processes (tens of seconds on two cores): one CPython runs
    it (``make test``), ``make test-pythons`` leaves it out."""
    for item in items:
        if "tests/distributed/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.one_python)
