"""From a telemetry snapshot to a lease: the zero-lease rules, then the credits, or a zero lease
and why.

Pure code, shared by the agent and the simulator. :func:`decide` applies the rules in order (no
snapshot, stale, implausible, cordoned, ITL over the SLO with hysteresis, no capacity) around the
lease arithmetic of :func:`crossflow_ctl.domain.lease_credits.compute_capacity`;
:func:`pool_load` is the prefill role's report. GPU utilisation is never an input.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, Roofline, prefill_time_s
from crossflow_ctl.domain.lease_credits import (
    CapacityBreakdown,
    ItlQuantile,
    LeaseSettings,
    compute_capacity,
)
from crossflow_ctl.domain.lending import OpenDebits, PrefillCoefficients
from crossflow_ctl.domain.models import (
    MAX_MS,
    MAX_RATE_TPS,
    MAX_TOKENS,
    MAX_TTL_MS,
    Credits,
    Lease,
    PoolLoad,
    ZeroReason,
)
from crossflow_ctl.domain.telemetry import NUMERIC_FIELDS, EngineSnapshot

# -- zero-lease rules ----------------------------------------------------------------------------


_COUNTS = frozenset(n for n in NUMERIC_FIELDS if n.endswith(("_tokens", "_requests")))
_ABSURD = MAX_TOKENS * 100


_LIMITS = tuple(
    (name, _ABSURD if name in _COUNTS else sys.float_info.max) for name in NUMERIC_FIELDS
)
"""Each numeric field and the most it may be: a plausible value is None or in [0, most]."""


def implausibility(snapshot: EngineSnapshot) -> str:
    """Why a snapshot cannot be trusted ("" when it can)."""
    values = snapshot.__dict__
    for name, most in _LIMITS:  # the usual case, one comparison a field (NaN fails it too)
        value = values[name]
        if value is not None and not 0 <= value <= most:
            return _why(snapshot)
    return _inconsistency(snapshot)


def _why(snapshot: EngineSnapshot) -> str:
    """The first field out of range, named as the agent reports it."""
    for name in NUMERIC_FIELDS:
        value = getattr(snapshot, name)
        if value is None or isinstance(value, bool):
            continue
        if not math.isfinite(value):
            return f"{name} is {float(value)}"
        if value < 0:
            return f"{name} is negative ({value:g})"
        if value > _ABSURD and name in _COUNTS:
            return f"{name} is absurd ({value:g})"
    return _inconsistency(snapshot)


def _inconsistency(snapshot: EngineSnapshot) -> str:
    if snapshot.kv_total_tokens <= 0:
        return "kv_total_tokens is 0"
    if snapshot.kv_used_tokens > snapshot.kv_total_tokens:
        return (
            f"kv_used_tokens {snapshot.kv_used_tokens} > kv_total_tokens {snapshot.kv_total_tokens}"
        )
    if snapshot.running_requests == 0 and snapshot.decode_context_tokens > 0:
        return "decode_context_tokens > 0 with no running request"
    return ""


def observed_itl_ms(snapshot: EngineSnapshot, settings: LeaseSettings) -> float | None:
    if settings.itl_quantile is ItlQuantile.P50:
        return snapshot.itl_p50_ms
    return snapshot.itl_p99_ms


class ItlGuard(NamedTuple):
    """ITL hysteresis as a small state machine (a value: ``observe`` returns the next state).

    Trips when the observed ITL reaches the SLO; clears only after ``itl_clear_after``
    consecutive observations below ``itl_slo_ms * itl_clear_ratio``. A window with no ITL
    samples says nothing when requests are running (a step longer than the window), so it
    leaves the state as it is; with nothing running (``idle``) it counts as below: an idle
    decode batch cannot miss its SLO.

    ``last_itl_ms`` remembers the latest ITL a window did measure, so a lease built on a window
    without samples still reports the node's recent ITL (0 once it is idle).
    """

    tripped: bool = False
    good_streak: int = 0
    last_itl_ms: float = 0.0

    def observe(
        self, itl_ms: float | None, settings: LeaseSettings, *, idle: bool = False
    ) -> ItlGuard:
        last = itl_ms if itl_ms is not None else (0.0 if idle else self.last_itl_ms)
        if itl_ms is not None and itl_ms >= settings.itl_slo_ms:
            return ItlGuard(tripped=True, good_streak=0, last_itl_ms=last)
        if not self.tripped or (itl_ms is None and not idle):
            return (
                self if last == self.last_itl_ms else ItlGuard(self.tripped, self.good_streak, last)
            )
        below = itl_ms is None or itl_ms < settings.itl_slo_ms * settings.itl_clear_ratio
        streak = self.good_streak + 1 if below else 0
        if streak >= settings.itl_clear_after:
            return ItlGuard(last_itl_ms=last)
        return ItlGuard(tripped=True, good_streak=streak, last_itl_ms=last)


NO_CREDITS = Credits()
NO_COST = PrefillCoefficients()


class LeaseDecision(NamedTuple):
    """What the agent will publish for one snapshot, before epoch/version are stamped."""

    credits: Credits = NO_CREDITS
    zero_reason: ZeroReason | None = None
    zero_detail: str = ""
    queue_wait_ms: float = 0.0
    borrowed_prefill_rate_tps: float = 0.0
    coefficients: PrefillCoefficients = NO_COST
    itl_ms: float = 0.0
    itl_slo_ms: float = 0.0
    snapshot_unix_ms: int = 0
    horizon_ms: int = 0
    """The horizon the credits were sized over (0 with no credits sized)."""
    guard: ItlGuard = ItlGuard()
    capacity: CapacityBreakdown | None = None

    def to_lease(
        self, *, node_id: str, epoch: int, version: int, ttl_ms: int, last_notice_seq: int
    ) -> Lease:
        """The lease, built without validation: every figure comes from :func:`decide`, in
        bounds, and the caller's identity and counters from its validated settings (the agent
        builds one every period, the simulator one per agent tick); the broker validates what
        it receives, the edge."""
        return Lease.trusted(
            node_id=node_id,
            epoch=epoch,
            version=version,
            ttl_ms=ttl_ms,
            credits=self.credits if self.zero_reason is None else NO_CREDITS,
            zero_reason=self.zero_reason,
            zero_detail=self.zero_detail[:512],
            queue_wait_ms=self.queue_wait_ms,
            borrowed_prefill_rate_tps=self.borrowed_prefill_rate_tps,
            prefill_s_per_token=self.coefficients.a_s,
            prefill_s_per_token_context=self.coefficients.b_s,
            itl_ms=self.itl_ms,
            itl_slo_ms=self.itl_slo_ms,
            last_notice_seq=last_notice_seq,
            snapshot_unix_ms=max(0, self.snapshot_unix_ms),
            horizon_ms=self.horizon_ms,
        )


def _clamp_ms(value: float | None) -> float:
    if value is None or not math.isfinite(value):
        return 0.0
    return min(MAX_MS, max(0.0, value))


def decide(
    snapshot: EngineSnapshot | None,
    *,
    now_ms: int,
    model: ModelSpec,
    node: NodeProfile,
    settings: LeaseSettings,
    guard: ItlGuard,
    cordoned: bool = False,
    failure: str = "",
    failure_reason: ZeroReason = ZeroReason.TELEMETRY_MISSING,
    open_debits: OpenDebits | None = None,
    previous: CapacityBreakdown | None = None,
) -> LeaseDecision:
    """Apply the zero-lease rules in order, then the capacity model.

    Order: no snapshot (the scrape failed: ``failure`` says why; ``failure_reason`` is
    TELEMETRY_MISSING, or TELEMETRY_IMPLAUSIBLE for values no snapshot can hold) -> stale ->
    implausible -> cordoned -> ITL over SLO (hysteresis) -> no capacity. The ITL guard
    advances only on fresh, plausible snapshots. ``open_debits`` are the reservations the
    broker still counts, as of the notice sequence the lease will be stamped with;
    ``previous``: the last decision's capacity, which seeds the search (:func:`compute_capacity`).
    """
    slo = settings.itl_slo_ms
    if snapshot is None:
        return LeaseDecision(
            zero_reason=failure_reason,
            zero_detail=failure or "no telemetry snapshot",
            itl_slo_ms=slo,
            guard=guard,
        )
    age_ms = now_ms - snapshot.taken_at_ms
    if age_ms > settings.stale_after_ms:
        return LeaseDecision(
            zero_reason=ZeroReason.TELEMETRY_STALE,
            zero_detail=f"snapshot is {age_ms} ms old (limit {settings.stale_after_ms})",
            itl_slo_ms=slo,
            snapshot_unix_ms=snapshot.taken_at_ms,
            guard=guard,
        )
    why = implausibility(snapshot)
    if why:
        return LeaseDecision(
            zero_reason=ZeroReason.TELEMETRY_IMPLAUSIBLE,
            zero_detail=why,
            itl_slo_ms=slo,
            snapshot_unix_ms=snapshot.taken_at_ms,
            guard=guard,
        )
    itl = observed_itl_ms(snapshot, settings)
    guard = guard.observe(itl, settings, idle=snapshot.running_requests == 0)
    itl_ms = _clamp_ms(guard.last_itl_ms)  # this window's ITL, or the last one measured while busy
    capacity = compute_capacity(snapshot, model, node, settings, open_debits, previous)
    zero_reason: ZeroReason | None = None
    detail = ""
    c = capacity.credits
    if cordoned:
        zero_reason, detail = ZeroReason.CORDONED, "cordoned by the broker"
    elif guard.tripped:
        zero_reason = ZeroReason.ITL_OVER_SLO
        detail = (
            f"itl {settings.itl_quantile.value} {itl_ms:.1f} ms,"
            f" slo {slo:g} ms (clears after {settings.itl_clear_after} below"
            f" {slo * settings.itl_clear_ratio:g} ms; streak {guard.good_streak})"
        )
    elif not (c.compute_tokens > 0 and c.kv_tokens > 0 and c.slots > 0 and c.output_tokens > 0):
        short = [
            name
            for name, value in (
                ("compute", c.compute_tokens),
                ("kv", c.kv_tokens),
                ("slots", c.slots),
                ("output", c.output_tokens),
            )
            if value <= 0
        ]
        zero_reason, detail = ZeroReason.NO_CAPACITY, "no room on " + ", ".join(short)
    return LeaseDecision(
        credits=c if zero_reason is None else NO_CREDITS,
        zero_reason=zero_reason,
        zero_detail=detail,
        queue_wait_ms=capacity.queue_wait_ms,
        borrowed_prefill_rate_tps=capacity.borrowed_prefill_rate_tps,
        coefficients=capacity.coefficients,
        itl_ms=itl_ms,
        itl_slo_ms=slo,
        snapshot_unix_ms=snapshot.taken_at_ms,
        horizon_ms=settings.horizon_ms,
        guard=guard,
        capacity=capacity,
    )


def next_guard(
    snapshot: EngineSnapshot | None, *, now_ms: int, settings: LeaseSettings, guard: ItlGuard
) -> ItlGuard:
    """The ITL guard :func:`decide` returns on these inputs, without the capacity model: an
    agent that builds its lease only when something needs it still advances its guard every
    period (the guard moves only on fresh, plausible snapshots, as in :func:`decide`)."""
    if (
        snapshot is None
        or now_ms - snapshot.taken_at_ms > settings.stale_after_ms
        or implausibility(snapshot)
    ):
        return guard
    itl = observed_itl_ms(snapshot, settings)
    return guard.observe(itl, settings, idle=snapshot.running_requests == 0)


def pool_load(
    snapshot: EngineSnapshot | None,
    *,
    now_ms: int,
    node_id: str,
    pool: str,
    ttl_ms: int,
    settings: LeaseSettings,
    modelled_rate_tps: float = 0.0,
    roof: Roofline | None = None,
) -> PoolLoad | None:
    """A prefill server's load report, or None when its telemetry is missing, stale or odd.

    Sending nothing is the fail-closed choice: the broker's pool load then expires and the
    demand test fails (DESIGN.md §4).

    The processing rate is the observed one, but at least ``modelled_rate_tps`` (the server's
    roofline rate, :func:`~crossflow_ctl.domain.capacity.prefill_rate_tps`): the broker divides
    the outstanding tokens by it to get the wait, and a server that idled through part of the
    window processed fewer tokens than it drains once work is queued, so the observed rate alone
    makes a burst after a lull look seconds deep (and one after a fully idle window, endless).
    The floor errs toward a shorter wait: less Demand, so less borrowing, the safe side.

    The server's wait in time is the source's when it tells one, else priced on ``roof`` (the
    server's roofline) when the source tells the mean cached prefix
    (:func:`modelled_queue_wait_ms`), else not reported.
    """
    if snapshot is None or now_ms - snapshot.taken_at_ms > settings.stale_after_ms:
        return None
    if implausibility(snapshot):
        return None
    observed = snapshot.prefill_processing_rate_tps or snapshot.prompt_rate_tps
    rate = min(MAX_RATE_TPS, max(observed, modelled_rate_tps))
    running = snapshot.running_requests
    wait = snapshot.prefill_queue_wait_ms
    if wait is None and roof is not None:
        wait = modelled_queue_wait_ms(snapshot, roof, settings.prefill_chunk_tokens)
    per_request = rate / running if running > 0 else min(MAX_RATE_TPS, modelled_rate_tps)
    values = {
        "pool": pool,
        "node_id": node_id,
        "outstanding_uncached_tokens": snapshot.outstanding_uncached_tokens,
        "processing_rate_tps": rate,
        "prefill_rate_tps": per_request,
        "ttl_ms": ttl_ms,
        "queued_requests": min(snapshot.queued_requests, 10_000_000),
        "queue_wait_ms": None if wait is None else min(MAX_MS, wait),
    }
    if per_request >= 0.0 and 0 < ttl_ms <= MAX_TTL_MS:
        # A plausible snapshot's figures, clamped into their bounds above, and the caller's
        # identity from its validated settings: no validation (every prefill period); the
        # broker validates what it receives, the edge. Odd caller figures are validated.
        return PoolLoad.trusted(**values)
    return PoolLoad(**values)


MAX_PRICED_STEPS = 4_096
"""The most chunks :func:`modelled_queue_wait_ms` prices one prompt in (a tick's budget)."""


def modelled_queue_wait_ms(
    snapshot: EngineSnapshot, roof: Roofline, chunk_tokens: int
) -> float | None:
    """A prefill server's wait in time from what engines do export (counts and token totals):
    each queued prompt taken as the mean recent one, its uncached tokens the outstanding ones
    per queued prompt and its cached prefix the source's mean (``prefill_mean_cached_tokens``),
    on the server's roofline. Prompts shorter than a chunk are batched as the engines batch
    them, ``chunk_tokens // uncached`` to a step (each step's fixed cost shared, every token
    attending to the mean prefix); longer ones are prefilled alone in ``chunk_tokens`` chunks.
    A batched step is priced as one sequence of its tokens after the mean prefix: that counts
    attention between prompts that do not attend to each other (long, most with many short
    prompts to a step) and reads the prefix once, not per prompt (short). The running prompts
    are left out (how far each has got is not told: short). None when the source does not tell
    the cached prefix, or when chunks so small would take over ``MAX_PRICED_STEPS`` steps to
    price (the pool is then read in tokens)."""
    cached = snapshot.prefill_mean_cached_tokens
    queued = snapshot.queued_requests
    if cached is None or chunk_tokens <= 0:
        return None
    if queued <= 0 or snapshot.outstanding_uncached_tokens <= 0:
        return 0.0
    uncached = max(1, round(snapshot.outstanding_uncached_tokens / queued))
    if uncached < chunk_tokens:
        per_step = chunk_tokens // uncached
        steps = -(-queued // per_step)
        last = queued - (steps - 1) * per_step
        full = roof.step_s(0, 0, per_step * uncached, round(cached))
        tail = roof.step_s(0, 0, last * uncached, round(cached))
        return min(MAX_MS, ((steps - 1) * full + tail) * 1000.0)
    if -(-uncached // chunk_tokens) > MAX_PRICED_STEPS:
        return None
    one = prefill_time_s(roof, uncached, round(cached), chunk_tokens)
    return min(MAX_MS, queued * one * 1000.0)
