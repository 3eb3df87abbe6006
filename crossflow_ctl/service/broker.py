"""The broker's domain class: admission, reservations, lease ingest and the admin operations.

Given its store, clock and settings; knows nothing of gRPC (the servicers translate). Admission
(:mod:`crossflow_ctl.service.admission`) fails closed: any store error or a store slower than
``policy.admit_timeout_ms`` answers NORMAL with reason STORE_UNAVAILABLE or TIMEOUT, never an
error (DESIGN.md §5.6).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog

from crossflow_ctl.aio import within
from crossflow_ctl.domain.admission import (
    Admission,
    AdmissionRequest,
    Decision,
    DemandCheck,
    check_demand,
)
from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.domain.errors import (
    CrossflowError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StaleLease,
    StoreUnavailable,
)
from crossflow_ctl.domain.models import (
    Frozen,
    Lease,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    NoticeKind,
    NoticeRow,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    StoredLease,
    check_epoch,
    validated,
)
from crossflow_ctl.domain.online_calibration import StepModelReport
from crossflow_ctl.domain.pending import Unreported
from crossflow_ctl.domain.policy import PolicySettings, VersionedPolicy
from crossflow_ctl.domain.room import (
    RoomUpdate,
    RoomView,
    RoomWatchRequest,
    summarize_room,
    unknown_room,
)
from crossflow_ctl.domain.selectors import Selector
from crossflow_ctl.domain.session import within_horizon
from crossflow_ctl.observability import BrokerMetrics, annotate_node
from crossflow_ctl.service.admission import Admitter, timed
from crossflow_ctl.service.checks import (
    check_node_id,
    check_request_id,
    check_reservation_id,
)
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.service.policy_keeper import PolicyKeeper, refresh_forever
from crossflow_ctl.service.requests import (
    OrphanDebits,
    admit_once,
    record_ttl_ms,
    recorded_apart,
    run_once,
)
from crossflow_ctl.service.room import NodeRooms, RoomWatches
from crossflow_ctl.service.store_breaker import StoreBreaker
from crossflow_ctl.store.base import LeaseOutcome, NodeEvent, Store

log = structlog.get_logger()
T = TypeVar("T")


class NodeDetail(Frozen):
    """One node for ``crossflowctl get node``: state, open reservations, history, events."""

    state: NodeState
    reservations: tuple[Reservation, ...] = ()
    recent_leases: tuple[StoredLease, ...] = ()
    events: tuple[NodeEvent, ...] = ()
    step_model: StepModelReport | None = None
    """The node agent's latest online calibration (None: it sent none)."""


class Broker:
    """One replica's view of the control plane; all shared state lives in the store."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        settings: BrokerSettings,
        broker_id: str = "",
        metrics: BrokerMetrics | None = None,
        *,
        sequential: bool = False,
    ) -> None:
        """``sequential``: Admits come one at a time from one in-process caller (the
        simulator), so a lone Admit is decided at once rather than after one event-loop turn
        for concurrent ones to join its group commit (:class:`Admitter`)."""
        self.store = store
        self.clock = clock
        self.settings = settings
        self.metrics = metrics or BrokerMetrics.noop()
        self._zero_reasons: dict[str, str] = {}
        """Last zero-lease reason per node ("" once it lends again), for state-change logs."""
        self.broker_id = broker_id or settings.broker_id or "broker"
        self.warnings: tuple[str, ...] = ()
        """What operators must be told about this replica (it serves unauthenticated callers
        beyond loopback, say), set by its server at start; answered with ListNodes."""
        self._policy = PolicyKeeper(store, settings.policy, clock, settings.policy_refresh_ms)
        self._orphans = OrphanDebits(lambda rid: self.release(rid, "cancelled"), store)
        """Releases debits that landed after their Admit had answered (see Admitter)."""
        self.breaker = StoreBreaker(store, clock, settings.store_breaker, self.metrics)
        """Admission's fail-fast while the store does not answer."""
        self._admitter = Admitter(
            store,
            clock,
            self.metrics,
            lambda: self.policy,
            self._orphans.watch,
            self._orphans.release,
            sequential,
            self.breaker,
        )
        self.rooms = RoomWatches(settings.room, clock, self.room_view)
        """This replica's WatchRoom subscriptions (late binding)."""
        self._node_rooms = NodeRooms()
        """Room views' node rooms, each computed once per node state (:class:`NodeRooms`)."""
        self._room_demand: (
            tuple[PoolSnapshot | None, PolicySettings, Unreported, DemandCheck] | None
        ) = None
        """The last room view's pool snapshot, policy, unreported count and the pool's Demand
        for them: snapshots and policies are immutable and handed out again until renewed."""

    # -- policy, shared through the store and cached briefly -----------------------------------
    @property
    def policy(self) -> PolicySettings:
        return self._policy.current.policy

    async def load_policy(self) -> PolicySettings:
        """Adopt the store's policy (seeding or restoring it: :mod:`.policy_keeper`)."""
        return (await self._admin_call(self._policy.load())).policy

    async def refresh_policy_forever(self, stop: asyncio.Event) -> None:
        """Re-read the shared policy every ``policy_refresh_ms`` until ``stop`` is set."""
        await refresh_forever(self.load_policy, stop, self.settings.policy_refresh_ms / 1000.0)

    @property
    def versioned_policy(self) -> VersionedPolicy:
        return self._policy.current

    async def policy_changed_after(self, version: int) -> VersionedPolicy:
        """The policy once this replica holds a version other than ``version``."""
        return await self._policy.changed_after(version)

    async def get_policy(self) -> VersionedPolicy:
        return await self._admin_call(self._policy.load())

    async def set_policy(
        self, updates: dict[str, Any], expected_version: int | None = None
    ) -> VersionedPolicy:
        """A new policy version; Aborted when ``expected_version`` is not the stored one."""
        return await self._admin_call(self._policy.update(updates, expected_version))

    # -- admission -------------------------------------------------------------------------------
    async def admit(
        self, request: AdmissionRequest, owner: str = "", join: bool = True
    ) -> Admission:
        """Always answers; NORMAL with a reason on any doubt (§5.6). Counted, timed, logged.

        A granted reservation records ``owner`` (the router's identity, "" without
        authentication): only it, or an admin, may commit or release it. ``join=False``: a lone
        one is decided without a turn for others to join it (``Admitter.admit_many``)."""
        # With the breaker open the admitter answers at once; a retry's record is not read either.
        if request.request_id and not request.dry_run and self.breaker.allows:

            async def decide(one: AdmissionRequest) -> Admission:
                return await self._admitter.admit(one, owner, join)

            return await admit_once(self.store, request, self.policy, decide, self._orphans.release)
        return await self._admitter.admit(request, owner, join)

    async def settle_admissions(self, timeout_s: float) -> None:
        """Wait for the Admit batches being decided (at shutdown, before the store settles:
        a batch whose callers went away hands its grants to the orphan releases)."""
        await self._admitter.settle(timeout_s)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for background releases of late debits, and stop the store probe (at
        shutdown)."""
        await self.breaker.close()
        await self._orphans.drain(timeout_s)

    async def admit_many(
        self, requests: Sequence[AdmissionRequest], owner: str = ""
    ) -> list[Admission]:
        """One answer per request, in order, decided together (and with any Admit queued
        alongside: :class:`~crossflow_ctl.service.admission.Admitter`). A request whose record
        its debit cannot write (a retry, or a store that does not fold records) goes through
        :meth:`admit`'s exactly-once path; it still joins the same group commit."""
        policy = self.policy
        alone = {i for i, r in enumerate(requests) if recorded_apart(self.store, r, policy)}
        if not alone:
            return await self._admitter.admit_many(requests, owner)
        together = [r for i, r in enumerate(requests) if i not in alone]
        batch, singles = await asyncio.gather(
            self._admitter.admit_many(together, owner),
            asyncio.gather(*(self.admit(requests[i], owner) for i in sorted(alone))),
        )
        in_batch, by_one = iter(batch), iter(singles)
        return [next(by_one) if i in alone else next(in_batch) for i in range(len(requests))]

    @property
    def shadow_decisions(self) -> dict[Decision, int]:
        """Count of decisions made in shadow mode, by what they would have been."""
        return self._admitter.shadow_decisions

    # -- late binding ----------------------------------------------------------------------------
    async def room_view(self, request: RoomWatchRequest) -> RoomView:
        """The room for ``request`` now, from the store; UNKNOWN (no room) on any doubt."""
        policy, now, limit_ms = self.policy, self.clock.now_ms(), self.settings.admin_timeout_ms
        view = self.store.admission_view(
            request.pool, request.candidate_node_ids, self.settings.room.max_nodes, now
        )
        try:
            pool, nodes = await within(timed(self.metrics, "room_view", view), limit_ms / 1000.0)
        except Exception as exc:  # fail closed on a store error, overrun or anything unforeseen
            detail = f"store slower than {limit_ms} ms" if isinstance(exc, TimeoutError) else exc
            log.warning("room_view.failed", error=repr(exc))
            return unknown_room(request.pool, f"room unknown: {detail}")
        return self.room_of(request, pool, nodes, policy, now)

    def room_of(
        self,
        request: RoomWatchRequest,
        pool: PoolSnapshot | None,
        nodes: list[NodeState],
        policy: PolicySettings,
        now: int,
    ) -> RoomView:
        """The room for ``request`` on an admission view read at ``now``."""
        sent = self._admitter.sent.unreported(pool) if pool is not None else Unreported()
        kept = self._room_demand
        if kept is None or kept[0] is not pool or kept[1] is not policy or kept[2] != sent:
            demand = check_demand(pool, policy, sent.shared, None, sent.by_server)
            kept = self._room_demand = (pool, policy, sent, demand)
        return summarize_room(
            request.pool, pool, nodes, policy, now, sent, self._node_rooms, kept[3]
        )

    def watch_room(self, request: RoomWatchRequest) -> AsyncIterator[RoomUpdate]:
        """Room updates for ``request`` (see :mod:`crossflow_ctl.service.room`)."""
        return self.rooms.watch(request)

    async def commit(
        self,
        reservation_id: str,
        owner: str | None = None,
        request_id: str = "",
        attempt: int = 0,
    ) -> Reservation:
        """Commit; with ``owner`` (a router's identity) only a reservation it was granted; with
        ``request_id`` exact under retries (:mod:`.requests`)."""
        return await self._exactly_once(
            "commit",
            reservation_id,
            request_id,
            attempt,
            lambda: self._commit(reservation_id, owner),
        )

    async def _exactly_once(
        self,
        kind: str,
        reservation_id: str,
        request_id: str,
        attempt: int,
        call: Callable[[], Awaitable[Reservation]],
    ) -> Reservation:
        """``call`` once per ``request_id`` (a retry gets the first outcome back); without a
        request id, simply ``call``. Either way ONE admin deadline and timing bound it all."""
        check_reservation_id(reservation_id)
        check_request_id(request_id)
        if not request_id:
            return await self._admin_call(call())
        return await self._admin_call(
            run_once(
                self.store,
                f"{kind}:{request_id}:{reservation_id}",
                attempt,
                record_ttl_ms(self.policy),
                call,
                lambda r: r.model_dump_json(),
                Reservation.model_validate_json,
            )
        )

    async def _commit(self, reservation_id: str, owner: str | None) -> Reservation:
        now, ttl = self.clock.now_ms(), self.policy.commit_ttl_ms
        try:
            res = await self.store.commit(reservation_id, now, ttl, owner)
        except NotFound:  # expired (and maybe purged since): the router came too late
            self.metrics.record_reservation_event("commit_late")
            raise
        self.metrics.record_reservation_event("commit")
        annotate_node(res.node_id)
        return res

    async def release(
        self,
        reservation_id: str,
        outcome: str = "",
        owner: str | None = None,
        request_id: str = "",
        attempt: int = 0,
    ) -> Reservation:
        """Release; with ``owner`` (a router's identity) only a reservation it was granted; with
        ``request_id`` exact under retries (:mod:`.requests`)."""
        return await self._exactly_once(
            "release",
            reservation_id,
            request_id,
            attempt,
            lambda: self._release(reservation_id, outcome, owner),
        )

    async def _release(self, reservation_id: str, outcome: str, owner: str | None) -> Reservation:
        now = self.clock.now_ms()
        try:
            res = await self.store.release(reservation_id, now, owner)
        except NotFound:  # expired (and maybe purged since): released too late
            self.metrics.record_reservation_event("release_late")
            raise
        log.debug("release", reservation_id=reservation_id, node_id=res.node_id, outcome=outcome)
        self.metrics.record_reservation_event("release")
        annotate_node(res.node_id)
        self.rooms.poke()
        return res

    # -- agents ----------------------------------------------------------------------------------
    async def register(
        self, node_id: str, role: NodeRole, pool: str, labels: dict[str, str]
    ) -> NodeInfo:
        """Register on Hello; FailedPrecondition naming ``hello.role``/``hello.pool`` when it
        would change the identity of a registered node that is not cordoned."""
        check_node_id(node_id, "hello.node_id")
        check_node_id(pool, "hello.pool")
        try:
            validated(NodeInfo, node_id=node_id, role=role, pool=pool, labels=dict(labels))
            return await self._admin_call(
                self.store.register_node(node_id, role, pool, labels, self.clock.now_ms())
            )
        except (InvalidArgument, FailedPrecondition) as exc:
            exc.field = f"hello.{exc.field}" if exc.field else "hello"
            raise

    async def ingest_lease(self, lease: Lease, role: NodeRole = NodeRole.DECODE) -> LeaseOutcome:
        """Store a newer lease; StaleLease (changing nothing) when it is not newer (§5.1).

        Only decode nodes lease (FailedPrecondition naming ``lease``); an epoch that is not
        plausibly a start time is refused (:func:`check_epoch`). The lease is stored capped to
        this replica's borrow horizon (:func:`~crossflow_ctl.domain.session.within_horizon`), so
        one sized over an older horizon (an agent that has not adopted a policy push yet, or
        ignores it) offers no more than the horizon allows, whichever path brought it."""
        lease, now_ms = self._lease_to_store(lease, role)
        # No timer per lease: the store bounds its own batches (RedisStore: op timeout).
        outcome = await timed(
            self.metrics,
            "admin",
            self.store.upsert_lease(lease, now_ms, self.policy.max_lease_ttl_ms),
        )
        return self._lease_stored(lease, outcome)

    def _lease_to_store(self, lease: Lease, role: NodeRole) -> tuple[Lease, int]:
        """:meth:`ingest_lease`'s checks: the lease as it is stored now, and now."""
        if role is not NodeRole.DECODE:
            raise FailedPrecondition(
                f"node {lease.node_id!r} is a {role.value} node: only decode nodes lease",
                field="lease",
            )
        now_ms = self.clock.now_ms()
        check_epoch(lease.epoch, now_ms)
        return within_horizon(lease, self.policy.borrow_horizon_ms), now_ms

    def _lease_stored(self, lease: Lease, outcome: LeaseOutcome) -> LeaseOutcome:
        """:meth:`ingest_lease`'s answer to the store's ``outcome`` of ``lease``."""
        if not outcome.accepted:
            raise StaleLease(
                f"lease ({lease.epoch}, {lease.version}) is not newer than the stored "
                f"({outcome.stored_epoch}, {outcome.stored_version})",
                stored_epoch=outcome.stored_epoch,
                stored_version=outcome.stored_version,
                field="lease.version",
            )
        self._note_zero(lease)
        if not lease.is_zero:
            self.rooms.poke()
        return outcome

    def _note_zero(self, lease: Lease) -> None:
        """Log (info) when a node's lease turns zero, changes zero reason, or lends again."""
        reason = lease.zero_reason.value if lease.zero_reason is not None else ""
        before = self._zero_reasons.get(lease.node_id, "")
        if reason == before:
            return
        self._zero_reasons[lease.node_id] = reason
        if reason:
            log.info("lease.zeroed", node_id=lease.node_id, reason=reason, detail=lease.zero_detail)
        else:
            log.info("lease.lending", node_id=lease.node_id, was=before)

    async def ingest_pool_load(
        self, load: PoolLoad, role: NodeRole = NodeRole.PREFILL, pool: str | None = None
    ) -> bool:
        """Record a prefill server's load; FailedPrecondition from a decode node (``pool_load``)
        or for a pool other than the node's registered one (``pool_load.pool``). Returns whether
        the node is registered (``Store.put_pool_load``)."""
        if role is not NodeRole.PREFILL:
            raise FailedPrecondition(
                f"node {load.node_id!r} is a {role.value} node: only prefill nodes report load",
                field="pool_load",
            )
        if pool is not None and load.pool != pool:
            raise FailedPrecondition(
                f"node {load.node_id!r} is registered in pool {pool!r}, not {load.pool!r}",
                field="pool_load.pool",
            )
        registered: bool = await self._admin_call(
            self.store.put_pool_load(load, self.clock.now_ms(), self.policy.max_lease_ttl_ms)
        )
        return registered

    async def ingest_step_model(self, node_id: str, report: StepModelReport) -> bool:
        """Keep a decode agent's online calibration for ``describe node``; returns whether the
        node is registered (``Store.put_step_model``). Admission never reads it."""
        stored: bool = await self._admin_call(self.store.put_step_model(node_id, report))
        return stored

    async def read_notices(self, node_id: str, after_seq: int, block_ms: int) -> list[Notice]:
        """The node's notices after ``after_seq``; waits in the store up to ``block_ms``. The
        store bounds the wait and its calls (``Store.read_notices``): a timer here would be one
        more per waiting agent stream, thousands on a large replica."""
        return await self.store.read_notices(
            node_id, after_seq, self.settings.notice_batch, block_ms
        )

    async def read_notice_rows(
        self, node_id: str, after_seq: int, block_ms: int
    ) -> list[NoticeRow]:
        """:meth:`read_notices` as the rows the node's agent stream relays (read by the store
        without the Notice models in between: the relay runs for every grant; the transport
        encodes them). Counts the EXPIRE notices in it: each node's notices are relayed by the
        one replica holding its agent's stream, so the replicas' counts add up to the fleet's
        expiries."""
        rows = await self.store.read_notice_rows(
            node_id, after_seq, self.settings.notice_batch, block_ms
        )
        expired = sum(1 for row in rows if row.kind is NoticeKind.EXPIRE)
        if expired:
            self.metrics.record_reservation_event("expire", expired)
        return rows

    # -- operators -------------------------------------------------------------------------------
    async def list_nodes(self, role: NodeRole | None = None, selector: str = "") -> list[NodeState]:
        wanted = Selector.parse(selector)
        nodes = await self._admin_call(self.store.list_nodes(self.clock.now_ms()))
        return [
            n
            for n in nodes
            if (role is None or n.info.role is role) and wanted.matches(n.info.labels)
        ]

    async def get_node(self, node_id: str) -> NodeDetail:
        check_node_id(node_id)
        now = self.clock.now_ms()
        state = await self._admin_call(self.store.get_node(node_id, now))
        reservations = await self._admin_call(self.store.list_reservations(node_id, now))
        leases = await self._admin_call(self.store.lease_history(node_id, 10))
        events = await self._admin_call(self.store.node_events(node_id, 20))
        step_model = await self._admin_call(self.store.step_model(node_id))
        return NodeDetail(
            state=state,
            reservations=tuple(reservations),
            recent_leases=tuple(leases),
            events=tuple(events),
            step_model=step_model,
        )

    async def list_reservations(self, node_id: str = "") -> list[Reservation]:
        if node_id:
            check_node_id(node_id)
        return await self._admin_call(
            self.store.list_reservations(node_id or None, self.clock.now_ms())
        )

    async def list_pools(self) -> list[PoolSnapshot]:
        return await self._admin_call(self.store.list_pools(self.clock.now_ms()))

    async def cordon(self, node_id: str, cordoned: bool, reason: str = "") -> NodeState:
        check_node_id(node_id)
        if len(reason) > 512:
            raise InvalidArgument("longer than 512 characters", field="reason")
        now = self.clock.now_ms()
        await self._admin_call(self.store.set_cordon(node_id, cordoned, reason, now))
        log.info("cordon", node_id=node_id, cordoned=cordoned, reason=reason)
        self.rooms.poke()
        return await self._admin_call(self.store.get_node(node_id, now))

    async def delete_node(self, node_id: str, force: bool = False) -> int:
        """Remove a node by hand; FailedPrecondition (field ``force``) while reservations count
        and ``force`` is false. Returns the reservations that still counted."""
        check_node_id(node_id)
        dropped = await self._admin_call(
            self.store.delete_node(node_id, force, self.clock.now_ms())
        )
        log.info("node.deleted", node_id=node_id, force=force, open_reservations=dropped)
        return dropped

    async def expire_nodes_forever(self, stop: asyncio.Event) -> None:
        """Every ``node_sweep_s``: delete the nodes not heard of for ``node_expiry_s`` (no
        lease, no pool load, no registration) and holding no counting reservation. Any
        replica may sweep; the store makes it idempotent. Errors are logged and retried."""
        idle_ms = int(self.settings.node_expiry_s * 1000)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.node_sweep_s):
                    await stop.wait()
                    return
            try:
                gone = await self.store.expire_nodes(idle_ms, self.clock.now_ms())
            except CrossflowError as exc:
                log.warning("node_expiry.failed", error=str(exc))
                continue
            if gone:
                log.info("node_expiry.deleted", nodes=gone[:20], count=len(gone))

    # -- helpers ---------------------------------------------------------------------------------
    async def _admin_call(self, call: Awaitable[T]) -> T:
        """A store call bounded by ``admin_timeout_ms``; StoreUnavailable when it overruns."""
        try:
            return await within(
                timed(self.metrics, "admin", call), self.settings.admin_timeout_ms / 1000.0
            )
        except TimeoutError:
            raise StoreUnavailable(
                f"store did not answer within {self.settings.admin_timeout_ms} ms"
            ) from None
