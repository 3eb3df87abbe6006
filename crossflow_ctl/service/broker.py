"""The broker's domain class: admission, reservations, lease ingest and the admin operations.

Given its store, clock and settings; knows nothing of gRPC (the servicers translate). Admission
fails closed: any store error or a store slower than ``policy.admit_timeout_ms`` answers NORMAL
with reason STORE_UNAVAILABLE or TIMEOUT, never an error (DESIGN.md §5.6).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import structlog

from crossflow_ctl.domain.admission import (
    Admission,
    AdmissionRequest,
    Decision,
    Plan,
    Reason,
    plan_admission,
)
from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.domain.errors import (
    CrossflowError,
    InvalidArgument,
    StaleLease,
    StoreUnavailable,
)
from crossflow_ctl.domain.models import (
    ID_PATTERN,
    MAX_ID_LEN,
    Frozen,
    Lease,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    StoredLease,
)
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.room import (
    RoomUpdate,
    RoomView,
    RoomWatchRequest,
    summarize_room,
    unknown_room,
)
from crossflow_ctl.domain.selectors import Selector
from crossflow_ctl.observability import BrokerMetrics, annotate_decision, annotate_node
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.service.room import RoomWatches
from crossflow_ctl.store.base import LeaseOutcome, NodeEvent, Store

log = structlog.get_logger()
T = TypeVar("T")

MAX_DEBIT_TRIES = 3
"""Ranked nodes tried when a concurrent Admit took the room between the read and the debit."""
MAX_RESERVATION_ID_LEN = 256
_ID_RE = re.compile(ID_PATTERN)


class NodeDetail(Frozen):
    """One node for ``crossflowctl get node``: state, open reservations, history, events."""

    state: NodeState
    reservations: tuple[Reservation, ...] = ()
    recent_leases: tuple[StoredLease, ...] = ()
    events: tuple[NodeEvent, ...] = ()


def check_node_id(node_id: str, field: str = "node_id") -> str:
    if not node_id:
        raise InvalidArgument("must not be empty", field=field)
    if len(node_id) > MAX_ID_LEN:
        raise InvalidArgument(f"longer than {MAX_ID_LEN} characters", field=field)
    if not _ID_RE.match(node_id):
        raise InvalidArgument(f"must match {ID_PATTERN}", field=field)
    return node_id


def check_reservation_id(reservation_id: str) -> str:
    if not reservation_id:
        raise InvalidArgument("must not be empty", field="reservation_id")
    if len(reservation_id) > MAX_RESERVATION_ID_LEN:
        raise InvalidArgument(
            f"longer than {MAX_RESERVATION_ID_LEN} characters", field="reservation_id"
        )
    return reservation_id


class Broker:
    """One replica's view of the control plane; all shared state lives in the store."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        settings: BrokerSettings,
        broker_id: str = "",
        metrics: BrokerMetrics | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.settings = settings
        self.metrics = metrics or BrokerMetrics.noop()
        self._zero_reasons: dict[str, str] = {}
        """Last zero-lease reason per node ("" once it lends again), for state-change logs."""
        self.broker_id = broker_id or settings.broker_id or "broker"
        self._policy = settings.policy
        self.shadow_decisions: dict[Decision, int] = {Decision.BORROW: 0, Decision.NORMAL: 0}
        """Count of decisions made in shadow mode, by what they would have been."""
        self.rooms = RoomWatches(settings.room, clock, self.room_view)
        """This replica's WatchRoom subscriptions (late binding)."""

    # -- policy, shared through the store and cached briefly -----------------------------------
    @property
    def policy(self) -> PolicySettings:
        return self._policy

    async def load_policy(self) -> PolicySettings:
        """Adopt the store's policy, seeding it with the configured one when it holds none."""
        stored = await self._admin_call(self.store.get_policy())
        if stored is None:
            await self._admin_call(self.store.set_policy(self.settings.policy))
            stored = self.settings.policy
        self._policy = stored
        return stored

    async def refresh_policy_forever(self, stop: asyncio.Event) -> None:
        """Re-read the shared policy every ``policy_refresh_ms`` until ``stop`` is set."""
        interval = self.settings.policy_refresh_ms / 1000.0
        while not stop.is_set():
            try:
                await self.load_policy()
            except CrossflowError as exc:
                log.warning("policy.refresh_failed", error=str(exc))
            try:
                async with asyncio.timeout(interval):
                    await stop.wait()
            except TimeoutError:
                pass

    async def get_policy(self) -> PolicySettings:
        return await self.load_policy()

    async def set_policy(self, updates: dict[str, Any]) -> PolicySettings:
        if not updates:
            raise InvalidArgument("no updates given", field="updates")
        current = await self.load_policy()
        new = current.updated(updates)
        await self._admin_call(self.store.set_policy(new))
        self._policy = new
        log.info("policy.set", updates=sorted(updates))
        return new

    # -- admission -------------------------------------------------------------------------------
    async def admit(self, request: AdmissionRequest, owner: str = "") -> Admission:
        """Always answers; NORMAL with a reason on any doubt (§5.6). Counted, timed, logged.

        A granted reservation records ``owner`` (the router's identity, "" without
        authentication): only it, or an admin, may commit or release it."""
        started = time.perf_counter()
        answer = await self._decide(request, owner)
        shadow = answer.shadow_decision if answer.reason is Reason.SHADOW_MODE else None
        self.metrics.record_admission(
            answer.decision, answer.reason, time.perf_counter() - started, shadow_decision=shadow
        )
        annotate_decision(answer.decision, answer.reason, answer.node_id)
        log.debug(
            "admit.decided",
            request_id=request.request_id,
            decision=answer.decision.value,
            reason=answer.reason.value,
            node_id=answer.node_id,
        )
        return answer

    async def _decide(self, request: AdmissionRequest, owner: str) -> Admission:
        policy = self._policy
        with structlog.contextvars.bound_contextvars(request_id=request.request_id):
            if not policy.enabled:
                return Admission.normal(Reason.BORROWING_DISABLED, "borrowing is disabled")
            try:
                async with asyncio.timeout(policy.admit_timeout_ms / 1000.0):
                    return await self._admit(request, policy, owner)
            except TimeoutError:
                log.warning("admit.timeout", timeout_ms=policy.admit_timeout_ms)
                return Admission.normal(
                    Reason.TIMEOUT, f"store slower than {policy.admit_timeout_ms} ms"
                )
            except StoreUnavailable as exc:
                log.warning("admit.store_unavailable", error=str(exc))
                return Admission.normal(Reason.STORE_UNAVAILABLE, f"store unavailable: {exc}")
            except Exception as exc:  # fail closed on anything unforeseen, never raise
                log.exception("admit.failed")
                return Admission.normal(Reason.STORE_UNAVAILABLE, f"admission failed: {exc!r}")

    async def _admit(
        self, request: AdmissionRequest, policy: PolicySettings, owner: str
    ) -> Admission:
        now = self.clock.now_ms()
        pool, nodes = await self._timed(
            "admission_view",
            self.store.admission_view(
                request.pool, request.candidate_node_ids, policy.candidate_sample, now
            ),
        )
        plan = plan_admission(request, pool, nodes, policy, now)
        if policy.shadow_mode:
            return self._shadow(plan)
        if plan.reason is not Reason.BORROWED:
            return Admission.normal(plan.reason, plan.summary(), plan)
        if request.dry_run:
            best = plan.ranked[0]
            return Admission(
                decision=Decision.NORMAL,
                reason=Reason.DRY_RUN,
                message=f"dry run: {plan.summary()}",
                node_id=best.node_id,
                lease_epoch=best.lease_epoch,
                lease_version=best.lease_version,
                predicted_ttft_ms=best.predicted_ttft_ms,
                normal_ttft_ms=plan.normal_path.total_ms if plan.normal_path else 0.0,
                plan=plan,
                shadow_decision=Decision.BORROW,
            )
        return await self._debit(request, plan, policy, now, owner)

    def _shadow(self, plan: Plan) -> Admission:
        would = Decision.BORROW if plan.reason is Reason.BORROWED else Decision.NORMAL
        self.shadow_decisions[would] += 1
        best = plan.ranked[0].node_id if plan.ranked else ""
        log.info("admit.shadow", would=would.value, plan_reason=plan.reason.value, node_id=best)
        answer = Admission.normal(Reason.SHADOW_MODE, f"shadow mode: {plan.summary()}", plan)
        return answer.model_copy(update={"shadow_decision": would})

    async def _debit(
        self, request: AdmissionRequest, plan: Plan, policy: PolicySettings, now: int, owner: str
    ) -> Admission:
        refusals: list[str] = []
        normal_ms = plan.normal_path.total_ms if plan.normal_path else 0.0
        for check in plan.ranked[:MAX_DEBIT_TRIES]:
            outcome = await self._timed(
                "debit",
                self.store.try_debit(
                    check.node_id,
                    check.debit,
                    policy.borrow_share,
                    now,
                    policy.hold_ttl_ms,
                    request.request_id,
                    owner,
                ),
            )
            if outcome.granted and outcome.reservation is not None:
                res = outcome.reservation
                log.debug("admit.borrow", node_id=check.node_id, reservation_id=res.reservation_id)
                return Admission(
                    decision=Decision.BORROW,
                    reason=Reason.BORROWED,
                    message=plan.summary(),
                    node_id=check.node_id,
                    reservation_id=res.reservation_id,
                    lease_epoch=outcome.lease_epoch,
                    lease_version=outcome.lease_version,
                    expires_at_ms=res.expires_at_ms,
                    predicted_ttft_ms=check.predicted_ttft_ms,
                    normal_ttft_ms=normal_ms,
                    plan=plan,
                )
            refusals.append(f"{check.node_id}: {outcome.refusal}")
        return Admission.normal(
            Reason.NO_ROOM,
            "room taken by concurrent admissions (" + "; ".join(refusals) + ")",
            plan,
        )

    # -- late binding ----------------------------------------------------------------------------
    async def room_view(self, request: RoomWatchRequest) -> RoomView:
        """The room for ``request`` now, from the store; UNKNOWN (no room) on any doubt."""
        policy, now, limit_ms = self._policy, self.clock.now_ms(), self.settings.admin_timeout_ms
        view = self.store.admission_view(
            request.pool, request.candidate_node_ids, self.settings.room.max_nodes, now
        )
        try:
            async with asyncio.timeout(limit_ms / 1000.0):
                pool, nodes = await self._timed("room_view", view)
        except Exception as exc:  # fail closed on a store error, overrun or anything unforeseen
            detail = f"store slower than {limit_ms} ms" if isinstance(exc, TimeoutError) else exc
            log.warning("room_view.failed", error=repr(exc))
            return unknown_room(request.pool, f"room unknown: {detail}")
        return summarize_room(request.pool, pool, nodes, policy, now)

    def watch_room(self, request: RoomWatchRequest) -> AsyncIterator[RoomUpdate]:
        """Room updates for ``request`` (see :mod:`crossflow_ctl.service.room`)."""
        return self.rooms.watch(request)

    async def commit(self, reservation_id: str, owner: str | None = None) -> Reservation:
        """Commit; with ``owner`` (a router's identity) only a reservation it was granted."""
        check_reservation_id(reservation_id)
        now, ttl = self.clock.now_ms(), self._policy.commit_ttl_ms
        res = await self._admin_call(self.store.commit(reservation_id, now, ttl, owner))
        self.metrics.record_reservation_event("commit")
        annotate_node(res.node_id)
        return res

    async def release(
        self, reservation_id: str, outcome: str = "", owner: str | None = None
    ) -> Reservation:
        """Release; with ``owner`` (a router's identity) only a reservation it was granted."""
        check_reservation_id(reservation_id)
        now = self.clock.now_ms()
        res = await self._admin_call(self.store.release(reservation_id, now, owner))
        log.debug("release", reservation_id=reservation_id, node_id=res.node_id, outcome=outcome)
        self.metrics.record_reservation_event("release")
        annotate_node(res.node_id)
        self.rooms.poke()
        return res

    # -- agents ----------------------------------------------------------------------------------
    async def register(
        self, node_id: str, role: NodeRole, pool: str, labels: dict[str, str]
    ) -> NodeInfo:
        check_node_id(node_id, "hello.node_id")
        check_node_id(pool, "hello.pool")
        return await self._admin_call(
            self.store.register_node(node_id, role, pool, labels, self.clock.now_ms())
        )

    async def ingest_lease(self, lease: Lease) -> LeaseOutcome:
        """Store a newer lease; StaleLease (changing nothing) when it is not newer (§5.1)."""
        outcome = await self._admin_call(
            self.store.upsert_lease(lease, self.clock.now_ms(), self._policy.max_lease_ttl_ms)
        )
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

    async def ingest_pool_load(self, load: PoolLoad) -> None:
        await self._admin_call(
            self.store.put_pool_load(load, self.clock.now_ms(), self._policy.max_lease_ttl_ms)
        )

    async def read_notices(self, node_id: str, after_seq: int, block_ms: int) -> list[Notice]:
        """The node's notices after ``after_seq``; waits in the store up to ``block_ms``."""
        limit = self.settings.notice_batch
        deadline = (block_ms + self.settings.admin_timeout_ms) / 1000.0
        try:
            async with asyncio.timeout(deadline):
                return await self.store.read_notices(node_id, after_seq, limit, block_ms)
        except TimeoutError:
            raise StoreUnavailable("store did not answer a notice read in time") from None

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
        return NodeDetail(
            state=state,
            reservations=tuple(reservations),
            recent_leases=tuple(leases),
            events=tuple(events),
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

    # -- helpers ---------------------------------------------------------------------------------
    async def _timed(self, operation: str, call: Awaitable[T]) -> T:
        """A store call with its latency (and failure) recorded under ``operation``."""
        started = time.perf_counter()
        try:
            result = await call
        except BaseException:
            self.metrics.record_store_operation(operation, time.perf_counter() - started, ok=False)
            raise
        self.metrics.record_store_operation(operation, time.perf_counter() - started)
        return result

    async def _admin_call(self, call: Awaitable[T]) -> T:
        """A store call bounded by ``admin_timeout_ms``; StoreUnavailable when it overruns."""
        try:
            async with asyncio.timeout(self.settings.admin_timeout_ms / 1000.0):
                return await self._timed("admin", call)
        except TimeoutError:
            raise StoreUnavailable(
                f"store did not answer within {self.settings.admin_timeout_ms} ms"
            ) from None
