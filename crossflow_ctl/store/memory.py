"""The in-process store: the embedded default for single-process runs and the simulator.

Clock-free (every method takes ``now_ms``), so the simulator can drive it on a virtual clock.
All state lives in plain dicts guarded by one :class:`asyncio.Lock`; every mutation is a single
critical section with no ``await`` inside, so each check-and-debit is atomic (DESIGN.md §5.3).
It honours exactly the semantics of :mod:`crossflow_ctl.store.base` and passes the same contract
suite as the Redis store (tests/store/test_contract.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from crossflow_ctl.aio import Finished, begin
from crossflow_ctl.domain.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from crossflow_ctl.domain.models import (
    Credits,
    Lease,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    NoticeKind,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    ReservationState,
    Share,
    StoredLease,
    StoredPoolLoad,
    validated,
)
from crossflow_ctl.domain.online_calibration import StepModelReport
from crossflow_ctl.domain.policy import VersionedPolicy
from crossflow_ctl.domain.safety import short_credits
from crossflow_ctl.store.base import (
    DebitOutcome,
    DebitRequest,
    LeaseOutcome,
    NodeEvent,
    Store,
    check_debit_args,
    check_identity,
    check_owner,
    grant_member,
    settled_debits,
)
from crossflow_ctl.store.keys import (
    new_reservation_id,
    node_of_reservation,
)
from crossflow_ctl.store.ledger import NodeLedger

MAX_REQUEST_RECORDS = 100_000
"""Request records kept before expired ones are swept (the store is clock-free otherwise; records
expire on the process's monotonic clock, as Redis expires its keys on its own)."""


def lease_event(old: StoredLease | None, new: Lease, now_ms: int) -> list[NodeEvent]:
    """State-change events an accepted lease causes (new epoch, zeroed, restored)."""
    events: list[NodeEvent] = []
    if old is None or old.lease.epoch != new.epoch:
        events.append(NodeEvent(at_ms=now_ms, kind="new_epoch", message=f"new epoch {new.epoch}"))
    new_zero = new.is_zero
    if new_zero and (old is None or not old.lease.is_zero):
        reason = new.zero_reason.value if new.zero_reason is not None else "no_capacity"
        events.append(
            NodeEvent(at_ms=now_ms, kind="lease_zeroed", message=f"lease zeroed: {reason}")
        )
    elif not new_zero and old is not None and (old.lease.is_zero or old.expired(now_ms)):
        events.append(NodeEvent(at_ms=now_ms, kind="lease_restored", message="lease restored"))
    return events


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """A pool snapshot and when it still holds: no report stored since (``seq``, the store's
    ingest counter), every report it left out still expired (at or before ``now_ms``: the
    latest of their expiries, ``dead_ms``) and every one in it still live (the earliest of
    theirs after ``now_ms``, ``live_ms``)."""

    snapshot: PoolSnapshot
    seq: int
    dead_ms: int | None
    live_ms: int | None

    def holds(self, seq: int, now_ms: int) -> bool:
        return (
            seq == self.seq
            and (self.dead_ms is None or self.dead_ms <= now_ms)
            and (self.live_ms is None or now_ms < self.live_ms)
        )


class MemoryStore(Store):
    """Everything in this process; ``seed`` makes sampling and reservation ids reproducible."""

    def __init__(self, seed: int | None = None) -> None:
        self._lock = asyncio.Lock()
        self._rng = random.Random(seed)
        self._nodes: dict[str, NodeLedger] = {}
        self._pools: dict[str, dict[str, StoredPoolLoad]] = {}
        self._pool_seq = 0
        """The last pool report's ingest sequence (one counter for every pool)."""
        self._lenders: dict[str, int] = {}
        """Nodes with a live non-zero lease and no cordon -> lease expiry (for sampling)."""
        self._policy: VersionedPolicy | None = None
        self._requests: dict[str, tuple[str, float]] = {}
        """Request records: key -> (outcome, expiry on the monotonic clock)."""
        self._step_models: dict[str, StepModelReport] = {}
        self._seen: dict[str, int] = {}
        """Node -> when it was last heard of (registration, accepted lease or pool load), ms."""
        self._snapshots: dict[str, _Snapshot] = {}
        """Each pool's last snapshot, handed out again while it holds (:meth:`_snapshot`)."""

    # -- helpers ----------------------------------------------------------------------------
    def _node(self, node_id: str) -> NodeLedger:
        node = self._nodes.get(node_id)
        if node is None:
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        return node

    def _update_lender(self, node: NodeLedger, now_ms: int) -> None:
        node_id = node.node_id
        stored = node.lease
        if stored is None or node.cordoned or stored.lease.is_zero or stored.expired(now_ms):
            self._lenders.pop(node_id, None)
        else:
            self._lenders[node_id] = stored.expires_at_ms

    def _reservation(
        self, reservation_id: str, now_ms: int, owner: str | None
    ) -> tuple[NodeLedger, Reservation]:
        owner = None if owner is None else check_owner(owner)
        node_id = node_of_reservation(reservation_id)
        node = self._nodes.get(node_id)
        res = node.reservations.get(reservation_id) if node is not None else None
        if node is None or res is None:
            raise NotFound(f"unknown reservation {reservation_id!r}", field="reservation_id")
        if res.expires_at_ms <= now_ms:
            node.purge_expired(now_ms)
            raise NotFound(f"reservation {reservation_id!r} expired", field="reservation_id")
        if owner is not None and res.owner != owner:
            raise PermissionDenied(
                f"reservation {reservation_id!r} belongs to another router",
                field="reservation_id",
            )
        return node, res

    # -- agents -----------------------------------------------------------------------------
    async def register_node(
        self,
        node_id: str,
        role: NodeRole,
        pool: str,
        labels: dict[str, str],
        now_ms: int,
    ) -> NodeInfo:
        async with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                info = validated(
                    NodeInfo,
                    node_id=node_id,
                    role=role,
                    pool=pool,
                    labels=dict(labels),
                    registered_at_ms=now_ms,
                )
                node = self._nodes[node_id] = NodeLedger(info=info)
            else:
                check_identity(node.info, role, pool)
                validated(NodeInfo, node_id=node_id, role=role, pool=pool, labels=dict(labels))
                node.info = node.info.model_copy(
                    update={"role": role, "pool": pool, "labels": dict(labels)}
                )
            self._seen[node_id] = now_ms
            return node.info

    async def upsert_lease(self, lease: Lease, now_ms: int, max_ttl_ms: int) -> LeaseOutcome:
        async with self._lock:
            node = self._nodes.get(lease.node_id)
            if node is None:
                raise FailedPrecondition(
                    f"node {lease.node_id!r} is not registered", field="node_id"
                )
            old = node.lease
            if old is not None and not lease.is_newer_than(old.lease.epoch, old.lease.version):
                return LeaseOutcome(
                    accepted=False,
                    stored_epoch=old.lease.epoch,
                    stored_version=old.lease.version,
                )
            purged = node.purge_expired(now_ms) + node.purge_released(lease.last_notice_seq)
            stored = StoredLease.trusted(
                lease=lease,
                received_at_ms=now_ms,
                expires_at_ms=now_ms + min(lease.ttl_ms, max_ttl_ms),
            )
            node.events.extend(lease_event(old, lease, now_ms))
            node.lease = stored
            node.history.append(stored)
            self._update_lender(node, now_ms)
            self._seen[lease.node_id] = now_ms
            return LeaseOutcome.trusted(
                accepted=True,
                stored_epoch=lease.epoch,
                stored_version=lease.version,
                purged_reservations=purged,
            )

    async def put_pool_load(self, load: PoolLoad, now_ms: int, max_ttl_ms: int) -> bool:
        async with self._lock:
            self._pool_seq += 1
            self._pools.setdefault(load.pool, {})[load.node_id] = StoredPoolLoad.trusted(
                load=load,
                received_at_ms=now_ms,
                expires_at_ms=now_ms + min(load.ttl_ms, max_ttl_ms),
                seq=self._pool_seq,
            )
            if load.node_id not in self._nodes:
                return False
            self._seen[load.node_id] = now_ms
            return True

    async def put_step_model(self, node_id: str, report: StepModelReport) -> bool:
        async with self._lock:
            if node_id not in self._nodes:
                return False
            self._step_models[node_id] = report
            return True

    async def step_model(self, node_id: str) -> StepModelReport | None:
        self._node(node_id)
        return self._step_models.get(node_id)

    # -- admission --------------------------------------------------------------------------
    def _snapshot(self, pool: str, now_ms: int) -> PoolSnapshot:
        """The pool's live reports at ``now_ms``: the same object as last time while no report
        was stored since and none changed side of its expiry (the Redis store's replicas hand
        out one cached view the same way), so a caller can tell an unchanged pool by identity
        (the admission service's Demand is computed once per snapshot)."""
        cached = self._snapshots.get(pool)
        if cached is not None and cached.holds(self._pool_seq, now_ms):
            return cached.snapshot
        reports = self._pools.get(pool)
        if reports is None:  # no pool by that name: nothing to keep (any name can be asked)
            return PoolSnapshot.of_stored(pool, [])
        live = [reports[k] for k in sorted(reports) if reports[k].expires_at_ms > now_ms]
        dead = [r.expires_at_ms for r in reports.values() if r.expires_at_ms <= now_ms]
        snapshot = PoolSnapshot.of_stored(pool, live)
        self._snapshots[pool] = _Snapshot(
            snapshot,
            self._pool_seq,
            max(dead, default=None),
            min((r.expires_at_ms for r in live), default=None),
        )
        return snapshot

    def _sample(self, sample: int, now_ms: int) -> list[str]:
        for node_id in [n for n, exp in self._lenders.items() if exp <= now_ms]:
            del self._lenders[node_id]
        # Sorted: the draw depends on the seed and the lenders, not on the order their leases
        # arrived (the simulator's deferred leases change that order, not the lenders).
        ids = sorted(self._lenders)
        return self._rng.sample(ids, min(sample, len(ids)))

    async def admission_view(
        self, pool: str, node_ids: Sequence[str], sample: int, now_ms: int
    ) -> tuple[PoolSnapshot | None, list[NodeState]]:
        return self.view_now(pool, node_ids, sample, now_ms)

    def view_now(
        self, pool: str, node_ids: Sequence[str], sample: int, now_ms: int
    ) -> tuple[PoolSnapshot | None, list[NodeState]]:
        """:meth:`admission_view` for a caller on this store's own thread, without a
        coroutine (the simulator's direct control plane, once per Admit or room read)."""
        snapshot = self._snapshot(pool, now_ms)
        chosen = list(dict.fromkeys(node_ids)) if node_ids else self._sample(sample, now_ms)
        states = [self._nodes[n].state(now_ms) for n in chosen if n in self._nodes]
        return (snapshot if snapshot.reports else None), states

    async def try_debits_settled(
        self,
        debits: Sequence[DebitRequest],
        share: Share,
        now_ms: int,
        hold_ttl_ms: int,
        late: Callable[[list[DebitOutcome]], None],
    ) -> list[DebitOutcome]:
        """``Store.try_debits_settled``, run at once to its first suspension: debits that land
        without one (the lock free: nearly always) are answered with no task, as nothing could
        cancel them; the rest of one that waits for the lock runs in a task as the base's does.
        (Safe here only: these debits set up no timeout, which would otherwise be armed on the
        caller's task, not the debit's.)"""
        started = begin(self.try_debits(debits, share, now_ms, hold_ttl_ms))
        if isinstance(started, Finished):
            return started.value
        return await settled_debits(started, late, self._late_debits())

    async def try_debit(
        self,
        node_id: str,
        debit: Credits,
        share: Share,
        now_ms: int,
        hold_ttl_ms: int,
        request_id: str = "",
        owner: str = "",
        compute_us: int = 0,
        pulled_tokens: int | None = None,
    ) -> DebitOutcome:
        check_debit_args(share, hold_ttl_ms, owner, compute_us, pulled_tokens)
        item = DebitRequest(node_id, debit, request_id, owner, None, compute_us, pulled_tokens)
        async with self._lock:
            return self._debit(item, share, now_ms, hold_ttl_ms)

    async def try_debits(
        self, debits: Sequence[DebitRequest], share: Share, now_ms: int, hold_ttl_ms: int
    ) -> list[DebitOutcome]:
        """``Store.try_debits``: every item checked first (``check_debits``: what each
        ``try_debit`` checks), then each debited in turn, in one critical section."""
        self.check_debits(debits, share, hold_ttl_ms)
        async with self._lock:
            return [self._debit(d, share, now_ms, hold_ttl_ms) for d in debits]

    def debit_now(
        self, item: DebitRequest, share: Share, now_ms: int, hold_ttl_ms: int
    ) -> DebitOutcome:
        """One debit, checked and recorded at once, for a caller on this store's own thread
        that passes arguments ``check_debits`` accepts (the simulator's direct control plane:
        the broker's own policy and plans). No coroutine: atomic as long as no other
        caller holds the lock, which a lone in-process caller never finds held."""
        assert not self._lock.locked(), "debit_now while another call holds the store"
        return self._debit(item, share, now_ms, hold_ttl_ms)

    def _debit(
        self, item: DebitRequest, share: Share, now_ms: int, hold_ttl_ms: int
    ) -> DebitOutcome:
        """One checked debit's check-and-record, under the lock (no ``await``: atomic)."""
        node_id, debit, request_id, owner, _, compute_us, pulled_tokens = item
        node = self._nodes.get(node_id)
        if node is None:
            return DebitOutcome(granted=False, refusal="unknown_node")
        node.purge_expired(now_ms)
        stored = node.lease
        epoch, version = (stored.lease.epoch, stored.lease.version) if stored else (0, 0)

        def refuse(why: str, short: tuple[str, ...] = ()) -> DebitOutcome:
            return DebitOutcome(
                granted=False,
                refusal=why,
                short_credits=short,
                lease_epoch=epoch,
                lease_version=version,
            )

        if node.cordoned:
            return refuse("cordoned")
        if stored is None:
            return refuse("no_lease")
        if stored.expired(now_ms):
            return refuse("expired")
        if stored.lease.is_zero:
            return refuse("zero_lease")
        lease = stored.lease
        totals, time = node.open_totals()
        rate = lease.borrowed_prefill_rate_tps
        short = short_credits(lease.credits, totals, share, debit, rate, time, compute_us)
        if short:
            return refuse("short", short)
        rid = new_reservation_id(node_id, self._rng.getrandbits(128))
        # Every field, of its type and in bounds (the node's registered id, the arguments
        # checked above): built without validation, once per granted debit.
        res = Reservation.trusted(
            reservation_id=rid,
            node_id=node_id,
            state=ReservationState.HELD,
            debit=debit,
            compute_us=compute_us,
            lease_epoch=epoch,
            lease_version=version,
            created_at_ms=now_ms,
            expires_at_ms=now_ms + hold_ttl_ms,
            grant_seq=node.seq + 1,
            release_seq=0,
            request_id=request_id,
            owner=owner,
        )
        node.notify(NoticeKind.GRANT, now_ms, res, pulled_tokens)
        node.put(res)
        return DebitOutcome.grant(res, epoch, version)

    async def commit(
        self, reservation_id: str, now_ms: int, commit_ttl_ms: int, owner: str | None = None
    ) -> Reservation:
        if commit_ttl_ms <= 0:
            raise InvalidArgument("commit_ttl_ms must be positive", field="commit_ttl_ms")
        async with self._lock:
            node, res = self._reservation(reservation_id, now_ms, owner)
            if res.state is ReservationState.RELEASED:
                raise FailedPrecondition(
                    f"reservation {reservation_id!r} was released", field="reservation_id"
                )
            if res.state is ReservationState.COMMITTED:
                return res
            # A copy of a stored reservation with two fields of their types (the TTL checked
            # above): not revalidated, once per borrowed prompt.
            expires = now_ms + commit_ttl_ms
            res = res.replaced(state=ReservationState.COMMITTED, expires_at_ms=expires)
            node.put(res)
            node.notify(NoticeKind.COMMIT, now_ms, res)
            return res

    async def release(
        self, reservation_id: str, now_ms: int, owner: str | None = None
    ) -> Reservation:
        async with self._lock:
            node, res = self._reservation(reservation_id, now_ms, owner)
            if res.state is ReservationState.RELEASED:
                return res
            seq = node.seq + 1
            res = res.replaced(state=ReservationState.RELEASED, release_seq=seq)  # as in commit
            node.put(res)
            node.notify(NoticeKind.RELEASE, now_ms, res)
            return res

    # -- operators --------------------------------------------------------------------------
    async def set_cordon(self, node_id: str, cordoned: bool, reason: str, now_ms: int) -> NodeInfo:
        async with self._lock:
            node = self._node(node_id)
            changed = node.cordoned != cordoned
            node.info = node.info.model_copy(
                update={"cordoned": cordoned, "cordon_reason": reason if cordoned else ""}
            )
            if changed:
                kind = NoticeKind.CORDON if cordoned else NoticeKind.UNCORDON
                node.notify(kind, now_ms)
                text = f"cordoned: {reason}" if cordoned else "uncordoned"
                node.events.append(NodeEvent(at_ms=now_ms, kind=kind.value, message=text))
            self._update_lender(node, now_ms)
            return node.info

    def _drop(self, node_id: str, force: bool, now_ms: int) -> int:
        """Delete a node (under the lock); FailedPrecondition while reservations count."""
        _, open_count, _ = self._node(node_id).open_debits(now_ms)
        if open_count and not force:
            raise FailedPrecondition(
                f"node {node_id!r} has {open_count} open reservation(s)",
                field="force",
            )
        del self._nodes[node_id]
        self._step_models.pop(node_id, None)
        self._lenders.pop(node_id, None)
        self._seen.pop(node_id, None)
        return open_count

    async def delete_node(self, node_id: str, force: bool, now_ms: int) -> int:
        async with self._lock:
            return self._drop(node_id, force, now_ms)

    async def expire_nodes(self, idle_ms: int, now_ms: int) -> list[str]:
        gone: list[str] = []
        async with self._lock:
            for node_id in sorted(self._nodes):
                if self._seen.get(node_id, 0) >= now_ms - idle_ms:
                    continue
                with contextlib.suppress(FailedPrecondition):
                    self._drop(node_id, False, now_ms)
                    gone.append(node_id)
        return gone

    async def list_nodes(self, now_ms: int) -> list[NodeState]:
        return [self._nodes[n].state(now_ms) for n in sorted(self._nodes)]

    async def get_node(self, node_id: str, now_ms: int) -> NodeState:
        return self._node(node_id).state(now_ms)

    async def list_reservations(self, node_id: str | None, now_ms: int) -> list[Reservation]:
        nodes = [self._node(node_id)] if node_id is not None else list(self._nodes.values())
        found = [r for n in nodes for r in n.reservations.values() if r.expires_at_ms > now_ms]
        return sorted(found, key=lambda r: (r.created_at_ms, r.node_id, r.grant_seq))

    async def list_pools(self, now_ms: int) -> list[PoolSnapshot]:
        return [self._snapshot(p, now_ms) for p in sorted(self._pools)]

    def reservation_due(self, node_id: str, now_ms: int) -> bool:
        """Whether a reservation on ``node_id`` (held, committed or released and not yet purged)
        expires at or before ``now_ms``: what decides whether a lease stored then would expire
        any (the simulator's deferred leases, :mod:`crossflow_ctl.sim.agents`). Not part of the
        :class:`Store` contract; False for an unknown node."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        due = node.next_expiry()
        return due is not None and due <= now_ms

    def notice_seq(self, node_id: str) -> int:
        """The sequence of ``node_id``'s latest notice (0: none, or an unknown node): a reader
        that has seen it has nothing to read. Not part of the :class:`Store` contract."""
        node = self._nodes.get(node_id)
        return node.seq if node is not None else 0

    async def lease_history(self, node_id: str, limit: int) -> list[StoredLease]:
        history = self._node(node_id).history
        return list(reversed(history))[: max(0, limit)]

    async def node_events(self, node_id: str, limit: int) -> list[NodeEvent]:
        events = self._node(node_id).events
        return list(reversed(events))[: max(0, limit)]

    # -- notices ----------------------------------------------------------------------------
    async def read_notices(
        self, node_id: str, after_seq: int, limit: int, block_ms: int = 0
    ) -> list[Notice]:
        node = self._node(node_id)
        found = node.notices_after(after_seq, limit)
        if found or block_ms <= 0:
            return found
        try:
            async with asyncio.timeout(block_ms / 1000.0):
                while not found:
                    await node.changed().wait()
                    found = node.notices_after(after_seq, limit)
        except TimeoutError:
            return []
        return found

    # -- policy -----------------------------------------------------------------------------
    async def get_policy(self) -> VersionedPolicy | None:
        return self._policy

    async def set_policy(self, policy: VersionedPolicy, expected_version: int) -> None:
        async with self._lock:
            current = self._policy.version if self._policy is not None else 0
            if current != expected_version:
                raise Aborted(
                    f"policy is at version {current}, not {expected_version}",
                    current_version=current,
                    field="expected_version",
                )
            self._policy = policy

    # -- request records --------------------------------------------------------------------
    def _live_record(self, key: str) -> str | None:
        found = self._requests.get(key)
        if found is None:
            return None
        if found[1] <= time.monotonic():
            del self._requests[key]
            return None
        return found[0]

    def _bound_requests(self) -> None:
        """Past MAX_REQUEST_RECORDS, drop expired records, then the oldest half if need be
        (amortised O(1) per record; a retry after its record was dropped decides afresh)."""
        if len(self._requests) <= MAX_REQUEST_RECORDS:
            return
        now = time.monotonic()
        live = [(k, v) for k, v in self._requests.items() if v[1] > now]
        keep = live[len(live) // 2 :] if len(live) > MAX_REQUEST_RECORDS // 2 else live
        self._requests = dict(keep)

    async def read_request(self, key: str) -> str | None:
        async with self._lock:
            return self._live_record(key)

    async def record_request(self, key: str, outcome: str, ttl_ms: int) -> str | None:
        async with self._lock:
            stored = self._live_record(key)
            if stored is not None:
                return stored
            self._bound_requests()
            self._requests[key] = (outcome, time.monotonic() + ttl_ms / 1000.0)
            return None

    async def forget_request(self, key: str, reservation_id: str) -> None:
        async with self._lock:
            stored = self._live_record(key)
            if stored is not None and grant_member(reservation_id) in stored:
                del self._requests[key]

    # -- lifecycle --------------------------------------------------------------------------
    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
