"""The Redis store's admission view: the pool's load and some lenders' states, read for each
Admit, from this replica's caches (:mod:`.redis_cache`) whenever they allow.

A warm Admit reads nothing before its debit, whatever the fleet's size: the replica keeps a
WORKING SET of ``WORKING_SET_PER_SAMPLE * sample`` lenders (a random draw from the lender index)
with their states, Admits sample their candidates among it, and once the draw is past half its
age bound the next Admit starts a renewal in the BACKGROUND (draw, pool reports, and the states
that are due) and answers from the cache meanwhile. A request reads on its own path only when a
cache is cold or past its bound (none, or idle longer than the bound), or names candidates that
are not cached. The caches fail closed when stale and never cache absence; the debit script
re-checks every credit against the live lease and open debits, so a stale view can only make a
plan try a node that refuses, never over-commit.

Round trips of a cold read: the lender draw takes the pool's reports along (one), the working
set's due states one more; with candidates named, their missing states and the pool's reports
go in one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog

from crossflow_ctl.aio import cancel_and_wait, detached_task
from crossflow_ctl.domain.models import NodeState, PoolSnapshot, is_node_id
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_cache import LenderSample, NodeCache, PoolCache
from crossflow_ctl.store.redis_connect import error_text
from crossflow_ctl.store.redis_index import NodeIndex

log = structlog.get_logger()

WORKING_SET_PER_SAMPLE = 4
"""Lenders a replica keeps warm per sampled candidate: Admits sample among them, and a renewal
in the background keeps them fresh, so planning reads nothing whatever the fleet's size."""

RENEWAL_STATES_PER_TRIP = 4
"""Lender states a background renewal reads per round trip. A renewal draws a new working set
(up to ``WORKING_SET_PER_SAMPLE * sample`` lenders), and with thousands of lenders most of its
members are new to this replica: each state is built (validated) from its reply, all in the
one event loop step that took the reply (measured: 32 new states 3.6-5.4 ms on a slow 2-core
host, 0.02 ms when all were built before). Read in one trip, that step held every Admit queued
behind it (issue #11: up to 19 ms of CPU in one step at 4,096 streams, the largest stall in
the Admit phase); in slices of a few, each step is shorter than an Admit's own. A cold read on
an Admit's path still reads them all in one trip: it waits on the reply either way. Each trip
checks a connection out of the pool; lender changes this replica makes meanwhile are applied
to the draw before it is kept (``LenderSample.drawing``)."""

Views = Callable[[Sequence[str], int, str | None], Awaitable[tuple[Any, list[NodeState]]]]
"""``(node ids, now_ms, pool or None)`` -> (the pool's reports or None, the nodes' states), in
one round trip (``RedisStore._views``)."""
Backend = Callable[[str], AbstractAsyncContextManager[None]]


class AdmissionView:
    def __init__(
        self,
        keys: Keys,
        index: NodeIndex,
        views: Views,
        backend: Backend,
        max_age_ms: int,
        timeout_s: float,
    ) -> None:
        self._k = keys
        self._index = index
        self._views = views
        self._backend = backend
        self._timeout_s = timeout_s
        self.pools = PoolCache(max_age_ms)
        self.lenders = LenderSample(max_age_ms)
        self.nodes = NodeCache(max_age_ms)
        self.renewal: asyncio.Task[None] | None = None
        """The background renewal, while one runs (or the last one)."""

    @property
    def caches(self) -> tuple[PoolCache, LenderSample, NodeCache]:
        return self.pools, self.lenders, self.nodes

    async def read(
        self, pool: str, node_ids: Sequence[str], sample: int, now_ms: int
    ) -> tuple[PoolSnapshot | None, list[NodeState]]:
        """``Store.admission_view``: the pool's snapshot and the states of ``node_ids`` (or of
        ``sample`` lenders drawn from the index when none are named)."""
        ids = [n for n in dict.fromkeys(node_ids) if is_node_id(n)]
        draw = not node_ids and sample > 0
        snapshot = self.pools.get(pool, now_ms)
        picked = self.lenders.pick(sample, now_ms) if draw else ids
        if snapshot is not None and picked is not None:  # warm: no round trip, no I/O at all
            cached = [s for n in picked if (s := self.nodes.get(n, now_ms)) is not None]
            if len(cached) == len(picked):
                if draw and self.lenders.due():
                    self._renew_soon(pool, sample, now_ms)
                return snapshot, cached
        async with self._backend("admission_view"):
            return await self._read_cold(pool, snapshot, picked, sample, now_ms)

    async def _read_cold(
        self,
        pool: str,
        snapshot: PoolSnapshot | None,
        picked: list[str] | None,
        sample: int,
        now_ms: int,
    ) -> tuple[PoolSnapshot | None, list[NodeState]]:
        read_pool = snapshot is None
        reports: Any = None
        found: dict[str, NodeState] = {}
        if picked is None:  # a new lender draw; the pool's reports, when due, come along
            working, read, reports = await self._draw(sample, now_ms, pool if read_pool else None)
            ids = self.lenders.choose(working, sample, now_ms)
            found = {s.info.node_id: s for s in read}
            read_pool = False
        else:
            ids = picked
        for node_id in ids:
            if node_id not in found and (state := self.nodes.get(node_id, now_ms)) is not None:
                found[node_id] = state
        missing = [n for n in ids if n not in found]
        if missing or read_pool:
            pool_reports, states = await self._views(missing, now_ms, pool if read_pool else None)
            reports = pool_reports if read_pool else reports
            for state in states:
                self.nodes.put(state, now_ms)
                found[state.info.node_id] = state
        if snapshot is None:
            snapshot = self.pools.put(pool, codec.live_pool_loads(reports, now_ms), now_ms)
        return snapshot, [found[n] for n in ids if n in found]

    async def _draw(
        self, sample: int, now_ms: int, pool: str | None, per_trip: int | None = None
    ) -> tuple[list[tuple[str, int]], list[NodeState], Any]:
        """Drop expired lenders and draw some from every index bucket, with ``pool``'s reports
        when asked (one round trip); keep a working set of the live ones, reading the states of
        those not fresh in the node cache (one more trip when some are due, or one per
        ``per_trip`` of them). Returns the working set (lender, lease expiry), the states read
        and the pool's reports."""
        pool_key = self._k.pool(pool) if pool is not None else None
        with self.lenders.drawing() as since:
            members, reports = await self._index.draw_lenders(sample, now_ms, pool_key)
            working = self.lenders.working_set(members, WORKING_SET_PER_SAMPLE * sample, now_ms)
            due = [node_id for node_id, _ in working if self.nodes.due(node_id)]
            states: list[NodeState] = []
            if due:
                step = per_trip or len(due)
                for start in range(0, len(due), step):
                    _, read = await self._views(due[start : start + step], now_ms, None)
                    for state in read:
                        self.nodes.put(state, now_ms)
                    states.extend(read)
                known = {s.info.node_id for s in states}
                working = [m for m in working if m[0] in known or m[0] not in due]
            working = self.lenders.amended(working, since)
        self.lenders.put(working, now_ms)
        return working, states, reports

    def _renew_soon(self, pool: str, sample: int, now_ms: int) -> None:
        """Renew the draw, its due states and the pool's reports in the background, before they
        reach their age bound, so Admits keep planning with no read of their own."""
        if self.renewal is not None and not self.renewal.done():
            return
        self.renewal = detached_task(
            self._renew(pool, sample, now_ms), name="crossflow-admission-view"
        )

    async def _renew(self, pool: str, sample: int, now_ms: int) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                _, _, reports = await self._draw(sample, now_ms, pool, RENEWAL_STATES_PER_TRIP)
            self.pools.put(pool, codec.live_pool_loads(reports, now_ms), now_ms)
        except Exception as exc:  # best effort, whatever failed (a corrupt view included)
            # Nothing is lost: the entries age out and the next Admit reads (failing closed).
            log.warning("admission_view_renewal_failed", error=error_text(exc))

    async def close(self) -> None:
        if self.renewal is not None:
            await cancel_and_wait((self.renewal,))
