"""Admission (DESIGN.md §4) for one request or a batch of them, failing closed (§5.6).

Each request is planned on the store's admission view (on Redis, the replica's short-lived
cached view: no round trip when warm; read once per pool and candidate list in a batch), then
its first-ranked node is debited by ONE atomic store operation that re-checks Safety against the
live lease and open debits. A refused debit (a concurrent admission took the room, or the lease
changed) moves on to the next ranked node, at most ``MAX_DEBIT_TRIES`` times. A batch
(``AdmitStream``) sends each round's debits together (one pipeline on Redis, each script atomic
on its own node), so N requests cost about one round trip, not N.

Any store error or a store slower than ``policy.admit_timeout_ms`` answers NORMAL with reason
STORE_UNAVAILABLE or TIMEOUT for every request of the batch, never an error. After several such
batches in a row, the replica's circuit breaker (:mod:`.store_breaker`) answers NORMAL
(STORE_UNAVAILABLE) at once, without calling the store, until a probe finds it answering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from crossflow_ctl.aio import detached_task, wait_settled, within
from crossflow_ctl.domain.admission import (
    Admission,
    AdmissionRequest,
    Decision,
    DemandCheck,
    NodeCheck,
    Plan,
    Reason,
    Room,
    check_demand,
    node_rooms,
    plan_admission,
    pool_prefill_rate,
    pulled_tokens,
    target_demand,
)
from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import NodeState, PoolSnapshot, Share
from crossflow_ctl.domain.pending import Unreported
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.observability import BrokerMetrics, annotate_decision
from crossflow_ctl.service.config import StoreBreakerSettings
from crossflow_ctl.service.pending import SentToPools, sent_to_pool
from crossflow_ctl.service.requests import admit_record, borrow_record, replay_admission
from crossflow_ctl.service.store_breaker import StoreBreaker
from crossflow_ctl.store.base import (
    REPLY_LOST,
    DebitOutcome,
    DebitRequest,
    RequestRecord,
    Store,
)

log = structlog.get_logger()
T = TypeVar("T")

AdmissionView = tuple[PoolSnapshot | None, list[NodeState], tuple[Room | None, ...], float]
"""A batch's view of one pool and candidate list: the pool, the nodes, their rooms and the
pool's per-request prefill rate (each computed once for every request planned on it)."""

MAX_DEBIT_TRIES = 3
"""Ranked nodes tried when a concurrent Admit took the room between the plan and the debit."""
MAX_BATCH = 256
"""Requests decided together by one group commit: planning them (CPU) stays well inside the
policy's ``admit_timeout_ms``, and one round trip serves them all."""


def log_decisions() -> bool:
    """Whether per-decision debug lines are logged (checked once per call, not per line)."""
    enabled = getattr(structlog.get_config()["wrapper_class"], "is_enabled_for", None)
    return enabled is None or bool(enabled(None, logging.DEBUG))  # a filtering logger class


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


TIMED_OUT = "admission timed out"
CALLER_GONE = "the caller stopped waiting"


@dataclass(slots=True)
class _Fate:
    """What becomes of a batch's grants should it answer none of them: its debit rounds'
    grants so far (released then) and why it stopped waiting, named by
    :meth:`Admitter._decide` as the batch ends. A debit round that lands after that (a store
    hands it over on a later event-loop turn than the cancel) reads ``why`` then."""

    granted: list[DebitOutcome] = field(default_factory=list)
    why: str = CALLER_GONE


@dataclass(slots=True)
class _Queued:
    """Requests waiting for the next group commit, answered together through ``answers``."""

    requests: Sequence[AdmissionRequest]
    owner: str
    answers: asyncio.Future[list[Admission]]
    arrived_s: float
    """Loop time of arrival: its deadline is this plus the policy's ``admit_timeout_ms``."""


class Admitter:
    """Decides admissions for one replica; ``policy`` returns the replica's current policy.

    Group commit: requests that arrive while a batch is being decided (or in the same event-loop
    turn as the first) queue, and the next batch takes all of them, up to ``MAX_BATCH``
    requests: one view, one plan each, and one store call per round for all their debits, each
    request keeping its own answer, order and Safety re-check (the debit script checks each
    debit after the ones before it). Each request is answered by its own deadline
    (arrival + ``admit_timeout_ms``): a batch is bounded by the earliest deadline in it."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        metrics: BrokerMetrics,
        policy: Callable[[], PolicySettings],
        abandoned: Callable[[list[DebitOutcome], str], None] = lambda _outcomes, _why: None,
        release_late: Callable[[str, str, str], None] = lambda _rid, _why, _key: None,
        sequential: bool = False,
        breaker: StoreBreaker | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self._policy = policy
        self._abandoned = abandoned
        """Called with the outcomes of debits no caller hears of (their Admit stopped waiting:
        its deadline, or its caller gone; or its batch failed) once they land, and why."""
        self._release_late = release_late
        """Releases a reservation granted to a caller that stopped waiting (cancelled), and
        deletes the request record written with it (key; "" when none)."""
        self._queue: list[_Queued] = []
        self._flusher: asyncio.Task[None] | None = None
        self._leading = False
        """Whether a lone entry is being decided in its caller's task (:meth:`_lead`)."""
        self._sequential = sequential
        """Admits come one at a time from one in-process caller (the simulator): a lone one is
        decided at once, not after an event-loop turn for others to join it (none would)."""
        self.sent = SentToPools()
        """Prompts this replica sent to the prefill pools, counted into Demand's wait (and the
        room watches' Demand: :meth:`Broker.room_view`)."""
        self._last_demand: _DemandMemo | None = None
        self._last_rooms: tuple[Share, dict[int, tuple[NodeState, Room | None]]] | None = None
        self.shadow_decisions: dict[Decision, int] = {Decision.BORROW: 0, Decision.NORMAL: 0}
        """Count of decisions made in shadow mode, by what they would have been."""
        self.breaker = breaker or StoreBreaker(store, clock, StoreBreakerSettings(), metrics)
        """Answers at once, without the store, after consecutive store failures."""

    async def admit(
        self, request: AdmissionRequest, owner: str = "", join: bool = True
    ) -> Admission:
        """One answer; always answers (NORMAL on any doubt). A granted reservation records
        ``owner`` (the router's identity, "" without authentication). ``join``: see
        :meth:`admit_many`."""
        return (await self.admit_many((request,), owner, join))[0]

    async def admit_many(
        self, requests: Sequence[AdmissionRequest], owner: str = "", join: bool = True
    ) -> list[Admission]:
        """One answer per request, in order, decided with whatever else is queued (class
        docstring); always answers (NORMAL on any doubt).

        ``join=False``: a lone request is decided at once (:meth:`_decide_now`), without the
        event-loop turn in which requests started in the same turn would join it: for a caller
        that never has such company. A gRPC unary Admit has none: grpc.aio starts each RPC's
        handler from a completion event of its own, turns apart (measured under 32 concurrent
        callers: 1 lone Admit in 551 found another joined after its turn), so that turn only
        cost it a loop iteration; those arriving while it is decided still queue and go
        together next."""
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        alone = self._flusher is None and not self._leading and len(requests) == 1
        if not self.breaker.allows:  # the store is failing: answered at once, not queued
            answers = self.breaker.refused(len(requests))
            self._count(answers, 0.0)
        elif alone and (self._sequential or not join):
            answers = await self._decide_now(requests, owner, loop.time())
        else:
            queued = _Queued(requests, owner, loop.create_future(), loop.time())
            self._queue.append(queued)
            if alone:
                answers = await self._lead(queued)
            else:
                self._start_flusher()
                answers = await queued.answers
        if log_decisions():
            for request, answer in zip(requests, answers, strict=True):
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

    async def _decide_now(
        self, requests: Sequence[AdmissionRequest], owner: str, arrived_s: float
    ) -> list[Admission]:
        """Answers for one request of a ``sequential`` caller, or of one that does not wait for
        others to join it (``join=False``), while nothing else is being decided: decided at
        once, in its caller's task, without a queue entry or an event-loop turn (no other
        request would join it). Otherwise as :meth:`_lead`: entries that arrive
        meanwhile (a store call that suspends) queue, and the flusher starts for them when it
        is done; a caller cancelled before its grant leaves its debit to :meth:`_debit`'s
        hand-over."""
        self._leading = True
        try:
            policy = self._policy()
            deadline = arrived_s + policy.admit_timeout_ms / 1000.0
            answers = await self._decide(requests, (owner,), policy, deadline)
            self._count(answers, asyncio.get_running_loop().time() - arrived_s)
            return answers
        finally:
            self._leading = False
            self._start_flusher()

    async def _lead(self, queued: _Queued) -> list[Admission]:
        """Answers for ``queued``, one request and the first entry while no batch is being
        decided: after one event-loop turn (so requests arriving in the same turn join it), an
        entry still alone is decided here, in its caller's task (no flusher task, no hand-off
        of the answer); otherwise the flusher takes the queue as usual. Entries that arrive
        while it is decided here queue, and the flusher starts for them when it is done.

        One request only: its grant is the last step of deciding it, so a caller cancelled
        before then leaves its debit to :meth:`_debit`'s hand-over (released once it lands).
        A batch can hold grants from one debit round while a later round waits; cancelled
        there, only the flusher (which the caller's cancel does not reach) still releases
        them."""
        self._leading = True
        try:
            await asyncio.sleep(0)
            if len(self._queue) == 1 and self._queue[0] is queued:
                self._queue.clear()
                return (await self._decide_queued([queued]))[0]
        except asyncio.CancelledError:
            self._queue = [q for q in self._queue if q is not queued]
            raise
        finally:
            self._leading = False
            self._start_flusher()
        return await queued.answers

    async def settle(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the batches being decided (at shutdown: their callers
        may be gone, RPCs cut at the server's grace, and only the flusher releases what such a
        batch granted, :meth:`_deliver`), so their grants reach a caller or a release before the
        store settles and closes."""
        await wait_settled(lambda: () if self._flusher is None else (self._flusher,), timeout_s)

    def _start_flusher(self) -> None:
        """Start deciding the queue in a task of its own, unless it is empty or a flusher or a
        lone Admit (:meth:`_lead`, which starts one when it is done) is already deciding."""
        if self._queue and self._flusher is None and not self._leading:
            self._flusher = detached_task(self._flush(), name="admission-group-commit")

    async def _flush(self) -> None:
        """Decide the queue batch by batch until it is empty (the next arrival starts a new
        flusher). Should deciding itself fail (cancelled at shutdown), every caller still
        waiting gets that error rather than waiting forever."""
        batch: list[_Queued] = []
        try:
            while self._queue:
                batch = self._take()
                answers = await self._decide_queued(batch)
                for queued, answer in zip(batch, answers, strict=True):
                    self._deliver(queued, answer)
        except BaseException as exc:
            waiting, self._queue = [*batch, *self._queue], []
            for queued in waiting:
                if not queued.answers.done():
                    if isinstance(exc, asyncio.CancelledError):
                        queued.answers.cancel()
                    else:
                        queued.answers.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._flusher = None

    def _take(self) -> list[_Queued]:
        """The next batch: queued entries in arrival order, up to ``MAX_BATCH`` requests (an
        entry is never split; the first is taken whatever its size)."""
        count, taken = 0, 0
        for queued in self._queue:
            if taken and count + len(queued.requests) > MAX_BATCH:
                break
            count += len(queued.requests)
            taken += 1
        batch, self._queue = self._queue[:taken], self._queue[taken:]
        return batch

    def _deliver(self, queued: _Queued, answers: list[Admission]) -> None:
        if not queued.answers.done():
            queued.answers.set_result(answers)
            return
        policy = self._policy()
        for request, answer in zip(queued.requests, answers, strict=True):
            # The caller went away (cancelled): release what it was granted (not a replay).
            if answer.decision is Decision.BORROW and answer.reservation_id and not answer.replayed:
                record = admit_record(self.store, request, policy)
                key = record[0] if record is not None else ""
                self._release_late(answer.reservation_id, CALLER_GONE, key)

    async def _decide_queued(self, batch: Sequence[_Queued]) -> list[list[Admission]]:
        """Answers per queued entry, the batch decided together."""
        requests = [r for queued in batch for r in queued.requests]
        owners = [queued.owner for queued in batch for _ in queued.requests]
        policy = self._policy()
        timeout_s = policy.admit_timeout_ms / 1000.0
        deadline = min(queued.arrived_s for queued in batch) + timeout_s
        flat = await self._decide(requests, owners, policy, deadline)
        loop_now = asyncio.get_running_loop().time()
        out: list[list[Admission]] = []
        start = 0
        for queued in batch:
            answers = flat[start : start + len(queued.requests)]
            start += len(queued.requests)
            self._count(answers, loop_now - queued.arrived_s)
            out.append(answers)
        return out

    def _count(self, answers: Sequence[Admission], elapsed_s: float) -> None:
        """Record ``answers``, decided ``elapsed_s`` after their request arrived."""
        for answer in answers:
            shadow = answer.shadow_decision if answer.reason is Reason.SHADOW_MODE else None
            self.metrics.record_admission(
                answer.decision, answer.reason, elapsed_s, shadow_decision=shadow
            )

    async def _decide(
        self,
        requests: Sequence[AdmissionRequest],
        owners: Sequence[str],
        policy: PolicySettings,
        deadline: float,
    ) -> list[Admission]:
        count = len(requests)
        if not policy.enabled:
            return [Admission.normal(Reason.BORROWING_DISABLED, "borrowing is disabled")] * count
        if not self.breaker.allows:  # opened while this batch was queued
            return self.breaker.refused(count)
        fate = _Fate()
        try:
            left_s = deadline - asyncio.get_running_loop().time()
            return await within(self._admit(requests, owners, policy, fate), left_s)
        except TimeoutError:
            fate.why = TIMED_OUT
            log.warning("admit.timeout", timeout_ms=policy.admit_timeout_ms, requests=count)
            answer = Admission.normal(
                Reason.TIMEOUT, f"store slower than {policy.admit_timeout_ms} ms"
            )
            self.breaker.failed(answer.message)
        except StoreUnavailable as exc:
            fate.why = f"a later debit round failed: {exc}"
            log.warning("admit.store_unavailable", error=str(exc), requests=count)
            answer = Admission.normal(Reason.STORE_UNAVAILABLE, f"store unavailable: {exc}")
            self.breaker.failed(answer.message)
        except Exception as exc:  # fail closed on anything unforeseen, never raise
            fate.why = f"admission failed: {exc!r}"
            log.exception("admit.failed", requests=count)
            answer = Admission.normal(Reason.STORE_UNAVAILABLE, f"admission failed: {exc!r}")
        except BaseException:  # cancelled: the earlier rounds' grants reach no caller either
            self._abandon(fate)
            raise
        self._abandon(fate)
        return [answer] * count

    def _abandon(self, fate: _Fate) -> None:
        """Release the grants of a batch that answers none of them (a later round failed or ran
        past the deadline, or the caller left: they held room until their hold TTL)."""
        if fate.granted:
            self._abandoned(fate.granted, fate.why)

    async def _admit(
        self,
        requests: Sequence[AdmissionRequest],
        owners: Sequence[str],
        policy: PolicySettings,
        fate: _Fate,
    ) -> list[Admission]:
        now = self.clock.now_ms()
        answers: list[Admission | None] = [None] * len(requests)
        pending: list[tuple[int, Plan]] = []
        views: dict[tuple[str, tuple[str, ...]], AdmissionView] = {}
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
                views[key] = self.view_of(pool, nodes, policy)
            plan, answer = self.plan(request, policy, now, views[key])
            if answer is None:
                pending.append((i, plan))
            else:
                answers[i] = answer
        await self._debit_rounds(requests, owners, policy, now, pending, answers, fate)
        return [a for a in answers if a is not None]

    def view_of(
        self, pool: PoolSnapshot | None, nodes: list[NodeState], policy: PolicySettings
    ) -> AdmissionView:
        """An admission view read from the store, with its nodes' rooms and the pool's
        per-request prefill rate (computed once for every request planned on it)."""
        return (pool, nodes, self._rooms(nodes, policy.shares), pool_prefill_rate(pool))

    def plan(
        self, request: AdmissionRequest, policy: PolicySettings, now: int, view: AdmissionView
    ) -> tuple[Plan, Admission | None]:
        """``request``'s plan on ``view`` (Demand, Benefit, Safety: ``plan_admission``), and
        its answer when no debit is due (None: debit ``plan.ranked`` in order). A prompt this
        answers to the prefill pool is counted as sent (later requests see it). The one
        planning step of every Admit, here and in the simulator's direct path."""
        pool, nodes, rooms, rate = view
        demand, unreported = self._demand(pool, policy, request, self._unreported(pool))
        plan = plan_admission(request, pool, nodes, policy, now, demand, rooms, unreported, rate)
        answer = self._without_debit(request, plan, policy)
        if answer is not None and sent_to_pool(request, answer):
            self.sent.record(request.pool, request.uncached_prompt_tokens, request.prefill_node_id)
        return plan, answer

    async def _debit_rounds(
        self,
        requests: Sequence[AdmissionRequest],
        owners: Sequence[str],
        policy: PolicySettings,
        now: int,
        pending: list[tuple[int, Plan]],
        answers: list[Admission | None],
        fate: _Fate,
    ) -> None:
        """Debit ``pending`` (index, plan) in rounds, each on the next ranked node of the
        requests still unanswered, and fill in their ``answers`` (NO_ROOM for those no round
        granted). Grants go to ``fate.granted`` too: should a later round fail or run past
        the deadline, the whole batch answers NORMAL and :meth:`_decide` releases them."""
        refusals: dict[int, list[str]] = {}
        records = (
            {i: admit_record(self.store, requests[i], policy) for i, _ in pending}
            if self.store.folds_request_records  # else none (``admit_record``)
            else {}
        )
        for attempt in range(MAX_DEBIT_TRIES):
            tries = [
                (i, plan, plan.ranked[attempt]) for i, plan in pending if attempt < len(plan.ranked)
            ]
            if not tries:
                break
            debits = [
                debit_request(requests[i], owners[i], c, _record(records.get(i), plan, c))
                for i, plan, c in tries
            ]
            outcomes = await self._debit(debits, policy, now, fate)
            for (i, plan, check), outcome in zip(tries, outcomes, strict=True):
                if outcome.granted:
                    fate.granted.append(outcome)
                    answers[i] = borrowed_answer(plan, check, outcome)
                elif outcome.recorded is not None:  # an earlier call's: nothing debited
                    answers[i] = replay_admission(outcome.recorded)
                else:
                    refusals.setdefault(i, []).append(f"{check.node_id}: {outcome.refusal}")
            pending = [(i, plan) for i, plan in pending if answers[i] is None]
        for i, plan in pending:
            answers[i] = no_room(plan, refusals.get(i, ()))

    def _unreported(self, pool: PoolSnapshot | None) -> Unreported:
        """The tokens this replica sent to ``pool`` that its reports do not show yet."""
        return self.sent.unreported(pool) if pool is not None else Unreported()

    def _demand(
        self,
        pool: PoolSnapshot | None,
        policy: PolicySettings,
        request: AdmissionRequest,
        sent: Unreported,
    ) -> tuple[DemandCheck, Unreported]:
        """Demand for a prompt bound for the request's prefill server (``check_demand``, made
        the server's by ``target_demand``) with the tokens this replica sent to the pool since
        its reports (``sent``: :meth:`_unreported`), computed once per pool snapshot, policy,
        count and server: the first two are immutable, and the store hands out the same cached
        snapshot to every Admit until it is renewed. Only servers that report are kept (the
        names come from routers)."""
        memo = self._last_demand
        if memo is None or memo.pool is not pool or memo.policy is not policy or memo.sent != sent:
            demand = check_demand(pool, policy, sent.shared, None, sent.by_server)
            memo = self._last_demand = _DemandMemo(pool, policy, sent, demand)
        server = request.prefill_node_id
        if server is None or pool is None:
            return memo.demand, sent
        targeted = memo.by_server.get(server)
        if targeted is None:
            targeted = target_demand(memo.demand, pool, request, policy, sent)
            if any(r.node_id == server for r in pool.reports):
                memo.by_server[server] = targeted
        return targeted, sent

    def _rooms(self, nodes: list[NodeState], shares: Share) -> tuple[Room | None, ...]:
        """``node_rooms``, each node's computed once per state and shares: states are immutable,
        and the store hands out the same one until its node changes (one debit changes one
        node of a view, in whatever order the view samples them). The memo holds the states it
        was computed for, the last view's, so an id it knows names that live object, never a
        new one that reuses a freed id."""
        last = self._last_rooms
        known = last[1] if last is not None and last[0] == shares else {}
        missing = [n for n in nodes if id(n) not in known]
        if not missing:
            return tuple(known[id(n)][1] for n in nodes)
        fresh = {id(n): r for n, r in zip(missing, node_rooms(missing, shares), strict=True)}
        rooms = tuple(fresh[id(n)] if id(n) in fresh else known[id(n)][1] for n in nodes)
        self._last_rooms = (shares, {id(n): (n, r) for n, r in zip(nodes, rooms, strict=True)})
        return rooms

    async def _debit(
        self, debits: Sequence[DebitRequest], policy: PolicySettings, now: int, fate: _Fate
    ) -> list[DebitOutcome]:
        """The debits' outcomes, their store call timed. When admission stops waiting (its
        deadline, or its caller gone: ``fate.why``), the debits may still land: their outcomes
        then go to ``abandoned`` (granted ones are released, never left for nobody: phantom
        holds), and the call is timed once they are known (``Store.try_debits_settled``; a
        late read that lost replies counts as a failed call). So do the others of a round
        whose call on one node failed, on a store that reads each node's reply (standalone
        Redis's debit line; a Cluster pipeline raises its first error and those expire)."""
        metrics = self.metrics
        started = time.perf_counter()
        waiting = True

        def late(outcomes: list[DebitOutcome]) -> None:
            if lost := sum(1 for outcome in outcomes if outcome.refusal == REPLY_LOST):
                metrics.record_lost_debits(lost)  # granted or not: unknown
            if waiting:  # a failed call's round (timed below)
                self._abandoned(outcomes, "another debit of its round failed")
                return
            metrics.record_store_operation("debit", time.perf_counter() - started, ok=not lost)
            self._abandoned(outcomes, fate.why)

        try:
            outcomes = await self.store.try_debits_settled(
                debits, policy.shares, now, policy.hold_ttl_ms, late
            )
        except asyncio.CancelledError:
            waiting = False
            raise  # timed by ``late`` if they land
        except BaseException:
            metrics.record_store_operation("debit", time.perf_counter() - started, ok=False)
            raise
        metrics.record_store_operation("debit", time.perf_counter() - started)
        self.breaker.succeeded()  # a round trip that answered (a cached view may make none)
        return outcomes

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


@dataclass(slots=True)
class _DemandMemo:
    """The pool's Demand (``demand``) for one pool snapshot, policy and unreported count, and
    the Demand for a prompt bound for each reporting server asked so far (``by_server``)."""

    pool: PoolSnapshot | None
    policy: PolicySettings
    sent: Unreported
    demand: DemandCheck
    by_server: dict[str, DemandCheck] = field(default_factory=dict)


def _borrow(
    plan: Plan,
    check: NodeCheck,
    reservation_id: str = "",
    lease_epoch: int = 0,
    lease_version: int = 0,
    expires_at_ms: int = 0,
) -> Admission:
    """The BORROW answer for ``check``, with the grant's facts (``reservation_id``,
    ``lease_epoch``, ``lease_version``, ``expires_at_ms``) when given; without them, a request
    record's template."""
    # Every field, in order, of its type (the plan's and the grant's own values): built without
    # validation (``trusted``), once per granted Admit.
    return Admission.trusted(
        decision=Decision.BORROW,
        reason=Reason.BORROWED,
        message=plan.summary(),
        node_id=check.node_id,
        reservation_id=reservation_id,
        lease_epoch=lease_epoch,
        lease_version=lease_version,
        expires_at_ms=expires_at_ms,
        predicted_ttft_ms=check.predicted_ttft_ms,
        normal_ttft_ms=plan.normal_path.total_ms if plan.normal_path else 0.0,
        plan=plan,
        shadow_decision=None,
        replayed=False,
        debit=check.debit,
    )


def debit_request(
    request: AdmissionRequest, owner: str, check: NodeCheck, record: RequestRecord | None = None
) -> DebitRequest:
    """The debit of ``request`` on ``check``'s node (with the request record it writes, if
    any)."""
    return DebitRequest(
        check.node_id,
        check.debit,
        request.request_id,
        owner,
        record,
        check.debit_us,
        pulled_tokens(request, check.node_id),
    )


def no_room(plan: Plan, refusals: Sequence[str]) -> Admission:
    """The NORMAL answer of a planned borrow every debit tried was refused (``refusals``:
    ``node: why`` each)."""
    return Admission.normal(
        Reason.NO_ROOM,
        "room taken by concurrent admissions (" + "; ".join(refusals) + ")",
        plan,
    )


def borrowed_answer(plan: Plan, check: NodeCheck, outcome: DebitOutcome) -> Admission:
    """The BORROW answer of a granted debit (:func:`_borrow` with the grant's facts)."""
    res = outcome.reservation
    assert res is not None  # a granted outcome carries its reservation
    return _borrow(
        plan,
        check,
        res.reservation_id,
        outcome.lease_epoch,
        outcome.lease_version,
        res.expires_at_ms,
    )


def _record(record: tuple[str, int] | None, plan: Plan, check: NodeCheck) -> RequestRecord | None:
    """The request record a debit on ``check``'s node writes with its grant, if any."""
    if record is None:
        return None
    return borrow_record(*record, _borrow(plan, check))
