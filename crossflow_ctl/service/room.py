"""Room watches (``WatchRoom``): the room routers may borrow, pushed as it changes.

How changes reach a watcher, whichever replica caused them: the replica re-reads the store's
admission view (the same read Admit makes: the pool's live load and the candidates' node states,
or a sample of the lenders) at least every ``room.poll_ms``. All shared state lives in the store,
so a lease ingested by another replica, a release made through another replica, or a lease or
reservation expiring is seen within one poll interval. On top of that, this replica's own lease
ingest, releases and cordons :meth:`RoomWatches.poke` it, and it re-reads at once (at most one
read per ``room.min_read_ms``). Reading the store, rather than relaying the ingest path's events
between replicas, keeps one source of truth.

Cost: one read loop (a :class:`_Feed`) per distinct (pool, candidate nodes) on each replica,
shared by every watch of it, so many routers watching the default pool cost one pipelined read
per poll. Each watch then applies its own rate limit (bursts coalesced to the newest view) and
heartbeat. A read that fails or overruns gives an UNKNOWN view (no room) and the watch goes on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from crossflow_ctl.aio import cancel_and_wait, detached_task, wait_any
from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.domain.models import NodeState, Share
from crossflow_ctl.domain.room import (
    NodeRoom,
    RoomUpdate,
    RoomView,
    RoomWatchRequest,
    material_change,
    node_room,
    unknown_room,
    update_due,
)
from crossflow_ctl.service.config import RoomWatchSettings

log = structlog.get_logger()

ReadView = Callable[[RoomWatchRequest], Awaitable[RoomView]]
"""Reads the room for a request; expected not to raise (an UNKNOWN view on store trouble)."""
FeedKey = tuple[str, tuple[str, ...]]
MAX_KEPT_ROOMS = 4096
"""Nodes whose room :class:`NodeRooms` keeps at once."""


class NodeRooms:
    """:func:`~crossflow_ctl.domain.room.node_room`, each node's computed once per state, share
    and side of its lease's expiry: a node's room depends on the time only through whether its
    lease has expired, states are immutable, and the store hands out the same state object
    until its node changes (a room view reads every candidate, most of them unchanged since
    the last view). Keeps the last state seen per node id (compared by identity: a state it
    holds is alive, so no new one can share its id); stores that build states afresh per read
    simply miss."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[NodeState, Share, bool, NodeRoom | None]] = {}

    def __call__(self, node: NodeState, share: Share, now_ms: int) -> NodeRoom | None:
        stored = node.lease
        expired = stored is not None and stored.expired(now_ms)
        node_id = node.info.node_id
        kept = self._kept.get(node_id)
        if kept is not None and kept[0] is node and kept[2] is expired and kept[1] == share:
            return kept[3]
        room = node_room(node, share, now_ms)
        if kept is None and len(self._kept) >= MAX_KEPT_ROOMS:
            self._kept.clear()  # nodes come and go (a sampled view): start afresh
        self._kept[node_id] = (node, share, expired, room)
        return room


def watch_gaps(request: RoomWatchRequest, settings: RoomWatchSettings) -> tuple[float, float]:
    """A watch's least gap between two updates (one over its rate, capped by the broker's) and
    its heartbeat interval, in seconds."""
    rate = min(request.max_updates_per_s or settings.max_updates_per_s, settings.max_updates_per_s)
    return 1.0 / rate, (request.heartbeat_ms or settings.heartbeat_ms) / 1000.0


class _Feed:
    """The latest view of one (pool, candidates), re-read by one task for all its watches."""

    def __init__(self, key: FeedKey, request: RoomWatchRequest) -> None:
        self.key = key
        self.request = request
        self.view: RoomView | None = None
        self.version = 0
        self.published = asyncio.Event()
        """Set (and replaced) at every new view."""
        self.refresh = asyncio.Event()
        """Set by a new watch that wants a fresh read."""
        self.watches = 0
        self.task: asyncio.Task[None] | None = None

    def publish(self, view: RoomView) -> None:
        self.view, self.version = view, self.version + 1
        published, self.published = self.published, asyncio.Event()
        published.set()


class RoomWatches:
    """This replica's room watches: shared feeds, a change signal, and a stop for shutdown."""

    def __init__(self, settings: RoomWatchSettings, clock: Clock, read: ReadView) -> None:
        self.settings = settings
        self._clock = clock
        self._read = read
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._feeds: dict[FeedKey, _Feed] = {}
        self.active = 0
        """Open watches on this replica."""

    @property
    def feeds(self) -> int:
        """Read loops running (one per distinct pool and candidate set being watched)."""
        return len(self._feeds)

    def poke(self) -> None:
        """Room may have changed here: every feed re-reads (not sooner than min_read_ms). Called
        for every accepted lease, so with nothing watched it does nothing."""
        if not self._feeds:
            return
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def close(self) -> None:
        """End every watch (shutdown: routers re-subscribe to another replica)."""
        self._stop.set()
        self.poke()

    def watch(self, request: RoomWatchRequest) -> AsyncIterator[RoomUpdate]:
        """The updates of one subscription, until :meth:`close` or the consumer stops."""
        return self._watch(request)

    # -- one watch -------------------------------------------------------------------------------
    async def _watch(self, request: RoomWatchRequest) -> AsyncIterator[RoomUpdate]:
        s = self.settings
        min_gap_s, heartbeat_s = watch_gaps(request, s)
        feed = self._join(request)
        self.active += 1
        try:
            seen, seq = feed.version, 0
            view: RoomView | None = None
            sent: RoomView | None = None
            last_sent_s = -math.inf
            feed.refresh.set()  # the first update is the room now, not the feed's last read
            while not self._stop.is_set():
                if feed.version != seen and feed.view is not None:
                    seen, view = feed.version, feed.view
                if view is None:
                    await wait_any(feed.published, self._stop, timeout_s=3600.0)
                    continue
                material = material_change(sent, view, s.min_change)
                now_s = time.monotonic()
                if update_due(material, now_s - last_sent_s, min_gap_s, heartbeat_s):
                    seq += 1
                    yield RoomUpdate(
                        seq=seq, at_ms=self._clock.now_ms(), heartbeat=not material, view=view
                    )
                    sent, last_sent_s, material = view, time.monotonic(), False
                # Until a newer view, or until a held-back change may go (rate limit) or a
                # heartbeat is due; then the newest view is judged again.
                wake_s = last_sent_s + (min_gap_s if material else heartbeat_s)
                await wait_any(feed.published, self._stop, timeout_s=wake_s - time.monotonic())
        finally:
            self.active -= 1
            await self._leave(feed)

    # -- feeds -----------------------------------------------------------------------------------
    def _join(self, request: RoomWatchRequest) -> _Feed:
        key = (request.pool, tuple(sorted(set(request.candidate_node_ids))))
        feed = self._feeds.get(key)
        if feed is None:
            feed = self._feeds[key] = _Feed(key, request)
            feed.task = detached_task(self._read_loop(feed), name=f"room-feed:{key[0]}")
        feed.watches += 1
        return feed

    async def _leave(self, feed: _Feed) -> None:
        feed.watches -= 1
        if feed.watches > 0:
            return
        if self._feeds.get(feed.key) is feed:
            del self._feeds[feed.key]
        if feed.task is not None:
            await cancel_and_wait([feed.task])

    async def _read_loop(self, feed: _Feed) -> None:
        s = self.settings
        poll_s, min_read_s = s.poll_ms / 1000.0, s.min_read_ms / 1000.0
        while not self._stop.is_set():
            changed = self._changed
            feed.refresh.clear()
            read_at_s = time.monotonic()
            try:
                view = await self._read(feed.request)
            except Exception as exc:  # fail closed: a broken read is "no room", never a crash
                log.exception("room_feed.read_failed")
                view = unknown_room(feed.request.pool, f"room unknown: {exc!r}")
            feed.publish(view)
            until_poll_s = read_at_s + poll_s - time.monotonic()
            await wait_any(changed, feed.refresh, self._stop, timeout_s=until_poll_s)
            await wait_any(self._stop, timeout_s=read_at_s + min_read_s - time.monotonic())
