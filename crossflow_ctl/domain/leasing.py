"""From a telemetry snapshot to a lease: the credits a decode node offers, or a zero lease and why.

Pure code, shared by the agent and the simulator. Inputs: an :class:`EngineSnapshot`, the served
:class:`ModelSpec`, the node's :class:`NodeProfile` and the agent's :class:`LeaseSettings`.

The arithmetic (B = running requests, C = sum of their contexts, ``t(b, c, P)`` the roofline
step time of :func:`crossflow_ctl.domain.capacity.step_time_s`, H = borrow horizon in seconds):

* **budget** ``= itl_slo_ms / 1000 * slo_margin``: the longest step the node may run.
* **compute**: a step that carries a borrowed prefill chunk of P uncached tokens over an assumed
  cached prefix X (``borrowed_prefix_tokens``) takes ``t(B, C, P; X)``, and every decode request
  waits for it, so P is feasible when ``t(B, C, P; X) <= budget``. Among feasible chunk sizes
  on a fixed grid (multiples of ``chunk_step_tokens`` up to ``max_chunk_tokens``) the agent
  picks the one with the highest borrowed-prefill rate ``P / t`` (tokens/s); attention is
  quadratic in P, so the largest chunk is not always the fastest.
  ``compute_tokens = rate * H - outstanding`` where outstanding is borrowed prompt work already
  queued on the node. ``queue_wait_ms = outstanding / rate``.
* **kv**: ``free - reserve`` with ``free = total - used`` and
  ``reserve = kv_reserve_fraction * total + kv_growth_tokens_per_request * B`` (room kept for
  the running requests' next output tokens).
* **slots** and **output**: a borrowed request stays and decodes on the node with an assumed
  context of ``borrowed_context_tokens`` L. Adding b of them is feasible when
  ``t(B + b, C + b*L, 0) <= budget``; slots is the largest feasible b (at most ``max_slots``)
  and ``output_tokens = max over feasible b of b * H / t(B + b, C + b*L, 0)``.
* **kv_transfer**: ``network_bytes_per_s * H * kv_transfer_share``, capped by the KV credit in
  bytes (no use pulling in more KV than there is room for).

A lease needs compute, kv, slots and output all above zero to be useful; otherwise it is a zero
lease with reason NO_CAPACITY. Every credit is non-increasing in B and C and non-decreasing in
the SLO (each is a maximum over a feasible set that shrinks, of objectives that fall, as B or C
grow); the agent's tests check it with hypothesis.

GPU utilisation is never an input.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, StepShape, step_time_s
from crossflow_ctl.domain.models import (
    MAX_BYTES,
    MAX_MS,
    MAX_RATE_TPS,
    MAX_TOKENS,
    Credits,
    Frozen,
    Lease,
    PoolLoad,
    ZeroReason,
)
from crossflow_ctl.domain.telemetry import EngineSnapshot

Fraction = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


class ItlQuantile(StrEnum):
    P50 = "p50"
    P99 = "p99"


class LeaseSettings(Frozen):
    """The agent's lease policy: SLO, horizon, margins and reserves."""

    itl_slo_ms: Annotated[float, Field(gt=0.0, le=10_000.0, allow_inf_nan=False)] = 50.0
    """Decode inter-token latency target."""
    slo_margin: Fraction = 0.9
    """Predicted step time must stay under ``itl_slo_ms * slo_margin``."""
    itl_quantile: ItlQuantile = ItlQuantile.P99
    """Which observed ITL quantile is held against the SLO and reported in the lease."""
    horizon_ms: Annotated[int, Field(gt=0, le=600_000)] = 2_000
    """Borrow horizon: how long borrowed work taken on now may run."""
    chunk_step_tokens: Annotated[int, Field(gt=0, le=65_536)] = 256
    max_chunk_tokens: Annotated[int, Field(gt=0, le=1_048_576)] = 16_384
    kv_reserve_fraction: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.05
    kv_growth_tokens_per_request: Annotated[int, Field(ge=0, le=1_000_000)] = 256
    borrowed_context_tokens: Annotated[int, Field(gt=0, le=10_000_000)] = 4_096
    """Assumed context length of a borrowed request once it decodes on the node."""
    borrowed_prefix_tokens: Annotated[int, Field(ge=0, le=10_000_000)] = 8_192
    """Assumed cached prefix a borrowed prompt's chunk attends to. Chunk sizing ignoring it
    under-predicts the step (the simulator saw 5-14k-token prefixes push ITL past the SLO)."""
    max_slots: Annotated[int, Field(gt=0, le=256)] = 8
    kv_transfer_share: Fraction = 1.0
    """Share of the node's network bandwidth borrowed requests may use for KV pulls."""
    stale_after_ms: Annotated[int, Field(gt=0, le=600_000)] = 1_000
    """A snapshot older than this gives a TELEMETRY_STALE zero lease."""
    itl_clear_ratio: Fraction = 0.8
    """After an ITL trip, ITL must fall below ``itl_slo_ms * itl_clear_ratio`` ..."""
    itl_clear_after: Annotated[int, Field(gt=0, le=1000)] = 3
    """... for this many consecutive snapshots before credit is offered again."""

    @model_validator(mode="after")
    def _grid_fits(self) -> LeaseSettings:
        if self.chunk_step_tokens > self.max_chunk_tokens:
            raise ValueError("chunk_step_tokens must not exceed max_chunk_tokens")
        return self

    @property
    def budget_s(self) -> float:
        return self.itl_slo_ms / 1000.0 * self.slo_margin

    @property
    def horizon_s(self) -> float:
        return self.horizon_ms / 1000.0


class CapacityBreakdown(Frozen):
    """The credits and every intermediate figure behind them (for ``inspect`` and tests)."""

    batch: int
    context_tokens: int
    budget_s: float
    base_step_s: float
    """Predicted decode step time with no borrowed work."""
    decode_throughput_tps: float
    """Predicted output tokens/s at the current batch: ``B / base_step_s``."""
    chunk_tokens: int
    """Borrowed prefill chunk per step (0: none fits)."""
    chunk_step_s: float
    borrowed_prefill_rate_tps: float
    outstanding_tokens: int
    queue_wait_ms: float
    kv_free_tokens: int
    kv_reserve_tokens: int
    extra_batch: int
    """Borrowed requests the decode batch can take on (slots before the cap)."""
    output_step_s: float
    credits: Credits

    def explain(self, settings: LeaseSettings) -> list[str]:
        """The arithmetic, one line per figure."""
        h = settings.horizon_s
        c = self.credits
        return [
            f"budget = slo {settings.itl_slo_ms:g} ms x margin {settings.slo_margin:g}"
            f" = {self.budget_s * 1e3:.2f} ms",
            f"decode step t(B={self.batch}, C={self.context_tokens}, P=0)"
            f" = {self.base_step_s * 1e3:.2f} ms -> {self.decode_throughput_tps:.0f} tok/s",
            f"chunk P = {self.chunk_tokens} (best P/t(B,C,P;X) with t <= budget),"
            f" t = {self.chunk_step_s * 1e3:.2f} ms"
            f" -> borrowed prefill rate {self.borrowed_prefill_rate_tps:.0f} tok/s",
            f"compute = rate x horizon {h:g} s - outstanding {self.outstanding_tokens}"
            f" = {c.compute_tokens} tokens; queue wait {self.queue_wait_ms:.1f} ms",
            f"kv = free {self.kv_free_tokens} - reserve {self.kv_reserve_tokens}"
            f" = {c.kv_tokens} tokens",
            f"slots = extra batch b = {self.extra_batch} (cap {settings.max_slots})"
            f" -> {c.slots}; output = b x {h:g} s / t(B+b) {self.output_step_s * 1e3:.2f} ms"
            f" = {c.output_tokens} tokens",
            f"kv_transfer = min(net x horizon x share, kv x bytes/token)"
            f" = {c.kv_transfer_bytes} bytes",
        ]


def _t(
    model: ModelSpec, node: NodeProfile, batch: int, context: int, chunk: int, prefix: int = 0
) -> float:
    shape = StepShape(
        batch=batch,
        context_tokens=context,
        prefill_tokens=chunk,
        prefix_tokens=prefix if chunk else 0,
    )
    return step_time_s(model, node, shape)


def _best_chunk(
    model: ModelSpec, node: NodeProfile, settings: LeaseSettings, batch: int, context: int
) -> tuple[int, float, float]:
    """(chunk, its step time, its rate): the grid chunk with the best feasible rate."""
    best = (0, 0.0, 0.0)
    budget = settings.budget_s
    step = settings.chunk_step_tokens
    for chunk in range(step, settings.max_chunk_tokens + 1, step):
        t = _t(model, node, batch, context, chunk, settings.borrowed_prefix_tokens)
        if t > budget:
            break  # step time rises with the chunk: no larger chunk fits either
        rate = chunk / t
        if rate > best[2]:
            best = (chunk, t, rate)
    return best


def _extra_batch(
    model: ModelSpec, node: NodeProfile, settings: LeaseSettings, batch: int, context: int
) -> tuple[int, float, float]:
    """(largest feasible b, t at that b, best b / t over feasible b)."""
    largest, t_largest, best_rate = 0, 0.0, 0.0
    length = settings.borrowed_context_tokens
    for extra in range(1, settings.max_slots + 1):
        t = _t(model, node, batch + extra, context + extra * length, 0)
        if t > settings.budget_s:
            break
        largest, t_largest = extra, t
        best_rate = max(best_rate, extra / t)
    return largest, t_largest, best_rate


def compute_capacity(
    snapshot: EngineSnapshot, model: ModelSpec, node: NodeProfile, settings: LeaseSettings
) -> CapacityBreakdown:
    """The five credits and benefit fields from a plausible snapshot (see the module doc)."""
    batch = max(0, snapshot.running_requests)
    context = max(0, snapshot.decode_context_tokens)
    horizon_s = settings.horizon_s
    base = _t(model, node, batch, context, 0)
    throughput = batch / base if base > 0 else 0.0

    chunk, chunk_t, rate = _best_chunk(model, node, settings, batch, context)
    rate = min(rate, MAX_RATE_TPS)
    outstanding = max(0, snapshot.outstanding_uncached_tokens)
    compute = max(0, int(rate * horizon_s) - outstanding)
    if outstanding == 0:
        queue_wait_ms = 0.0
    elif rate > 0:
        queue_wait_ms = min(MAX_MS, outstanding / rate * 1000.0)
    else:
        queue_wait_ms = MAX_MS

    free = snapshot.kv_free_tokens
    reserve = int(
        settings.kv_reserve_fraction * snapshot.kv_total_tokens
        + settings.kv_growth_tokens_per_request * batch
    )
    kv = max(0, free - reserve)

    extra, extra_t, output_rate = _extra_batch(model, node, settings, batch, context)
    output = int(output_rate * horizon_s)

    network = node.network_bytes_per_s * horizon_s * settings.kv_transfer_share
    transfer = int(min(network, kv * model.kv_bytes_per_token, MAX_BYTES))

    credits = Credits(
        compute_tokens=min(compute, MAX_TOKENS),
        kv_tokens=min(kv, MAX_TOKENS),
        kv_transfer_bytes=transfer,
        output_tokens=min(output, MAX_TOKENS),
        slots=extra,
    )
    return CapacityBreakdown(
        batch=batch,
        context_tokens=context,
        budget_s=settings.budget_s,
        base_step_s=base,
        decode_throughput_tps=throughput,
        chunk_tokens=chunk,
        chunk_step_s=chunk_t,
        borrowed_prefill_rate_tps=rate,
        outstanding_tokens=outstanding,
        queue_wait_ms=queue_wait_ms,
        kv_free_tokens=free,
        kv_reserve_tokens=reserve,
        extra_batch=extra,
        output_step_s=extra_t,
        credits=credits,
    )


# -- zero-lease rules ----------------------------------------------------------------------------


def implausibility(snapshot: EngineSnapshot) -> str:
    """Why a snapshot cannot be trusted ("" when it can)."""
    numbers = snapshot.numbers()
    for name, value in numbers.items():
        if not math.isfinite(value):
            return f"{name} is {value}"
        if value < 0:
            return f"{name} is negative ({value:g})"
        if name.endswith(("_tokens", "_requests")) and value > MAX_TOKENS * 100:
            return f"{name} is absurd ({value:g})"
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


class ItlGuard(Frozen):
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
            return self.model_copy(update={"last_itl_ms": last})
        below = itl_ms is None or itl_ms < settings.itl_slo_ms * settings.itl_clear_ratio
        streak = self.good_streak + 1 if below else 0
        if streak >= settings.itl_clear_after:
            return ItlGuard(last_itl_ms=last)
        return ItlGuard(tripped=True, good_streak=streak, last_itl_ms=last)


class LeaseDecision(Frozen):
    """What the agent will publish for one snapshot, before epoch/version are stamped."""

    credits: Credits = Credits()
    zero_reason: ZeroReason | None = None
    zero_detail: str = ""
    queue_wait_ms: float = 0.0
    borrowed_prefill_rate_tps: float = 0.0
    itl_ms: float = 0.0
    itl_slo_ms: float = 0.0
    snapshot_unix_ms: int = 0
    guard: ItlGuard = ItlGuard()
    capacity: CapacityBreakdown | None = None

    def to_lease(
        self, *, node_id: str, epoch: int, version: int, ttl_ms: int, last_notice_seq: int
    ) -> Lease:
        return Lease(
            node_id=node_id,
            epoch=epoch,
            version=version,
            ttl_ms=ttl_ms,
            credits=self.credits if self.zero_reason is None else Credits(),
            zero_reason=self.zero_reason,
            zero_detail=self.zero_detail[:512],
            queue_wait_ms=self.queue_wait_ms,
            borrowed_prefill_rate_tps=self.borrowed_prefill_rate_tps,
            itl_ms=self.itl_ms,
            itl_slo_ms=self.itl_slo_ms,
            last_notice_seq=last_notice_seq,
            snapshot_unix_ms=max(0, self.snapshot_unix_ms),
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
) -> LeaseDecision:
    """Apply the zero-lease rules in order, then the capacity model.

    Order: no snapshot (the scrape failed: ``failure`` says why; ``failure_reason`` is
    TELEMETRY_MISSING, or TELEMETRY_IMPLAUSIBLE for values no snapshot can hold) -> stale ->
    implausible -> cordoned -> ITL over SLO (hysteresis) -> no capacity. The ITL guard
    advances only on fresh, plausible snapshots.
    """
    slo = settings.itl_slo_ms
    if snapshot is None:
        return LeaseDecision(
            zero_reason=failure_reason,
            zero_detail=failure or "no telemetry snapshot",
            itl_slo_ms=slo,
            guard=guard,
        )
    base = LeaseDecision(itl_slo_ms=slo, snapshot_unix_ms=snapshot.taken_at_ms, guard=guard)
    age_ms = now_ms - snapshot.taken_at_ms
    if age_ms > settings.stale_after_ms:
        return base.model_copy(
            update={
                "zero_reason": ZeroReason.TELEMETRY_STALE,
                "zero_detail": f"snapshot is {age_ms} ms old (limit {settings.stale_after_ms})",
            }
        )
    why = implausibility(snapshot)
    if why:
        return base.model_copy(
            update={"zero_reason": ZeroReason.TELEMETRY_IMPLAUSIBLE, "zero_detail": why}
        )
    itl = observed_itl_ms(snapshot, settings)
    guard = guard.observe(itl, settings, idle=snapshot.running_requests == 0)
    itl = guard.last_itl_ms  # this window's ITL, or the last one measured while busy
    capacity = compute_capacity(snapshot, model, node, settings)
    fields = {
        "guard": guard,
        "itl_ms": _clamp_ms(itl),
        "capacity": capacity,
        "queue_wait_ms": capacity.queue_wait_ms,
        "borrowed_prefill_rate_tps": capacity.borrowed_prefill_rate_tps,
    }
    decision = base.model_copy(update=fields)
    if cordoned:
        return decision.model_copy(
            update={"zero_reason": ZeroReason.CORDONED, "zero_detail": "cordoned by the broker"}
        )
    if guard.tripped:
        return decision.model_copy(
            update={
                "zero_reason": ZeroReason.ITL_OVER_SLO,
                "zero_detail": f"itl {settings.itl_quantile.value} {_clamp_ms(itl):.1f} ms,"
                f" slo {slo:g} ms (clears after {settings.itl_clear_after} below"
                f" {slo * settings.itl_clear_ratio:g} ms; streak {guard.good_streak})",
            }
        )
    c = capacity.credits
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
    if short:
        return decision.model_copy(
            update={
                "zero_reason": ZeroReason.NO_CAPACITY,
                "zero_detail": "no room on " + ", ".join(short),
            }
        )
    return decision.model_copy(update={"credits": c})


def pool_load(
    snapshot: EngineSnapshot | None,
    *,
    now_ms: int,
    node_id: str,
    pool: str,
    ttl_ms: int,
    settings: LeaseSettings,
) -> PoolLoad | None:
    """A prefill server's load report, or None when its telemetry is missing, stale or odd.

    Sending nothing is the fail-closed choice: the broker's pool load then expires and the
    demand test fails (DESIGN.md §4).
    """
    if snapshot is None or now_ms - snapshot.taken_at_ms > settings.stale_after_ms:
        return None
    if implausibility(snapshot):
        return None
    rate = min(MAX_RATE_TPS, snapshot.prefill_processing_rate_tps or snapshot.prompt_rate_tps)
    per_request = rate / snapshot.running_requests if snapshot.running_requests > 0 else 0.0
    return PoolLoad(
        pool=pool,
        node_id=node_id,
        outstanding_uncached_tokens=snapshot.outstanding_uncached_tokens,
        processing_rate_tps=rate,
        prefill_rate_tps=per_request,
        ttl_ms=ttl_ms,
        queued_requests=min(snapshot.queued_requests, 10_000_000),
    )
