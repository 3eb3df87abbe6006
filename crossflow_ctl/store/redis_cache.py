"""Replica-side, short-lived caches of the admission view, so a warm Admit is ONE round trip.

Agents refresh a prefill pool's load, the lender index and their node's lease every period
(200 ms by default), yet admission read all three on every request before its debit. Each
replica now keeps them for at most ``max_age_ms`` (judged on the process's monotonic clock, so a
test's manual clock cannot keep an entry forever): the pool's reports, a draw from the lender
index, and each node's state (lease and open debits; :class:`NodeCache`). Admission plans on
that view, then the debit script re-checks Safety against the live lease and open debits,
atomically, and its reply (lease epoch/version and open debits after the call) refreshes the
node's entry, so planning needs no read of its own while debits flow. The caches:

* **fails closed when stale**: liveness is judged on the caller's clock at every use. A cached
  pool snapshot is used only while every report in it is unexpired at ``now_ms`` (else the pool
  is read again); lender ids are used only while their index score (lease expiry) is ahead of
  ``now_ms``. The clock going backwards also forces a re-read.
* **never caches absence**: an empty pool or lender index is read again on the next request, so
  a missing pool load never outlives the write that fixes it.
* **follows every local write** that could change an entry: a pool load or cordon drops it;
  a lease this replica stores replaces the cached lease in place (dropping the entry when the
  write purged reservations or the cordon differs) and moves the lender draw
  (:meth:`LenderSample.changed`); a debit's reply refreshes the node's entry, which is dropped
  on any refusal other than ``short`` or when the reply names another lease version.

Nothing here decides safety: a plan made on a cached node only chooses which node to try, and
the debit script re-checks every credit against the latest lease and open debits, atomically.
A stale entry can only make a plan try a node that then refuses (the next ranked node is
tried), or answer NORMAL where a fresh read might have borrowed: never over-commit.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from crossflow_ctl.domain.models import (
    ComputeTime,
    Credits,
    Lease,
    NodeState,
    PoolSnapshot,
    StoredLease,
    StoredPoolLoad,
)

Monotonic = Callable[[], float]


@dataclass(frozen=True, slots=True)
class _PoolEntry:
    snapshot: PoolSnapshot
    fetched_at_s: float
    fetched_now_ms: int
    live_until_ms: int
    """The earliest expiry among the cached reports: from then on a read could differ."""


class PoolCache:
    """Live pool snapshots by pool name (see module docstring)."""

    def __init__(self, max_age_ms: int, monotonic: Monotonic = time.monotonic) -> None:
        self._max_age_s = max_age_ms / 1000.0
        self._monotonic = monotonic
        self._items: dict[str, _PoolEntry] = {}

    def get(self, pool: str, now_ms: int) -> PoolSnapshot | None:
        """The cached snapshot if still fresh and wholly live at ``now_ms``; None: read it."""
        entry = self._items.get(pool)
        if entry is None:
            return None
        if (
            self._monotonic() - entry.fetched_at_s >= self._max_age_s
            or not entry.fetched_now_ms <= now_ms < entry.live_until_ms
        ):
            del self._items[pool]
            return None
        return entry.snapshot

    def put(self, pool: str, live: Sequence[StoredPoolLoad], now_ms: int) -> PoolSnapshot | None:
        """Remember ``live`` (the reports unexpired at ``now_ms``); returns their snapshot."""
        if not live:
            self._items.pop(pool, None)
            return None
        snapshot = PoolSnapshot.of_stored(pool, live)
        if self._max_age_s > 0:
            self._items[pool] = _PoolEntry(
                snapshot=snapshot,
                fetched_at_s=self._monotonic(),
                fetched_now_ms=now_ms,
                live_until_ms=min(s.expires_at_ms for s in live),
            )
        return snapshot

    def drop(self, pool: str) -> None:
        self._items.pop(pool, None)


class LenderSample:
    """A bounded random draw from the lender index (ids with their lease expiry), sampled
    locally per request; the draw is renewed after ``max_age_ms`` or any local change."""

    def __init__(
        self,
        max_age_ms: int,
        monotonic: Monotonic = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._max_age_s = max_age_ms / 1000.0
        self._monotonic = monotonic
        self._rng = rng or random.Random()
        self._fetched_at_s = 0.0
        self._fetched_now_ms = 0
        self._members: tuple[tuple[str, int], ...] = ()
        self._size = 0
        """The working-set size of the last draw (:meth:`working_set`)."""
        self._journals: list[dict[str, int | None]] = []
        """One per draw being read (:meth:`drawing`)."""

    def pick(self, sample: int, now_ms: int) -> list[str] | None:
        """Up to ``sample`` distinct lenders live at ``now_ms``; None: draw from Redis again."""
        if not self._members:
            return None
        if (
            self._monotonic() - self._fetched_at_s >= self._max_age_s
            or now_ms < self._fetched_now_ms
        ):
            self._members = ()
            return None
        picked = self.choose(self._members, sample, now_ms)
        if not picked:
            self._members = ()
            return None
        return picked

    def choose(self, members: Sequence[tuple[str, int]], sample: int, now_ms: int) -> list[str]:
        """Up to ``sample`` distinct ids of ``members`` whose expiry is ahead of ``now_ms``."""
        live = [node_id for node_id, expires_ms in members if expires_ms > now_ms]
        if len(live) <= sample:
            return live
        return self._rng.sample(live, sample)

    def put(self, members: Sequence[tuple[str, int]], now_ms: int) -> None:
        """Remember a fresh draw (kept only when caching is on)."""
        if self._max_age_s <= 0:
            return
        self._members = tuple(members)
        self._fetched_at_s = self._monotonic()
        self._fetched_now_ms = now_ms

    def due(self) -> bool:
        """Whether a held draw is past half its age bound: time to renew it in the background
        (it is still used until the bound itself)."""
        return bool(self._members) and (
            self._monotonic() - self._fetched_at_s >= self._max_age_s / 2
        )

    def working_set(
        self, members: Sequence[tuple[str, int]], size: int, now_ms: int
    ) -> list[tuple[str, int]]:
        """Up to ``size`` of ``members`` live at ``now_ms`` (a random subset when more): the
        lenders whose states a replica keeps warm, so a warm Admit never reads before its
        debit, however large the fleet."""
        self._size = size
        live = [m for m in members if m[1] > now_ms]
        return live if len(live) <= size else self._rng.sample(live, size)

    def changed(self, changes: Mapping[str, int | None]) -> None:
        """This replica's writes to the lender index (node -> lease expiry, None: no longer
        lends): members that stopped lending leave the draw, renewed ones take their new
        expiry, and new lenders join while the draw is below its working-set size (so a small
        fleet sees them at once, a large one at the next draw)."""
        for journal in self._journals:
            journal.update(changes)
        if self._members:
            self._members = tuple(self.amended(self._members, changes))

    @contextmanager
    def drawing(self) -> Iterator[dict[str, int | None]]:
        """The changes :meth:`changed` is told of while a draw is read from Redis, for
        :meth:`amended`: a background renewal reads its states over several round trips, and
        the draw it puts must not bring back a lender this replica saw stop meanwhile."""
        journal: dict[str, int | None] = {}
        self._journals.append(journal)
        try:
            yield journal
        finally:
            self._journals.remove(journal)

    def amended(
        self, members: Sequence[tuple[str, int]], changes: Mapping[str, int | None]
    ) -> list[tuple[str, int]]:
        """``members`` with ``changes`` applied as :meth:`changed` says (the held draw, or one
        read from Redis and changed since)."""
        merged = dict(members)
        for node_id, expires in changes.items():
            if expires is None:
                merged.pop(node_id, None)
            elif node_id in merged or len(merged) < self._size:
                merged[node_id] = expires
        return list(merged.items())

    def drop(self) -> None:
        self._members = ()


@dataclass(frozen=True, slots=True)
class _NodeEntry:
    state: NodeState
    fetched_at_s: float
    fetched_now_ms: int


class NodeCache:
    """Node states by node id, as admission sees them (see module docstring)."""

    def __init__(self, max_age_ms: int, monotonic: Monotonic = time.monotonic) -> None:
        self._max_age_s = max_age_ms / 1000.0
        self._monotonic = monotonic
        self._items: dict[str, _NodeEntry] = {}

    def get(self, node_id: str, now_ms: int) -> NodeState | None:
        """The cached state if younger than the age bound and not from a later clock."""
        entry = self._items.get(node_id)
        if entry is None:
            return None
        if (
            self._monotonic() - entry.fetched_at_s >= self._max_age_s
            or now_ms < entry.fetched_now_ms
        ):
            del self._items[node_id]
            return None
        return entry.state

    def put(self, state: NodeState, now_ms: int) -> None:
        if self._max_age_s > 0:
            self._items[state.info.node_id] = _NodeEntry(state, self._monotonic(), now_ms)

    def due(self, node_id: str) -> bool:
        """Whether the node has no entry or one past half its age bound (read it again)."""
        entry = self._items.get(node_id)
        return entry is None or self._monotonic() - entry.fetched_at_s >= self._max_age_s / 2

    def leased(
        self, lease: Lease, received_at_ms: int, expires_at_ms: int, purged: int, cordoned: bool
    ) -> None:
        """This replica stored a newer lease for the node: the entry takes it in place, so a
        lease every agent period does not empty the cache. Dropped instead when the store's
        reply says more changed than the lease (reservations purged, cordon differs). Its age
        stays that of the open debits it holds."""
        entry = self._items.get(lease.node_id)
        if entry is None:
            return
        if purged or cordoned != entry.state.info.cordoned:
            del self._items[lease.node_id]
            return
        # Validating constructors: cheaper than model_construct on pydantic 2.13.
        stored = StoredLease(
            lease=lease, received_at_ms=received_at_ms, expires_at_ms=expires_at_ms
        )
        state = entry.state.model_copy(update={"lease": stored})
        self._items[lease.node_id] = _NodeEntry(state, entry.fetched_at_s, entry.fetched_now_ms)

    def debited(
        self, node_id: str, epoch: int, version: int, totals: Sequence[int], now_ms: int
    ) -> None:
        """Refresh the entry from a debit's reply: the lease (``epoch``, ``version``) the script
        checked and the node's open debits after it (``totals``: five credits, a count, the
        node microseconds behind the compute and the timed compute tokens), exact at
        ``now_ms``. Dropped instead when the lease is not the cached one."""
        entry = self._items.get(node_id)
        if entry is None:
            return
        stored = entry.state.lease
        if stored is None or (stored.lease.epoch, stored.lease.version) != (epoch, version):
            del self._items[node_id]
            return
        # Built without validation (``trusted``, every field in order): the totals are the
        # debit script's own integers (the caller parsed them), the rest the cached entry's.
        open_debits = Credits.trusted(
            compute_tokens=totals[0],
            kv_tokens=totals[1],
            kv_transfer_bytes=totals[2],
            output_tokens=totals[3],
            slots=totals[4],
        )
        state = NodeState.trusted(
            info=entry.state.info,
            lease=stored,
            open_debits=open_debits,
            open_reservations=totals[5],
            open_compute=ComputeTime(totals[6], totals[7]),
        )
        self._items[node_id] = _NodeEntry(state, self._monotonic(), now_ms)

    def drop(self, node_id: str) -> None:
        self._items.pop(node_id, None)
