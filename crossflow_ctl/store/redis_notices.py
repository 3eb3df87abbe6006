"""Reading nodes' notice streams for the Redis store, through a bounded number of connections.

Every script that appends a notice to a node's stream also PUBLISHes the node id on the
namespace's wake channel (``cf_notice`` in ``lua/_lib.lua``; classic PUBLISH reaches every
subscriber of a Redis Cluster whatever the slot). Each replica holds ONE subscription to that
channel (:class:`WakeHub`) and fans the wakes out in-process to the relays of the agent streams
it serves. A relay's read is an XRANGE, pipelined with the other relays' reads of the same
moment (:class:`NoticeReader`); a waiting read parks on the node's in-process signal instead of
a blocking XREAD, so the number of Redis connections no longer grows with the number of agents
(issue #11: one blocking XREAD connection per stream capped a replica at about 95 nodes), nor
with how many relays a burst of wakes sets reading at once.

The stream stays the source of truth (order, the per-node sequence, resume after the agent's
last seen sequence: DESIGN.md §5.4, §6); a wake is only a hint to read it. Nothing is missed:

* the node's signal is taken BEFORE the XRANGE, so a notice written after the read was sent
  wakes the waiter;
* a wait that ends with no wake skips the next XRANGE only while the subscription has been up,
  without a break, since before the empty read (same ``generation``); any break wakes every
  waiter, and while the subscription is down waiting reads poll their stream instead;
* a read that found fewer notices than it asked for counts as an empty read after its last
  notice: the relay's next read (after that notice) waits for a wake rather than sending an
  XRANGE that would find nothing (one read per wake, not two).

A waiting read arms no timer of its own: its deadline joins the hub's shared ones
(:class:`_Deadlines`), so thousands of idle streams keep a few dozen timers in the event loop,
not two each.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import structlog
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import RedisError

from crossflow_ctl.aio import cancel_and_wait, detached_task
from crossflow_ctl.domain.errors import NotFound
from crossflow_ctl.domain.models import Notice
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.coalescer import Coalescer
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_connect import error_text
from crossflow_ctl.store.redis_pipeline import KeptConnection, send_all

log = structlog.get_logger()

KNOWN_NODES_CAP = 100_000
SIGNAL_IDLE_S = 120.0
"""A node's signal nobody has waited on for this long is dropped (at the next wake sweep)."""
RESUBSCRIBE_S = 0.2
UNSUBSCRIBED_POLL_S = 0.25
"""How often a waiting read polls its stream while the wake subscription is down."""
PING_EVERY_S = 5.0

Entry = tuple[codec.Raw, Mapping[codec.Raw, codec.Raw]]
"""One notice stream entry as XRANGE returns it: its id and its fields."""
Backend = Callable[[str, float], AbstractAsyncContextManager[None]]
"""``RedisStore._backend``: bounds a call in time and maps backend errors to StoreUnavailable."""


@dataclass(slots=True, eq=False)
class _Signal:
    """One node's wake counter; ``event`` is replaced at every wake (a waiter keeps its own).
    Hashed by identity (a key of :class:`_Deadlines`)."""

    count: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)
    used_at_s: float = 0.0
    empty_at: tuple[int, int, int] | None = None
    """(seq, count, generation): a read sent at wake ``count`` of subscription ``generation``
    found nothing after ``seq`` (nothing at all, or notices up to ``seq``, fewer than asked)."""

    def wake(self) -> None:
        self.count += 1
        self.empty_at = None
        self.nudge()

    def nudge(self) -> None:
        """Wake the waiters without a wake count: each checks its own deadline."""
        self.event.set()
        self.event = asyncio.Event()


GRANULES_MS = (1, 10, 100, 1000)
"""How finely a waiting read's deadline is kept: the coarsest granule at most 1/16 of the wait
(a 30 s wait ends within a second after its deadline, a 50 ms one within a millisecond)."""


def due_instant_ms(now_ms: float, wait_ms: float) -> int:
    """The shared instant a wait of ``wait_ms`` from ``now_ms`` ends at: its deadline rounded
    up to the coarsest granule of :data:`GRANULES_MS` at most 1/16 of the wait."""
    granule = GRANULES_MS[0]
    for coarser in GRANULES_MS[1:]:
        if coarser * 16 <= wait_ms:
            granule = coarser
    return math.ceil((now_ms + wait_ms) / granule) * granule


class _Deadlines:
    """The deadlines of waiting reads, on a few loop timers shared by all of them.

    With a timer per waiting read, a replica with thousands of idle agent streams kept
    thousands of live timers in the event loop; every timer cancelled elsewhere (each Redis
    call's timeout) then lingered in the loop's heap until the cancelled ones outnumbered the
    live ones, so thousands of handles outlived young collections and made every collection
    slow (issue #11). Here a deadline is rounded UP to its granule (never early) and every
    deadline rounded to the same instant shares one timer. When it fires, each signal
    registered there that has not been woken or nudged since is nudged; its waiters find their
    deadline passed (a waiter that is not due yet registers again)."""

    def __init__(self) -> None:
        self._due: dict[int, dict[_Signal, asyncio.Event]] = {}
        """Instant (loop time, ms) -> signals with their event when registered."""
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def add(self, sig: _Signal, wait_s: float) -> None:
        """Nudge ``sig`` once ``wait_s`` has passed, unless it is woken or nudged first."""
        loop = asyncio.get_running_loop()
        due_ms = due_instant_ms(loop.time() * 1000.0, wait_s * 1000.0)
        waiting = self._due.get(due_ms)
        if waiting is None:
            waiting = self._due[due_ms] = {}
            self._timers[due_ms] = loop.call_at(due_ms / 1000.0, self._fire, due_ms)
        waiting[sig] = sig.event

    def _fire(self, due_ms: int) -> None:
        del self._timers[due_ms]
        for sig, event in self._due.pop(due_ms).items():
            if sig.event is event:  # else it was woken or nudged since: its waiter moved on
                sig.nudge()

    def __len__(self) -> int:
        """Timers armed."""
        return len(self._timers)


class WakeHub:
    """One replica's subscription to the namespace's wake channel, fanned out per node."""

    def __init__(self, client: Redis | RedisCluster, channel: str) -> None:
        self._r = client
        self.channel = channel
        self._signals: dict[str, _Signal] = {}
        self.deadlines = _Deadlines()
        self.generation = 0
        """Bumped whenever the subscription (re)starts or breaks."""
        self.live = False
        """Subscribed and not known broken: a wait with no wake means no new notice."""
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.wakes = 0
        self._down_since_s: float | None = None
        """When the subscription broke (monotonic s), None while it is up."""
        self._failed_tries = 0

    def signal(self, node_id: str) -> _Signal:
        if self._task is None and not self._closing:
            self._task = detached_task(self._run(), name="crossflow-notice-wakes")
        sig = self._signals.get(node_id)
        if sig is None:
            sig = self._signals[node_id] = _Signal()
        sig.used_at_s = time.monotonic()
        return sig

    def _break(self) -> None:
        """The subscription is down: every waiter reads its stream again."""
        self.live = False
        self.generation += 1
        for sig in self._signals.values():
            sig.wake()

    def _broken(self, exc: BaseException) -> None:
        """Log an outage once, when it starts (the retries every RESUBSCRIBE_S would flood the
        log), then at debug level; :meth:`_restored` says when it ended."""
        if self._down_since_s is None:
            self._down_since_s = time.monotonic()
            self._failed_tries = 0
            log.warning("notice_wakes.broken", channel=self.channel, error=error_text(exc))
        else:
            self._failed_tries += 1
            log.debug("notice_wakes.retry_failed", channel=self.channel, error=error_text(exc))

    def _restored(self) -> None:
        if self._down_since_s is not None:
            log.info(
                "notice_wakes.restored",
                channel=self.channel,
                down_s=round(time.monotonic() - self._down_since_s, 1),
                failed_retries=self._failed_tries,
            )
            self._down_since_s = None

    def _sweep(self) -> None:
        cutoff = time.monotonic() - SIGNAL_IDLE_S
        for node_id in [n for n, s in self._signals.items() if s.used_at_s < cutoff]:
            del self._signals[node_id]

    async def _run(self) -> None:
        while not self._closing:  # a swallowed cancel must not keep resubscribing forever
            pubsub: Any = self._r.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                await self._listen(pubsub)
            except Exception as exc:  # Redis down, or a reply this code cannot read
                # (a payload that is not UTF-8 on a decoding client): subscribe again on a
                # fresh connection; the hub must never end while streams wait on it
                self._broken(exc)
            finally:
                self._break()
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(RESUBSCRIBE_S * 5):
                        await pubsub.aclose()
            if not self._closing:
                await asyncio.sleep(RESUBSCRIBE_S)

    async def _listen(self, pubsub: Any) -> None:
        """Read the subscription's replies until it breaks: the subscribe confirmation, the
        wakes, and the pongs that say a quiet subscription is still up.

        Each reply is read straight off the subscription's connection, waiting at most a second
        (None: nothing came). redis-py's ``get_message`` wraps each read in a retry call, builds
        a dict and records a metric (under a logging lock): per wake, about as much CPU as the
        read itself, and every replica reads a wake for every debit of every replica."""
        conn = pubsub.connection
        quiet_s = 0.0
        while True:
            reply = await conn.read_response(
                timeout=1.0, disconnect_on_error=False, push_request=True
            )
            if reply is None:
                quiet_s += 1.0
                if quiet_s >= 3 * PING_EVERY_S:
                    raise TimeoutError("wake subscription silent (no pong)")
                if quiet_s % PING_EVERY_S == 0:
                    await pubsub.ping()
                    self._sweep()
                continue
            quiet_s = 0.0
            # a pong is b"PONG" in RESP3 and [b"pong", b""] in RESP2; the rest are lists
            kind = codec.text(reply[0]) if isinstance(reply, list) else "pong"
            if kind == "message":
                self.wakes += 1
                woken = self._signals.get(_node_of(reply[2]))
                if woken is not None:
                    woken.wake()
            elif kind == "subscribe":
                self._restored()
                self.generation += 1
                self.live = True
                for sig in self._signals.values():  # notices written before we subscribed
                    sig.wake()

    async def close(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await cancel_and_wait([task])


def _node_of(payload: bytes | str) -> str:
    """The node a wake names; "" (no node) for a payload that is not UTF-8, which no script of
    ours publishes (anyone who can reach Redis can)."""
    if isinstance(payload, str):
        return payload
    try:
        return payload.decode()
    except UnicodeDecodeError:
        return ""


class _Range(NamedTuple):
    """One relay's read: the node's notices after ``after_seq``, at most ``limit``; ``known``:
    the node was seen registered (else its info hash's existence is read with the range)."""

    node_id: str
    after_seq: int
    limit: int
    known: bool


class NoticeReader:
    """Relays' notice reads, coalesced: the reads sent in one loop turn (a wake reaches every
    relay of the nodes one script touched, a group commit's grants many nodes at once) or while
    a batch is in flight go to Redis as ONE pipeline of XRANGEs, so the reads of thousands of
    streams cost a few round trips, and hold a few connections, not one each. ``timeout_s``
    bounds each read's wait in the batcher (:class:`~crossflow_ctl.store.coalescer.Coalescer`).
    """

    def __init__(
        self,
        client: Redis | RedisCluster,
        keys: Keys,
        backend: Backend,
        timeout_s: float | None = None,
    ) -> None:
        self._r = client
        self._k = keys
        self._backend = backend
        self.hub = WakeHub(client, keys.notice_wakes)
        self._known: set[str] = set()
        """Nodes this replica has seen registered."""
        self._ranges: Coalescer[_Range] = Coalescer(self._read_batch, timeout_s=timeout_s)
        self._line = None if isinstance(client, RedisCluster) else KeptConnection(client)
        """The reads' kept connection (standalone Redis): no pool checkout per read."""

    def remember(self, node_id: str) -> None:
        if len(self._known) >= KNOWN_NODES_CAP:
            self._known.clear()
        self._known.add(node_id)

    def forget(self, node_id: str) -> None:
        self._known.discard(node_id)

    async def _range(self, node_id: str, after_seq: int, limit: int) -> list[Entry]:
        """XRANGE after ``after_seq`` (in the next batch of reads; with an existence check if
        the node is unknown)."""
        read = _Range(node_id, after_seq, limit, node_id in self._known)
        async with self._backend("read_notices", 0.0):
            got: Any = await self._ranges.submit(read)
        if not read.known:
            self.remember(node_id)
        return list(got)

    async def _read_batch(self, reads: Sequence[_Range]) -> list[Any]:
        """One pipeline for ``reads``: each read's entries, or its own error (NotFound for a
        node that is not registered)."""
        commands: list[tuple[Any, ...]] = []
        for read in reads:
            k = self._k.node(read.node_id)
            if not read.known:
                commands.append(("EXISTS", k.info))
            commands.append(
                ("XRANGE", k.notices, f"{read.after_seq + 1}-0", "+", "COUNT", read.limit)
            )
        if self._line is None:
            replied = await send_all(self._r, commands, raise_on_error=False)
        else:
            replied = await self._line.send_all(commands, raise_on_error=False)
        replies = iter(replied)
        out: list[Any] = []
        for read in reads:
            exists = 1 if read.known else next(replies)
            got = next(replies)
            if isinstance(exists, BaseException):
                got = exists
            elif not exists:
                got = NotFound(f"unknown node {read.node_id!r}", field="node_id")
            out.append(got)
        return out

    async def close(self) -> None:
        await self._ranges.close()
        if self._line is not None:
            await self._line.close()
        await self.hub.close()

    async def read(self, node_id: str, after_seq: int, limit: int, block_ms: int) -> list[Notice]:
        """Notices after ``after_seq`` (a checked node id, ``limit`` > 0), waiting ``block_ms``."""
        entries = await self.read_entries(node_id, after_seq, limit, block_ms)
        return [codec.notice_from(node_id, eid, fields) for eid, fields in entries]

    async def read_entries(
        self, node_id: str, after_seq: int, limit: int, block_ms: int
    ) -> list[Entry]:
        """:meth:`read`'s stream entries as Redis returned them, not yet decoded (the relay
        reads them straight into rows: ``codec.notice_rows``)."""
        if block_ms <= 0:
            return await self._range(node_id, after_seq, limit)
        hub = self.hub
        sig = hub.signal(node_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + block_ms / 1000.0
        while True:
            count, generation = sig.count, hub.generation
            if not (hub.live and sig.empty_at == (after_seq, count, generation)):
                found = await self._range(node_id, after_seq, limit)
                if len(found) < limit and hub.live and hub.generation == generation:
                    # Nothing after its last notice as of wake ``count``: the caller's next read
                    # (after that notice) waits for a wake instead of reading an empty range.
                    last = codec.entry_seq(found[-1][0]) if found else after_seq
                    sig.empty_at = (last, count, generation)
                if found:
                    return found
            left_s = deadline - loop.time()
            if left_s <= 0:
                return []
            if sig.count == count:
                # Subscribed: sleep until a wake. Not (yet): poll, a wake may never come.
                hub.deadlines.add(sig, left_s if hub.live else min(left_s, UNSUBSCRIBED_POLL_S))
                await sig.event.wait()
