"""The admission view's background renewal at fleet scale (issue #11): with thousands of lenders
most of a new working set is new to the replica, and building each state from its reply is CPU
in whatever event loop step took the reply. The renewal reads them a few per round trip, so no
step of it holds the Admits queued behind it for the whole working set; an Admit's own cold
read still takes them all in one trip."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from crossflow_ctl.domain.models import NodeInfo, NodeState, StoredLease
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_view import (
    RENEWAL_STATES_PER_TRIP,
    WORKING_SET_PER_SAMPLE,
    AdmissionView,
)
from tests.store.helpers import NOW, lease

TTL = 60_000
SAMPLE = 8
LENDERS = 4_096


class FleetIndex:
    """A lender index of ``LENDERS`` live lenders; every draw returns a different slice of it,
    as a random draw from a large fleet mostly does."""

    def __init__(self) -> None:
        self.draws = 0

    async def draw_lenders(
        self, sample: int, now_ms: int, also_hgetall: str | None = None
    ) -> tuple[list[tuple[str, int]], Any]:
        start = self.draws * 16 * sample
        self.draws += 1
        ids = [f"d{(start + i) % LENDERS:05d}" for i in range(16 * sample)]
        return [(n, now_ms + TTL) for n in ids], ({} if also_hgetall is not None else None)


class Views:
    """Records the node ids each views round trip asked for."""

    def __init__(self) -> None:
        self.trips: list[list[str]] = []

    async def __call__(
        self, node_ids: Sequence[str], now_ms: int, pool: str | None
    ) -> tuple[Any, list[NodeState]]:
        self.trips.append(list(node_ids))
        return ({} if pool is not None else None), [_state(n) for n in node_ids]


def _state(node_id: str) -> NodeState:
    stored = StoredLease(lease=lease(node_id), received_at_ms=NOW, expires_at_ms=NOW + TTL)
    return NodeState(info=NodeInfo(node_id=node_id), lease=stored)


@asynccontextmanager
async def _backend(_: str) -> AsyncIterator[None]:
    yield


def _view(views: Views) -> AdmissionView:
    index: Any = FleetIndex()
    return AdmissionView(Keys("t"), index, views, _backend, 60_000, 5.0)


async def test_a_renewal_reads_a_new_working_set_a_few_states_per_trip() -> None:
    views = Views()
    view = _view(views)
    await view._renew("default", SAMPLE, NOW)
    read = [n for trip in views.trips for n in trip]
    assert len(read) == len(set(read)) == WORKING_SET_PER_SAMPLE * SAMPLE  # all of them, once
    assert max(map(len, views.trips)) <= RENEWAL_STATES_PER_TRIP
    assert view.lenders.pick(SAMPLE, NOW) is not None  # and the draw is the renewed one


async def test_a_cold_read_on_the_request_path_reads_the_working_set_in_one_trip() -> None:
    views = Views()
    _, states = await _view(views).read("default", [], SAMPLE, NOW)
    assert [len(trip) for trip in views.trips] == [WORKING_SET_PER_SAMPLE * SAMPLE]
    assert len(states) == SAMPLE


async def test_a_lender_seen_to_stop_during_a_renewal_stays_out_of_its_draw() -> None:
    """The renewal reads over several round trips; this replica's own writes to the lender
    index meanwhile (a node that stopped lending, a lender renewed) are applied to the draw it
    keeps, not undone by it."""
    views = Views()
    view = _view(views)
    changes: dict[str, int | None] = {}

    async def views_that_see_writes(
        node_ids: Sequence[str], now_ms: int, pool: str | None
    ) -> tuple[Any, list[NodeState]]:
        if len(views.trips) == 2:  # mid-renewal: this replica's ingest writes to the index
            first = views.trips[0]  # members of the working set being read
            changes.update({first[0]: None, first[1]: NOW + 2 * TTL})
            view.lenders.changed(changes)
        return await views(node_ids, now_ms, pool)

    view._views = views_that_see_writes
    working, _, _ = await view._draw(SAMPLE, NOW, "default", RENEWAL_STATES_PER_TRIP)
    assert len(views.trips) > 2
    stopped, renewed = changes
    kept = dict(view.lenders._members)
    assert stopped not in kept and stopped not in dict(working)
    assert kept[renewed] == NOW + 2 * TTL
    assert view.lenders._journals == []  # the journal goes with the draw
