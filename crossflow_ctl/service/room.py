"""Room watches (``WatchRoom``): the room routers may borrow, pushed as it changes.

How changes reach a watcher, whichever replica caused them: every watch re-reads the store's
admission view (the same read Admit makes: the pool's live load and the candidates' node states,
or a sample of the lenders) at least every ``room.poll_ms``. All shared state lives in the store,
so a lease ingested by another replica, a release made through another replica, or a lease or
reservation expiring is seen within one poll interval. On top of that, this replica's own lease
ingest, releases and cordons :meth:`RoomWatches.poke` its watches, which re-read at once (at most
one read per ``room.min_read_ms``). Reading the store, rather than relaying the ingest path's
events between replicas, keeps one source of truth and costs one pipelined read per watch and
poll, the same flat-in-fleet-size read Admit makes.

A read that fails or overruns gives an UNKNOWN view (no room) and the watch goes on (fail closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.domain.room import (
    RoomUpdate,
    RoomView,
    RoomWatchRequest,
    material_change,
)
from crossflow_ctl.service.config import RoomWatchSettings

ReadView = Callable[[RoomWatchRequest], Awaitable[RoomView]]
"""Reads the room for a request; never raises (an UNKNOWN view on store trouble)."""


class RoomWatches:
    """This replica's room watches: a change signal they wait on, and a stop for shutdown."""

    def __init__(self, settings: RoomWatchSettings, clock: Clock, read: ReadView) -> None:
        self.settings = settings
        self._clock = clock
        self._read = read
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        self.active = 0

    def poke(self) -> None:
        """Room may have changed here: wake every watch for a re-read."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def close(self) -> None:
        """End every watch (shutdown: routers re-subscribe to another replica)."""
        self._stop.set()
        self.poke()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def watch(self, request: RoomWatchRequest) -> AsyncIterator[RoomUpdate]:
        """The updates of one subscription, until :meth:`close` or the consumer stops."""
        return self._watch(request)

    async def _watch(self, request: RoomWatchRequest) -> AsyncIterator[RoomUpdate]:
        s = self.settings
        rate = min(request.max_updates_per_s or s.max_updates_per_s, s.max_updates_per_s)
        min_gap_s = 1.0 / rate
        heartbeat_s = (request.heartbeat_ms or s.heartbeat_ms) / 1000.0
        poll_s, min_read_s = s.poll_ms / 1000.0, s.min_read_ms / 1000.0
        seq = 0
        sent: RoomView | None = None
        last_sent_s = -math.inf
        self.active += 1
        try:
            while not self._stop.is_set():
                changed = self._changed
                read_at_s = time.monotonic()
                view = await self._read(request)
                now_s = time.monotonic()
                material = material_change(sent, view, s.min_change)
                heartbeat = now_s - last_sent_s >= heartbeat_s
                if (material and now_s - last_sent_s >= min_gap_s) or heartbeat:
                    seq += 1
                    yield RoomUpdate(
                        seq=seq, at_ms=self._clock.now_ms(), heartbeat=not material, view=view
                    )
                    sent, last_sent_s = view, time.monotonic()
                    material = False
                # Next read: at the poll interval, the heartbeat, or (when a change waits for
                # the rate limit) the end of the gap; a poke may come earlier, but never
                # sooner than min_read after the last read.
                wake_s = min(read_at_s + poll_s, last_sent_s + heartbeat_s)
                if material:
                    wake_s = min(wake_s, last_sent_s + min_gap_s)
                earliest_s = read_at_s + min_read_s
                await self._pause(changed, max(wake_s, earliest_s) - time.monotonic())
                if (rest := earliest_s - time.monotonic()) > 0:
                    await self._pause(None, rest)
        finally:
            self.active -= 1

    async def _pause(self, changed: asyncio.Event | None, timeout_s: float) -> None:
        if timeout_s <= 0 or self._stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await (changed.wait() if changed is not None else self._stop.wait())
