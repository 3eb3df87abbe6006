"""Simulated node agents: a telemetry snapshot of a simulated server, then the agent's real rules.

The snapshot is what an engine's ``/metrics`` would say (batch, KV used/total, context sum,
rates and ITL quantiles over the last period); the lease comes from
:func:`crossflow_ctl.domain.leasing.decide` (zero-lease rules, ITL hysteresis, capacity model)
and prefill load from :func:`crossflow_ctl.domain.leasing.pool_load`, exactly as the agent
daemon computes them. Leases go to the broker domain class (and so the store) every period;
each lease is stamped with the last notice the agent had read (DESIGN.md §5.4).

**Fast-forward over a fixed point** (exact, for speed): an agent whose server had no event for a
whole period, whose snapshot and ITL guard came out as in the period before and which read no
new notice, would publish the same lease (only the version grows) every period until something
happens on its node. It stops ticking (``dormant``); the simulator wakes it at the next event
on its server or its node's reservations, and before any read of the store (an admission)
it publishes the lease of the latest period that would have passed, with that period's version
and receipt time. Counters (leases, zero reasons, mean credits) count every skipped period, so
a run reports what eager ticking would; ``SimConfig.fast_forward_agents=False`` ticks every
period (the tests compare both).

**Deferred storing** (exact, for speed; with fast-forward, over the in-process store): a decode
agent computes and counts its lease every tick, but stores it only before something reads or
changes its node in the store (an Admit or room view, a commit, a release, its catch-up after
sleeping), as received at its tick (the clock set back to then). A lease nothing read before the
next tick is dropped, superseded by that tick's: storing it would only have purged released
reservations the next lease purges too, unless a reservation on the node is due to expire by the
next tick (the store's EXPIRE notices come from the purge on a stored lease, and the agent
reads them), in which case it is stored at its tick first. The store's lease history then lacks
the dropped leases, as it lacks the periods a sleeping agent skips. Prefill agents' load
reports likewise reach the store only before a read of the pool (an Admit or room view), in the
order they were taken (except that a sleeping agent its server wakes stores its own first): a
report nothing read is superseded by its server's next one. The store
numbers the reports it stores in order, so fewer are numbered, but every comparison of those
numbers (which reports were stored before a prompt was sent) comes out as before.

**Online calibration** (``SimConfig.agent_calibration``): a decode agent feeds its server's step
counters (:meth:`~crossflow_ctl.sim.servers.DecodeServer.step_totals`, what an engine's
``/metrics`` would tell) to the same :class:`~crossflow_ctl.domain.online_calibration.
OnlineCalibrator` the agent daemon runs, and prices its leases (and its server's borrowed
chunks) with the calibrated profile, starting from ``SimConfig.agent_hardware`` (a wrong prior,
to measure what calibration buys). A calibrating agent never sleeps: its windows close on its
own ticks, and a sleeping one would close different ones.
"""

from __future__ import annotations

import contextlib
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, prefill_rate_tps, roofline
from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.domain.lease_credits import CapacityBreakdown, LeaseSettings
from crossflow_ctl.domain.leasing import (
    NO_CREDITS,
    ItlGuard,
    LeaseDecision,
    decide,
    next_guard,
    pool_load,
)
from crossflow_ctl.domain.lending import ChunkSizer, OpenDebits
from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    Credits,
    Lease,
    Notice,
    PoolLoad,
    ZeroReason,
)
from crossflow_ctl.domain.online_calibration import CalibrationSettings, OnlineCalibrator
from crossflow_ctl.domain.telemetry import EngineSnapshot
from crossflow_ctl.service import Broker
from crossflow_ctl.sim.servers import DecodeServer, PrefillServer

P = TypeVar("P")

STORED_LEASE_FIGURES = ("leases", "zero_reasons", "lease_credit_sums", "lease_chunk_sum")
"""The run's lease figures (:class:`~crossflow_ctl.sim.metrics.RunRecord`): counted over the
leases stored, so they change with what is stored (fast-forward, deferred storing) while no
decision does."""


class Tick(NamedTuple):
    """What one period of a decode agent decides its lease from, kept until the lease is built
    (:meth:`DecodeAgent.lease_of`); the agent's open debits cannot change before then (only
    the next tick reads notices, and it stores or drops this one first)."""

    snapshot: EngineSnapshot
    now_ms: int
    guard: ItlGuard
    """The guard before this period (:func:`decide` advances it as :func:`next_guard` did)."""
    version: int
    last_notice_seq: int
    t: float


class Period:
    """An agent's schedule: period k falls at ``phase_s + k * period_s``. One formula for ticking
    and for sleeping, so an agent that sleeps over periods lands on the very same times."""

    def __init__(self, period_s: float, phase_s: float = 0.0) -> None:
        self.period_s = period_s
        self.phase_s = phase_s
        self.k = 0

    @property
    def next_s(self) -> float:
        return self.phase_s + self.k * self.period_s

    def advance(self) -> None:
        self.k += 1

    def skip_to(self, t: float) -> tuple[int, float]:
        """Pass every period at or before ``t``: (how many, when the last one fell)."""
        if self.next_s > t:
            return 0, 0.0
        n = int((t - self.next_s) // self.period_s) + 1
        while self.phase_s + (self.k + n) * self.period_s <= t:
            n += 1
        while n > 1 and self.phase_s + (self.k + n - 1) * self.period_s > t:
            n -= 1
        last = self.phase_s + (self.k + n - 1) * self.period_s
        self.k += n
        return n, last


class FixedPoint(ABC, Generic[P]):
    """The fast-forward state both agents share (see the module doc): their schedule, whether
    their node changed since the last tick (``stirred``), whether they sleep (``dormant``) and,
    while they do, what they keep publishing (a ``P``).

    A subclass ticks, then calls :meth:`_settle` with its snapshot and what it published; while
    dormant, :meth:`_republish` publishes that again for the periods it slept through."""

    def __init__(self, period_s: float, fast_forward: bool) -> None:
        self.period_s = period_s
        self.fast_forward = fast_forward
        self.schedule = Period(period_s)
        self.stirred = True
        """Something happened on the server or the node's reservations since the last tick."""
        self.dormant = False
        self._last: EngineSnapshot | None = None
        """The previous tick's snapshot (compared field by field only when it could matter)."""
        self._fixed: P | None = None
        """While dormant: what it keeps publishing (None: nothing)."""

    def _settle(self, snapshot: EngineSnapshot, steady: bool, published: P | None) -> bool:
        """End a tick on ``snapshot`` that published ``published``: True when the agent is at a
        fixed point and sleeps (``steady``: nothing else the agent reads changed this period)."""
        self.schedule.advance()
        last, self._last = self._last, snapshot
        fixed = (
            self.fast_forward
            and steady
            and not self.stirred
            and last is not None
            and snapshot_key(snapshot) == snapshot_key(last)
        )
        self.stirred = False
        self.dormant = fixed
        if fixed:
            self._fixed = published
        return fixed

    async def catch_up(self, broker: Broker, t: float, sync: Callable[[float], int]) -> None:
        """Dormant: publish again what the latest period at or before ``t`` would have."""
        if not self.dormant:
            return
        n, last = self.schedule.skip_to(t)
        if n and self._fixed is not None:
            self._fixed = await self._republish(broker, self._fixed, n, last, sync, t)

    async def wake(self, broker: Broker, t: float, sync: Callable[[float], int]) -> float:
        """Leave the fixed point at ``t``; returns when the next period falls."""
        await self.catch_up(broker, t, sync)
        self.dormant = False
        self._fixed = None
        self.stirred = True
        return self.schedule.next_s

    @abstractmethod
    async def _republish(
        self,
        broker: Broker,
        fixed: P,
        n: int,
        last_s: float,
        sync: Callable[[float], int],
        t: float,
    ) -> P:
        """Publish ``fixed`` for the ``n`` periods slept through (the last at ``last_s``), as
        received then; the clock is at ``t`` after. Returns what it keeps publishing."""


class DecodeAgent(FixedPoint[tuple[Lease, int]]):
    def __init__(
        self,
        server: DecodeServer,
        node_id: str,
        model: ModelSpec,
        node: NodeProfile,
        settings: LeaseSettings,
        period_s: float,
        ttl_ms: int,
        follow_chunk: bool = True,
        fast_forward: bool = True,
        calibration: CalibrationSettings | None = None,
    ) -> None:
        super().__init__(period_s, fast_forward)
        self.server = server
        self.node_id = node_id
        self.model = model
        self.node = node
        """The profile it prices leases with: its prior, or what calibration made of it."""
        self.calibrator = (
            OnlineCalibrator(model, node, calibration)
            if calibration is not None and calibration.enabled
            else None
        )
        """Online calibration from the server's step counters (None: the prior throughout)."""
        self.settings = settings
        self.ttl_ms = ttl_ms
        self.guard = ItlGuard()
        self.open_debits = OpenDebits()
        self.sizer = (
            ChunkSizer(
                roofline(model, node),
                settings.budget_s,
                settings.chunk_step_tokens,
                settings.max_chunk_tokens,
            )
            if follow_chunk
            else None
        )
        """The engine's chunk rule: each borrowed prompt's chunk is sized for its prefix within the
        agent's ITL budget (nothing is borrowed before the agent's first lease)."""
        server.sizer = self.sizer
        self.version = 0
        self.last_notice_seq = 0
        self.last_tokens = 0
        self.zero_leases = 0
        self.leases = 0
        self.zero_reasons: dict[str, int] = {}
        self._credit_sums = [0.0] * len(CREDIT_NAMES)
        self.chunk_sum = 0
        """Sum of the sized borrowed chunk over the non-zero leases."""
        self.zero = True
        """Whether the last lease published was a zero lease (no room to signal)."""
        self.open_borrows = 0
        """Reservations granted on this node and not yet released (no fast-forward while > 0:
        their expiry would change what the agent reads)."""
        self._due: Callable[[str, int], bool] | None = None
        self._notice_seq: Callable[[str], int] | None = None
        self._sync: Callable[[float], int] | None = None
        self._capacity: CapacityBreakdown | None = None
        """The last tick's capacity (it seeds the next one's search; no result depends on it)."""
        self._pending: tuple[Tick, LeaseDecision | None] | None = None
        """Deferred publishing (:meth:`defer`): the last tick's inputs and, when it was needed
        then, its decision; not stored yet."""

    def snapshot(self, t: float, now_ms: int) -> EngineSnapshot:
        s = self.server
        p50, p99, _ = s.recent_itl(t, self.period_s)
        produced = s.tokens_out - self.last_tokens
        self.last_tokens = s.tokens_out
        return EngineSnapshot.observed(
            {
                "taken_at_ms": now_ms,
                "source": "sim",
                "running_requests": s.batch,
                "queued_requests": len(s.waiting) + len(s.borrow_q),
                "kv_used_tokens": s.kv_used,
                "kv_total_tokens": s.kv_capacity,
                "decode_context_tokens": s.context_tokens(t),
                "generation_rate_tps": produced / self.period_s,
                "prompt_rate_tps": 0.0,
                "itl_p50_ms": p50,
                "itl_p99_ms": p99,
                "kv_transfer_bytes_per_s": None,
                "outstanding_uncached_tokens": s.borrowed_outstanding,
                "borrowed_kv_tokens": s.borrowed_kv,
                "kv_waiting_requests": s.promised_requests,
                "kv_waiting_tokens": s.promised_kv,
                "prefill_processing_rate_tps": 0.0,
                "prefill_queue_wait_ms": None,
                "prefill_mean_cached_tokens": None,
                "window_s": self.period_s,
            }
        )

    @property
    def pending(self) -> bool:
        """Whether a lease the last tick deferred is not stored yet (:meth:`flush` stores it)."""
        return self._pending is not None

    def defer(
        self,
        due: Callable[[str, int], bool] | None,
        sync: Callable[[float], int],
        notice_seq: Callable[[str], int] | None = None,
    ) -> None:
        """Store leases lazily (see the module doc): ``due(node_id, now_ms)`` says whether a
        lease stored on the node at ``now_ms`` would expire a reservation; ``sync`` sets the
        clock. None: store each lease at its tick. ``notice_seq(node_id)``: the node's latest
        notice sequence in the store, so a tick with nothing new skips the read."""
        self._due, self._sync, self._notice_seq = due, sync, notice_seq

    async def tick(self, broker: Broker, t: float, now_ms: int, eager: bool = True) -> bool:
        """One period; False when the agent went dormant (schedule no next tick). With
        ``eager`` False and deferred storing, the lease is decided only once something stores
        it (:meth:`flush`, or going dormant): ``zero`` is then not updated (the simulator
        reads it only while prompts are held, and ticks eagerly then)."""
        if self._pending is not None:
            due = self._due
            if due is not None and not due(self.node_id, now_ms):
                self._pending = None  # nothing read it, and this period's lease supersedes it
            else:
                await self.flush(broker, t)
        seq = self._notice_seq
        if seq is not None and seq(self.node_id) == self.last_notice_seq:
            notices: list[Notice] = []  # none since the last read: what reading would return
        else:
            notices = await broker.read_notices(self.node_id, self.last_notice_seq, 0)
        if notices:
            self.last_notice_seq = notices[-1].seq
            self.open_debits.apply(notices)
        snapshot = self.snapshot(t, now_ms)
        self._calibrate(t)
        guard = self.guard
        self.guard = next_guard(snapshot, now_ms=now_ms, settings=self.settings, guard=guard)
        self.version += 1
        inputs = Tick(snapshot, now_ms, guard, self.version, self.last_notice_seq, t)
        decision: LeaseDecision | None = None
        if eager or self._due is None or self.calibrator is not None:
            decision = self._decide(inputs)
            self.zero = decision.zero_reason is not None
        lease: Lease | None = None
        if self._due is None:
            lease, chunk = self._stored(inputs, decision)
            await broker.ingest_lease(lease)
        else:
            self._pending = (inputs, decision)
        steady = not notices and self.open_borrows == 0 and self.guard == guard
        steady = steady and self.calibrator is None  # a calibrating agent never sleeps
        if not self._settle(snapshot, steady, None):
            return True
        if lease is None:  # it goes on publishing the deferred lease: decide it now
            decision = decision or self._decide(inputs)
            self._pending = (inputs, decision)
            chunk = decision.capacity.chunk_tokens if decision.capacity is not None else 0
            lease = _lease_of(self, decision, inputs.version, inputs.last_notice_seq)
        self._fixed = (lease, chunk)
        return False

    def _decide(self, inputs: Tick) -> LeaseDecision:
        """The lease decision of the period ``inputs`` were taken in (the agent's rules)."""
        decision = decide(
            inputs.snapshot,
            now_ms=inputs.now_ms,
            model=self.model,
            node=self.node,
            settings=self.settings,
            guard=inputs.guard,
            open_debits=self.open_debits,
            previous=self._capacity,
        )
        self._capacity = decision.capacity
        return decision

    def _stored(self, inputs: Tick, decision: LeaseDecision | None) -> tuple[Lease, int]:
        """The lease of ``inputs``' period, about to be stored, counted in the run's figures
        (which are over stored leases); and its sized chunk."""
        decision = decision or self._decide(inputs)
        zero_reason = decision.zero_reason
        chunk = decision.capacity.chunk_tokens if decision.capacity is not None else 0
        self._count(decision.credits if zero_reason is None else NO_CREDITS, zero_reason, chunk, 1)
        return _lease_of(self, decision, inputs.version, inputs.last_notice_seq), chunk

    def _calibrate(self, t: float) -> None:
        """Feed the server's step counters to the calibration; a changed profile prices the
        leases from now on and sizes the server's borrowed chunks (the engine's rule follows
        the agent's model)."""
        cal = self.calibrator
        if cal is None:
            return
        cal.observe(self.server.step_totals(t))
        if cal.profile is not self.node:
            self.node = cal.profile
            self._capacity = None
            if self.sizer is not None:
                s = self.settings
                self.sizer = ChunkSizer(
                    roofline(self.model, self.node),
                    s.budget_s,
                    s.chunk_step_tokens,
                    s.max_chunk_tokens,
                )
                self.server.sizer = self.sizer

    async def flush(self, broker: Broker, t: float) -> None:
        """Store the lease the last tick deferred, as received then (the clock is at ``t``
        after): before anything reads or changes the node in the store."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        sync = self._sync
        assert sync is not None  # set with ``due`` by :meth:`defer`
        inputs, decision = pending
        lease, _ = self._stored(inputs, decision)
        sync(inputs.t)
        await broker.ingest_lease(lease)
        sync(t)

    def _count(self, credits: Credits, zero_reason: ZeroReason | None, chunk: int, n: int) -> None:
        """Count ``n`` publications of a lease (``credits``, ``zero_reason``; sized chunk
        ``chunk``) in the run's figures."""
        self.leases += n
        if zero_reason is not None:
            self.zero_leases += n
            why = zero_reason.value
            self.zero_reasons[why] = self.zero_reasons.get(why, 0) + n
        else:
            c, sums = credits, self._credit_sums
            sums[0] += c.compute_tokens * n
            sums[1] += c.kv_tokens * n
            sums[2] += c.kv_transfer_bytes * n
            sums[3] += c.output_tokens * n
            sums[4] += c.slots * n
            self.chunk_sum += chunk * n

    @property
    def credit_sums(self) -> dict[str, float]:
        """Sum of each credit over the non-zero leases (for the report's mean lease)."""
        return dict(zip(CREDIT_NAMES, self._credit_sums, strict=True))

    async def _republish(
        self,
        broker: Broker,
        fixed: tuple[Lease, int],
        n: int,
        last_s: float,
        sync: Callable[[float], int],
        t: float,
    ) -> tuple[Lease, int]:
        """The lease of the latest skipped period: its version, received at its time."""
        lease, chunk = fixed
        self.version += n
        lease = lease.model_copy(update={"version": self.version})
        self._count(lease.credits, lease.zero_reason, chunk, 1)
        sync(last_s)
        await broker.ingest_lease(lease)
        sync(t)
        return lease, chunk


class PrefillAgent(FixedPoint[PoolLoad]):
    def __init__(
        self,
        server: PrefillServer,
        node_id: str,
        settings: LeaseSettings,
        period_s: float,
        ttl_ms: int,
        kv_total_tokens: int,
        fast_forward: bool = True,
    ) -> None:
        super().__init__(period_s, fast_forward)
        self.server = server
        self.node_id = node_id
        self.settings = settings
        self.ttl_ms = ttl_ms
        self.kv_total_tokens = kv_total_tokens
        self.modelled_rate_tps = prefill_rate_tps(
            server.steps.model, server.steps.node, server.chunk
        )
        self.last_processed = 0.0
        self._sync: Callable[[float], int] | None = None
        self._pending: tuple[PoolLoad, float] | None = None
        """Deferred storing (:meth:`defer`): the last load report and its tick, not stored yet."""

    def defer(self, sync: Callable[[float], int] | None) -> None:
        """Store load reports lazily (see the module doc); ``sync`` sets the clock. None:
        store each one at its tick."""
        self._sync = sync

    @property
    def pending_s(self) -> float | None:
        """When the load report not stored yet was taken (None: none is waiting)."""
        return self._pending[1] if self._pending is not None else None

    async def flush(self, broker: Broker, t: float) -> None:
        """Store the load report the last tick deferred, as received then (the clock is at
        ``t`` after): before anything reads the pool in the store."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        sync = self._sync
        assert sync is not None  # set by :meth:`defer`
        sync(pending[1])
        await _put_load(broker, pending[0])
        sync(t)

    def snapshot(self, t: float, now_ms: int) -> EngineSnapshot:
        s = self.server
        processed = s.processed_tokens(t)
        rate = max(0.0, processed - self.last_processed) / self.period_s
        self.last_processed = processed
        return EngineSnapshot.observed(
            {
                "taken_at_ms": now_ms,
                "source": "sim",
                "running_requests": 1 if s.current is not None else 0,
                "queued_requests": len(s.queue),
                "kv_used_tokens": 0,
                "kv_total_tokens": self.kv_total_tokens,
                "decode_context_tokens": 0,
                "generation_rate_tps": 0.0,
                "prompt_rate_tps": rate,
                "itl_p50_ms": None,
                "itl_p99_ms": None,
                "kv_transfer_bytes_per_s": None,
                "outstanding_uncached_tokens": s.outstanding_tokens(t),
                "borrowed_kv_tokens": 0,
                "kv_waiting_requests": 0,
                "kv_waiting_tokens": None,
                "prefill_processing_rate_tps": rate,
                "prefill_queue_wait_ms": s.wait_s(t) * 1000.0,
                "prefill_mean_cached_tokens": None,  # the exact wait above needs no estimate
                "window_s": self.period_s,
            }
        )

    async def tick(self, broker: Broker, t: float, now_ms: int) -> bool:
        """One period; False when the agent went dormant (see the module doc)."""
        snapshot = self.snapshot(t, now_ms)
        load = pool_load(
            snapshot,
            now_ms=now_ms,
            node_id=self.node_id,
            pool="default",
            ttl_ms=self.ttl_ms,
            settings=self.settings,
            modelled_rate_tps=self.modelled_rate_tps,
        )
        if load is not None:
            if self._sync is None:
                await _put_load(broker, load)
            else:
                self._pending = (load, t)  # supersedes one nothing read
        return not self._settle(snapshot, True, load)

    async def _republish(
        self,
        broker: Broker,
        fixed: PoolLoad,
        n: int,
        last_s: float,
        sync: Callable[[float], int],
        t: float,
    ) -> PoolLoad:
        sync(last_s)
        await _put_load(broker, fixed)
        sync(t)
        return fixed


def _lease_of(
    agent: DecodeAgent, decision: LeaseDecision, version: int, last_notice_seq: int
) -> Lease:
    return decision.to_lease(
        node_id=agent.node_id,
        epoch=1,
        version=version,
        ttl_ms=agent.ttl_ms,
        last_notice_seq=last_notice_seq,
    )


async def _put_load(broker: Broker, load: PoolLoad) -> None:
    # Fail closed: on a store error the pool load expires and Demand fails.
    with contextlib.suppress(CrossflowError):
        await broker.ingest_pool_load(load)


_KEY_FIELDS = tuple(name for name in EngineSnapshot.model_fields if name != "taken_at_ms")

_key_of_fields = operator.itemgetter(*_KEY_FIELDS)


def snapshot_key(snapshot: EngineSnapshot) -> tuple[object, ...]:
    """Every field of a snapshot but the time it was taken: what a lease or pool load depends
    on, so two periods with equal keys (and nothing else changed) publish the same. Read from
    the model's field dict (half the cost of one attribute read per field, once per tick)."""
    key: tuple[object, ...] = _key_of_fields(snapshot.__dict__)
    return key
