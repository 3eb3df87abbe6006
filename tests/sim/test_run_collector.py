"""A run changes the garbage collector's settings only while it lasts (sim/cluster.py,
``collector_for_runs``): its objects are collectable again after it, and a process that froze
its own objects keeps them frozen."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from crossflow_ctl.sim.cluster import RUN_YOUNG_THRESHOLD, Simulation, collector_for_runs
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.traces import Trace, TraceRequest


@pytest.fixture
def settings() -> Iterator[tuple[int, int, int]]:
    gc.unfreeze()  # another test's process-wide freeze (the broker's tuning) is not ours
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)
    gc.unfreeze()


def test_a_run_restores_the_collector(settings: tuple[int, int, int]) -> None:
    assert gc.get_freeze_count() == 0
    seen: list[tuple[tuple[int, int, int], int]] = []
    trace = Trace(name="t", requests=(TraceRequest(2_000, 20, arrival_s=0.0, cached_tokens=0),))
    sim = Simulation(trace, SimConfig(prefill_nodes=1, decode_nodes=1, policy=PolicyKind.LEASES))
    with collector_for_runs():
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
    assert seen[0][0][0] == RUN_YOUNG_THRESHOLD and seen[0][1] > 0
    rec = asyncio.run(sim.run())
    assert rec.completed == 1
    assert gc.get_threshold() == settings
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_objects_keeps_them_frozen(
    settings: tuple[int, int, int],
) -> None:
    gc.freeze()
    frozen = gc.get_freeze_count()
    with collector_for_runs():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen
    assert gc.get_threshold() == settings
