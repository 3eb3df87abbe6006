"""Admission (DESIGN.md §4) for one request or a batch of them, failing closed (§5.6).

Each request is planned on the store's admission view (on Redis, the replica's short-lived
cached view: no round trip when warm; read once per pool and candidate list in a batch), then
its first-ranked node is debited by ONE atomic store operation that re-checks Safety against the
live lease and open debits. A refused debit (a concurrent admission took the room, or the lease
changed) moves on to the next ranked node, at most ``MAX_DEBIT_TRIES`` times. A batch
(``AdmitStream``) sends each round's debits together (one pipeline on Redis, each script atomic
on its own node), so N requests cost about one round trip, not N.

Any store error or a store slower than ``policy.admit_timeout_ms`` answers NORMAL with reason
STORE_UNAVAILABLE or TIMEOUT for every request of the batch, never an error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import structlog

from crossflow_ctl.aio import within
from crossflow_ctl.domain.admission import (
    Admission,
    AdmissionRequest,
    Decision,
    DemandCheck,
    NodeCheck,
    Plan,
    Reason,
    check_demand,
    plan_admission,
)
from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import NodeState, PoolSnapshot
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.observability import BrokerMetrics, annotate_decision
from crossflow_ctl.store.base import DebitOutcome, DebitRequest, Store

log = structlog.get_logger()
T = TypeVar("T")

_View = tuple[PoolSnapshot | None, list[NodeState], DemandCheck]

MAX_DEBIT_TRIES = 3
"""Ranked nodes tried when a concurrent Admit took the room between the plan and the debit."""


async def timed(metrics: BrokerMetrics, operation: str, call: Awaitable[T]) -> T:
    """A store call with its latency (and failure) recorded under ``operation``."""
    started = time.perf_counter()
    try:
        result = await call
    except BaseException:
        metrics.record_store_operation(operation, time.perf_counter() - started, ok=False)
        raise
    metrics.record_store_operation(operation, time.perf_counter() - started)
    return result


class Admitter:
    """Decides admissions for one replica; ``policy`` returns the replica's current policy."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        metrics: BrokerMetrics,
        policy: Callable[[], PolicySettings],
        abandoned: Callable[[asyncio.Future[list[DebitOutcome]]], None] = lambda _: None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self._policy = policy
        self._abandoned = abandoned
        """Called with debits an Admit stopped waiting for (timeout): they may still land."""
        self.shadow_decisions: dict[Decision, int] = {Decision.BORROW: 0, Decision.NORMAL: 0}
        """Count of decisions made in shadow mode, by what they would have been."""

    async def admit_many(
        self, requests: Sequence[AdmissionRequest], owner: str = ""
    ) -> list[Admission]:
        """One answer per request, in order; always answers (NORMAL on any doubt). Granted
        reservations record ``owner`` (the router's identity, "" without authentication)."""
        if not requests:
            return []
        started = time.perf_counter()
        if len(requests) == 1:
            with structlog.contextvars.bound_contextvars(request_id=requests[0].request_id):
                answers = await self._decide(requests, owner)
        else:
            answers = await self._decide(requests, owner)
        elapsed = time.perf_counter() - started
        for request, answer in zip(requests, answers, strict=True):
            shadow = answer.shadow_decision if answer.reason is Reason.SHADOW_MODE else None
            self.metrics.record_admission(
                answer.decision, answer.reason, elapsed, shadow_decision=shadow
            )
            log.debug(
                "admit.decided",
                request_id=request.request_id,
                decision=answer.decision.value,
                reason=answer.reason.value,
                node_id=answer.node_id,
            )
        if len(answers) == 1:
            annotate_decision(answers[0].decision, answers[0].reason, answers[0].node_id)
        return answers

    async def _decide(self, requests: Sequence[AdmissionRequest], owner: str) -> list[Admission]:
        policy = self._policy()
        count = len(requests)
        if not policy.enabled:
            return [Admission.normal(Reason.BORROWING_DISABLED, "borrowing is disabled")] * count
        try:
            return await within(
                self._admit(requests, policy, owner), policy.admit_timeout_ms / 1000.0
            )
        except TimeoutError:
            log.warning("admit.timeout", timeout_ms=policy.admit_timeout_ms, requests=count)
            answer = Admission.normal(
                Reason.TIMEOUT, f"store slower than {policy.admit_timeout_ms} ms"
            )
        except StoreUnavailable as exc:
            log.warning("admit.store_unavailable", error=str(exc), requests=count)
            answer = Admission.normal(Reason.STORE_UNAVAILABLE, f"store unavailable: {exc}")
        except Exception as exc:  # fail closed on anything unforeseen, never raise
            log.exception("admit.failed", requests=count)
            answer = Admission.normal(Reason.STORE_UNAVAILABLE, f"admission failed: {exc!r}")
        return [answer] * count

    async def _admit(
        self, requests: Sequence[AdmissionRequest], policy: PolicySettings, owner: str
    ) -> list[Admission]:
        now = self.clock.now_ms()
        answers: list[Admission | None] = [None] * len(requests)
        pending: list[tuple[int, Plan]] = []
        views: dict[tuple[str, tuple[str, ...]], _View] = {}
        for i, request in enumerate(requests):
            key = (request.pool, request.candidate_node_ids)  # one view per kind in a batch
            if key not in views:
                pool, nodes = await timed(
                    self.metrics,
                    "admission_view",
                    self.store.admission_view(
                        request.pool, request.candidate_node_ids, policy.candidate_sample, now
                    ),
                )
                views[key] = (pool, nodes, check_demand(pool, policy))
            pool, nodes, demand = views[key]
            plan = plan_admission(request, pool, nodes, policy, now, demand)
            answer = self._without_debit(request, plan, policy)
            if answer is None:
                pending.append((i, plan))
            else:
                answers[i] = answer
        refusals: dict[int, list[str]] = {i: [] for i, _ in pending}
        for attempt in range(MAX_DEBIT_TRIES):
            tries = [
                (i, plan, plan.ranked[attempt]) for i, plan in pending if attempt < len(plan.ranked)
            ]
            if not tries:
                break
            outcomes = await self._shielded(
                timed(
                    self.metrics,
                    "debit",
                    self.store.try_debits(
                        [
                            DebitRequest(c.node_id, c.debit, requests[i].request_id, owner)
                            for i, _, c in tries
                        ],
                        policy.borrow_share,
                        now,
                        policy.hold_ttl_ms,
                    ),
                )
            )
            for (i, plan, check), outcome in zip(tries, outcomes, strict=True):
                if outcome.granted:
                    answers[i] = _borrowed(plan, check, outcome)
                else:
                    refusals[i].append(f"{check.node_id}: {outcome.refusal}")
            pending = [(i, plan) for i, plan in pending if answers[i] is None]
        for i, plan in pending:
            answers[i] = Admission.normal(
                Reason.NO_ROOM,
                "room taken by concurrent admissions (" + "; ".join(refusals[i]) + ")",
                plan,
            )
        return [a for a in answers if a is not None]

    async def _shielded(self, call: Awaitable[list[DebitOutcome]]) -> list[DebitOutcome]:
        """``call`` shielded: when admission times out, debits may still land in the store;
        they are then waited for and released, never left for nobody (phantom holds)."""
        debits = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(debits)
        except asyncio.CancelledError:
            debits.add_done_callback(self._abandoned)
            raise

    def _without_debit(
        self, request: AdmissionRequest, plan: Plan, policy: PolicySettings
    ) -> Admission | None:
        """The answer when no debit is due (shadow mode, no borrow, dry run); None otherwise."""
        if policy.shadow_mode:
            return self._shadow(plan)
        if plan.reason is not Reason.BORROWED:
            return Admission.normal(plan.reason, plan.summary(), plan)
        if not request.dry_run:
            return None
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

    def _shadow(self, plan: Plan) -> Admission:
        would = Decision.BORROW if plan.reason is Reason.BORROWED else Decision.NORMAL
        self.shadow_decisions[would] += 1
        best = plan.ranked[0].node_id if plan.ranked else ""
        log.info("admit.shadow", would=would.value, plan_reason=plan.reason.value, node_id=best)
        answer = Admission.normal(Reason.SHADOW_MODE, f"shadow mode: {plan.summary()}", plan)
        return answer.model_copy(update={"shadow_decision": would})


def _borrowed(plan: Plan, check: NodeCheck, outcome: DebitOutcome) -> Admission:
    res = outcome.reservation
    assert res is not None  # a granted outcome carries its reservation
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
        normal_ttft_ms=plan.normal_path.total_ms if plan.normal_path else 0.0,
        plan=plan,
    )
