"""One node's books for the in-process store: reservations with running totals, notices.

The simulator calls the store hundreds of thousands of times, so nothing here scans all of a
node's reservations on the hot path: open debits are a running total, expiries sit in a heap
(lazily invalidated), and released reservations queue in release order, which is also
``release_seq`` order, so a causal purge stops at the first one the agent has not seen.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque

from crossflow_ctl.domain.models import (
    ComputeTime,
    Credits,
    NodeInfo,
    NodeState,
    Notice,
    NoticeKind,
    Reservation,
    ReservationState,
    StoredLease,
)
from crossflow_ctl.store.base import NodeEvent
from crossflow_ctl.store.keys import EVENTS_CAP, HISTORY_CAP, NOTICES_CAP

_NEVER = 2**63
"""Later than any time in ms (no reservation on the books to expire)."""


class NodeLedger:
    """Mutated only under the store's lock, and never across an ``await``."""

    def __init__(self, info: NodeInfo) -> None:
        self._info = info
        self.seq = info.notice_seq
        self._lease: StoredLease | None = None
        self.reservations: dict[str, Reservation] = {}
        self.notices: list[Notice] = []
        self.history: deque[StoredLease] = deque(maxlen=HISTORY_CAP)
        self.events: deque[NodeEvent] = deque(maxlen=EVENTS_CAP)
        self._totals = [0, 0, 0, 0, 0]
        self._time = ComputeTime()
        """The node time behind the open compute debits (running, like ``_totals``)."""
        self._open: Credits | None = None
        """``_totals`` as Credits, kept until they change (admission reads them per node)."""
        self._expiries: list[tuple[int, int, str]] = []  # (expires_at_ms, grant_seq, id)
        self._released: deque[tuple[int, str]] = deque()  # (release_seq, id)
        self._changed: asyncio.Event | None = None
        self._state: NodeState | None = None
        """The node as :meth:`state` last built it, kept until the books change (admission reads
        every candidate node per Admit, most of them unchanged since the last one)."""
        self._state_until = _NEVER
        """When the first reservation on the books expired when ``_state`` was built: the books
        cannot change before then without dropping ``_state``."""

    # -- info ---------------------------------------------------------------------------------
    @property
    def info(self) -> NodeInfo:
        if self._info.notice_seq != self.seq:  # a copy with the new count, not revalidated
            self._info = self._info.replaced(notice_seq=self.seq)
        return self._info

    @info.setter
    def info(self, info: NodeInfo) -> None:
        self._info = info.model_copy(update={"notice_seq": self.seq})
        self._state = None

    @property
    def lease(self) -> StoredLease | None:
        return self._lease

    @lease.setter
    def lease(self, stored: StoredLease | None) -> None:
        self._lease = stored
        self._state = None

    @property
    def node_id(self) -> str:
        return self._info.node_id

    @property
    def cordoned(self) -> bool:
        """Without building an up-to-date :attr:`info` (hot path)."""
        return self._info.cordoned

    # -- notices ------------------------------------------------------------------------------
    def notify(
        self,
        kind: NoticeKind,
        now_ms: int,
        res: Reservation | None = None,
        pulled_tokens: int | None = None,
    ) -> int:
        """Append a notice with the next sequence number; wake blocked readers.
        ``pulled_tokens``: a GRANT's pulled-in prefix (``Notice.pulled_tokens``)."""
        self.seq += 1
        self._state = None
        self.notices.append(  # the registered node's id, a checked pulled_tokens: no validation
            Notice.trusted(
                node_id=self._info.node_id,
                seq=self.seq,
                kind=kind,
                reservation_id=res.reservation_id if res else "",
                debit=res.debit if res else Credits(),
                at_ms=now_ms,
                pulled_tokens=pulled_tokens,
            )
        )
        if len(self.notices) > 2 * NOTICES_CAP:
            del self.notices[: len(self.notices) - NOTICES_CAP]
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        return self.seq

    def notices_after(self, after_seq: int, limit: int) -> list[Notice]:
        if not self.notices:
            return []
        start = max(0, after_seq + 1 - self.notices[0].seq)
        return self.notices[start : start + max(0, limit)]

    def changed(self) -> asyncio.Event:
        """An event set at the next notice."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    # -- reservations -------------------------------------------------------------------------
    def put(self, res: Reservation) -> None:
        """Add ``res``, or replace it after a state change (commit, release)."""
        rid = res.reservation_id
        old = self.reservations.get(rid)
        self._state = None
        if old is None:
            for i, v in enumerate(res.debit.as_tuple()):
                self._totals[i] += v
            if res.compute_us:
                self._time = self._time.plus(res.compute_time)
            self._open = None
        self.reservations[rid] = res
        if old is None or old.expires_at_ms != res.expires_at_ms:
            heapq.heappush(self._expiries, (res.expires_at_ms, res.grant_seq, rid))
        if res.state is ReservationState.RELEASED and (old is None or old.release_seq == 0):
            self._released.append((res.release_seq, rid))

    def _drop(self, rid: str) -> None:
        res = self.reservations.pop(rid)
        for i, v in enumerate(res.debit.as_tuple()):
            self._totals[i] -= v
        self._time = self._time.minus(res.compute_time)
        self._open = None
        self._state = None

    def next_expiry(self) -> int | None:
        """When the first of the reservations still on the books expires (None: there are none)."""
        heap = self._expiries
        while heap:
            exp, _, rid = heap[0]
            res = self.reservations.get(rid)
            if res is not None and res.expires_at_ms == exp:
                return exp
            heapq.heappop(heap)
        return None

    def purge_expired(self, now_ms: int) -> int:
        """Drop every reservation expired at ``now_ms``, each with an EXPIRE notice."""
        if not self._expiries or self._expiries[0][0] > now_ms:
            return 0  # nothing in the heap is due, lapsed entries included (every lease does this)
        expired: list[Reservation] = []
        while (exp := self.next_expiry()) is not None and exp <= now_ms:
            _, _, rid = heapq.heappop(self._expiries)
            expired.append(self.reservations[rid])
            self._drop(rid)
        for res in sorted(expired, key=lambda r: r.grant_seq):
            self.notify(NoticeKind.EXPIRE, now_ms, res)
        return len(expired)

    def purge_released(self, last_notice_seq: int) -> int:
        """Drop RELEASED reservations whose release notice the agent had seen (§5.4)."""
        purged = 0
        while self._released and self._released[0][0] <= last_notice_seq:
            release_seq, rid = self._released.popleft()
            res = self.reservations.get(rid)
            if res is not None and res.release_seq == release_seq:
                self._drop(rid)
                purged += 1
        return purged

    def open_debits(self, now_ms: int) -> tuple[Credits, int, ComputeTime]:
        """Sum, count and compute time of the reservations still counting at ``now_ms``."""
        nxt = self.next_expiry()
        if nxt is None or nxt > now_ms:
            if self._open is None:
                self._open = Credits.saturated(self._totals)
            return self._open, len(self.reservations), self._time
        live = [r for r in self.reservations.values() if r.expires_at_ms > now_ms]
        totals = [sum(col) for col in zip(*(r.debit.as_tuple() for r in live), strict=True)]
        time = ComputeTime()
        for r in live:
            if r.compute_us:
                time = time.plus(r.compute_time)
        return Credits.saturated(totals or [0] * 5), len(live), time

    def state(self, now_ms: int) -> NodeState:
        """The node as admission and the admin API see it at ``now_ms``: the same object from
        one call to the next until the books change or a reservation on them expires."""
        if self._state is not None and now_ms < self._state_until:
            return self._state  # kept: nothing changed and nothing on the books expired since
        nxt = self.next_expiry()
        settled = nxt is None or nxt > now_ms  # the open debits are the running totals
        debits, count, time = self.open_debits(now_ms)
        state = NodeState.trusted(
            info=self.info,
            lease=self._lease,
            open_debits=debits,
            open_reservations=count,
            open_compute=time,
        )
        if settled:
            self._state = state
            self._state_until = _NEVER if nxt is None else nxt
        return state

    def open_totals(self) -> tuple[list[int], ComputeTime]:
        """Running totals of every held reservation, and their compute time; exact right after
        :meth:`purge_expired`."""
        return self._totals, self._time
