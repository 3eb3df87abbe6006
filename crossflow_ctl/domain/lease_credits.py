"""The credits a decode node can offer, from one telemetry snapshot (the lease arithmetic).

Pure code, shared by the agent and the simulator. Inputs: an :class:`EngineSnapshot`, the served
:class:`ModelSpec`, the node's :class:`NodeProfile`, the agent's :class:`LeaseSettings` and what it
knows of the debits the broker still counts (:class:`~crossflow_ctl.domain.lending.OpenDebits`).

The arithmetic (B = running requests, C = sum of their contexts, ``t(b, c, P; X)`` the roofline
step time of :mod:`crossflow_ctl.domain.capacity`, H = borrow horizon in seconds, X_ref =
``borrowed_prefix_tokens``):

* **budget** ``= itl_slo_ms / 1000 * slo_margin``: the longest step the node may run.
* **chunk**: among grid chunks P (multiples of ``chunk_step_tokens`` up to
  ``max_chunk_tokens``) with ``t(B, C, P; X) <= budget``, the one with the best ``P / t``.
  Engines size each borrowed chunk for the prompt's prefix X this way, step by step
  (:class:`~crossflow_ctl.domain.lending.ChunkSizer`).
* **per-token cost**: ``a + b * x`` seconds per uncached token at attended context x, the line
  through the per-token time of the best chunk with no prefix and with a long one
  (:func:`~crossflow_ctl.domain.lending.prefill_coefficients`), carried in the lease so the broker
  prices each prompt by its prefix.
* **rate** ``= 1 / (a + b * X_ref)``: the borrowed-prefill rate of a prompt over the reference
  prefix; the compute credit's unit.
* **compute** ``= rate * (H - uncovered_s)``: borrowed prefill the node can run within the
  horizon, in the credit's one unit, tokens at ``rate`` (node seconds x ``rate``; the broker's
  debits are in it too, :func:`~crossflow_ctl.domain.lending.compute_debit`). Telemetry counts
  the borrowed work queued on the node in raw uncached tokens, so what the broker's open debits
  already count is taken off in that unit: ``covered`` is at most the open reservations' own
  uncached tokens (:meth:`~crossflow_ctl.domain.lending.OpenDebits.uncached_tokens`), never
  their compute debits, which are priced at each prompt's prefix and would excuse other work
  (long prefixes) or count a prompt twice (short ones). What is left, ``uncovered`` raw tokens
  of work the broker does not count (a reservation that expired while running, borrowing that
  bypassed the broker), has prefixes telemetry does not tell; it is costed on the safe side, at
  ``LeaseSettings.unknown_prefix_tokens`` of prefix (``FAR_PREFIX_TOKENS``, past the p90 of real
  agent prefixes and up to about twice the reference cost, or the reference prefix if longer),
  as ``uncovered_s = uncovered * (a + b * unknown_prefix_tokens)`` node seconds.
  ``queue_wait_ms = uncovered_s * 1000``, the same split: the broker adds the wait of its own
  open debits (:func:`~crossflow_ctl.domain.lending.queue_wait_ms`), which grows with every
  grant between two leases.
* **kv** ``= free - reserve - promised + covered_kv`` with ``free = total - used`` and
  ``reserve = kv_reserve_fraction * total + kv_growth_tokens_per_request * B`` (room for the
  running requests' next output tokens, borrowed ones included once they decode);
  ``promised`` is the KV of the requests waiting for KV room (transferred from the prefill
  pool, queued by the engine but not yet given KV): the engine hands what frees to its waiting
  queue in order, so a prompt granted now gets KV only after them
  (:func:`promised_kv_tokens`: the engine's figure, or ``waiting_request_kv_tokens`` each);
  ``covered_kv`` is the KV that borrowed requests still in prefill hold, up to what the open
  debits count (the broker subtracts those debits).
* **slots** and **output**: a borrowed request stays and decodes on the node with an assumed
  context of ``borrowed_context_tokens`` L. Adding b of them is feasible when
  ``t(B + b, C + b*L, 0) <= budget``; slots is the largest feasible b (at most ``max_slots``, a
  bound on the engine's queue of borrowed prompts) and ``output_tokens = b * H / t(B + b, ...)``.
* **kv_transfer**: ``network_bytes_per_s * H * kv_transfer_share``, capped by the KV credit in
  bytes (no use pulling in more KV than there is room for).

A lease needs compute, kv, slots and output all above zero to be useful; otherwise
:func:`crossflow_ctl.domain.leasing.decide` makes it a zero lease with reason NO_CAPACITY.
Every credit is non-increasing in B, C and the KV promised to the waiting queue, and
non-decreasing in the SLO (the feasible sets shrink as B or C grow); the agent's tests check it
with hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, NamedTuple

from pydantic import Field, model_validator

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, Roofline, roofline
from crossflow_ctl.domain.identity import ByIdentity
from crossflow_ctl.domain.lending import (
    FAR_PREFIX_TOKENS,
    OpenDebits,
    PrefillCoefficients,
    best_chunk,
    fit_along,
    prefill_coefficients,
)
from crossflow_ctl.domain.models import (
    MAX_BYTES,
    MAX_HORIZON_MS,
    MAX_MS,
    MAX_RATE_TPS,
    MAX_S_PER_TOKEN,
    MAX_S_PER_TOKEN_CONTEXT,
    MAX_TOKENS,
    Credits,
    Frozen,
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
    horizon_ms: Annotated[int, Field(gt=0, le=MAX_HORIZON_MS)] = 8_000
    """Borrow horizon: how long borrowed work taken on now may run. The broker's policy
    (``PolicySettings.borrow_horizon_ms``, same default) sends its own in every Welcome and the
    agent sizes its leases over that; this value serves only until a broker has sent one."""
    chunk_step_tokens: Annotated[int, Field(gt=0, le=65_536)] = 256
    max_chunk_tokens: Annotated[int, Field(gt=0, le=1_048_576)] = 16_384
    kv_reserve_fraction: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.05
    kv_growth_tokens_per_request: Annotated[int, Field(ge=0, le=1_000_000)] = 256
    waiting_request_kv_tokens: Annotated[int, Field(ge=0, le=10_000_000)] = 32_768
    """KV (prompt + output) each request waiting for KV room is taken to need when the engine
    tells only how many wait (vLLM): on the safe side, past the p90 of Mooncake's requests
    (27.7 k); agent workloads with longer contexts should set their own."""
    borrowed_context_tokens: Annotated[int, Field(gt=0, le=10_000_000)] = 4_096
    """Assumed context length of a borrowed request once it decodes on the node."""
    borrowed_prefix_tokens: Annotated[int, Field(ge=0, le=10_000_000)] = 8_192
    """Reference prefix: the lease's rate and chunk are quoted for a prompt over this many cached
    tokens (the compute credit's unit). Each prompt is priced at its own prefix through the
    lease's per-token coefficients."""
    max_slots: Annotated[int, Field(gt=0, le=4096)] = 64
    """Cap on borrowed prompts at once (the engine's borrowed queue); the decode batch's room,
    which usually binds first, sets the slots below it."""
    prefill_chunk_tokens: Annotated[int, Field(gt=0, le=1_048_576)] = 8_192
    """Prefill role: the server's chunked-prefill size, for its modelled prefill rate
    (:func:`~crossflow_ctl.domain.leasing.pool_load`)."""
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

    @property
    def unknown_prefix_tokens(self) -> int:
        """The prefix queued borrowed work no open debit counts is costed at (telemetry does
        not tell its prefixes): far out on the cost line, never below the reference prefix."""
        return max(FAR_PREFIX_TOKENS, self.borrowed_prefix_tokens)


class CapacityBreakdown(NamedTuple):
    """The credits and every intermediate figure behind them (for ``inspect`` and tests)."""

    batch: int
    context_tokens: int
    budget_s: float
    base_step_s: float
    """Predicted decode step time with no borrowed work."""
    decode_throughput_tps: float
    """Predicted output tokens/s at the current batch: ``B / base_step_s``."""
    chunk_tokens: int
    """Best borrowed prefill chunk per step with no prefix (0: none fits)."""
    chunk_step_s: float
    borrowed_prefill_rate_tps: float
    coefficients: PrefillCoefficients
    far_chunk_tokens: int
    """Best borrowed prefill chunk per step over ``FAR_PREFIX_TOKENS`` of prefix, the second
    point of the cost line (0: none fits, or no line)."""
    outstanding_tokens: int
    """Borrowed uncached tokens queued on the node (telemetry; raw tokens)."""
    covered_tokens: int
    """Part of them the broker's open debits already count (raw tokens)."""
    queue_wait_ms: float
    kv_free_tokens: int
    kv_reserve_tokens: int
    kv_covered_tokens: int
    """KV held by borrowed requests in prefill that the open debits already count."""
    kv_promised_tokens: int
    """KV the requests waiting for KV room will take first (told, or estimated per request)."""
    extra_batch: int
    """Borrowed requests the decode batch can take on (slots before the cap)."""
    output_step_s: float
    credits: Credits

    def as_dict(self) -> dict[str, Any]:
        out = self._asdict()
        out["coefficients"] = self.coefficients._asdict()
        out["credits"] = self.credits.model_dump()
        return out

    def explain(self, settings: LeaseSettings) -> list[str]:
        """The arithmetic, one line per figure."""
        h = settings.horizon_s
        c = self.credits
        return [
            f"budget = slo {settings.itl_slo_ms:g} ms x margin {settings.slo_margin:g}"
            f" = {self.budget_s * 1e3:.2f} ms",
            f"decode step t(B={self.batch}, C={self.context_tokens}, P=0)"
            f" = {self.base_step_s * 1e3:.2f} ms -> {self.decode_throughput_tps:.0f} tok/s",
            f"chunk P = {self.chunk_tokens} (best P/t with t(B,C,P;X=0) <= budget),"
            f" t = {self.chunk_step_s * 1e3:.2f} ms",
            f"per-token cost = a {self.coefficients.a_s * 1e6:.3f} us"
            f" + b {self.coefficients.b_s * 1e9:.4f} ns x attended context",
            f"rate = 1 / (a + b x {settings.borrowed_prefix_tokens})"
            f" = {self.borrowed_prefill_rate_tps:.0f} tok/s",
            f"compute = rate x (horizon {h:g} s - queue wait {self.queue_wait_ms:.1f} ms:"
            f" outstanding {self.outstanding_tokens} - covered by open reservations"
            f" {self.covered_tokens} tokens, costed at a"
            f" {settings.unknown_prefix_tokens}-token prefix)"
            f" = {c.compute_tokens} tokens",
            f"kv = free {self.kv_free_tokens} - reserve {self.kv_reserve_tokens}"
            f" - promised to the waiting queue {self.kv_promised_tokens}"
            f" + covered {self.kv_covered_tokens} = {c.kv_tokens} tokens",
            f"slots = extra batch b = {self.extra_batch} (cap {settings.max_slots})"
            f" -> {c.slots}; output = b x {h:g} s / t(B+b) {self.output_step_s * 1e3:.2f} ms"
            f" = {c.output_tokens} tokens",
            f"kv_transfer = min(net x horizon x share, kv x bytes/token)"
            f" = {c.kv_transfer_bytes} bytes",
        ]


def _extra_batch(
    roof: Roofline,
    budget: float,
    batch: int,
    context: int,
    length: int,
    cap: int,
    base: float,
    guess: int = 0,
) -> tuple[int, float]:
    """(largest b <= cap with ``t(batch + b, context + b * length) <= budget``, t at that b;
    ``guess``: a likely b, which changes nothing but the work: :func:`fit_along`)."""
    if 1 < guess <= cap:
        # The usual case, a period after the last answer: the guess still fits and one more
        # does not (or the guess is the cap). The very evaluations and answer of the search
        # that follows, without its bookkeeping.
        t = roof.step_s(batch + guess, context + guess * length)
        if t <= budget:
            if guess == cap:
                return guess, t
            n = guess + 1
            if roof.step_s(batch + n, context + n * length) > budget:
                return guess, t
    n, seen = fit_along(roof, budget, batch, context, 0, 1, length, 0, cap, base, guess)
    return (n, seen[n]) if n else (0, 0.0)


def promised_kv_tokens(snapshot: EngineSnapshot, settings: LeaseSettings) -> int:
    """KV the requests waiting for KV room will take before anything granted now: what the
    engine tells, else ``waiting_request_kv_tokens`` for each (see :class:`EngineSnapshot`)."""
    if snapshot.kv_waiting_tokens is not None:
        return max(0, snapshot.kv_waiting_tokens)
    return max(0, snapshot.kv_waiting_requests) * settings.waiting_request_kv_tokens


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """What :func:`compute_capacity` reads from the model, the node and the settings, worked
    out once for the three (:func:`lease_terms`): the agent and the simulator size a lease
    every period with the same ones."""

    roof: Roofline
    budget_s: float
    horizon_s: float
    step: int
    max_chunk: int
    prefix_tokens: int
    """The reference prefix (``borrowed_prefix_tokens``)."""
    unknown_prefix_tokens: int
    kv_bytes_per_token: int
    transfer_bytes: float
    """The node's KV pull bandwidth over the horizon, at the borrowable share."""

    @classmethod
    def of(cls, model: ModelSpec, node: NodeProfile, settings: LeaseSettings) -> LeaseTerms:
        horizon_s = settings.horizon_s
        return cls(
            roof=roofline(model, node),
            budget_s=settings.budget_s,
            horizon_s=horizon_s,
            step=settings.chunk_step_tokens,
            max_chunk=settings.max_chunk_tokens,
            prefix_tokens=settings.borrowed_prefix_tokens,
            unknown_prefix_tokens=settings.unknown_prefix_tokens,
            kv_bytes_per_token=model.kv_bytes_per_token,
            transfer_bytes=node.network_bytes_per_s * horizon_s * settings.kv_transfer_share,
        )


_TERMS: ByIdentity[LeaseTerms] = ByIdentity(LeaseTerms.of)


def lease_terms(model: ModelSpec, node: NodeProfile, settings: LeaseSettings) -> LeaseTerms:
    """The :class:`LeaseTerms` of the three, looked up by identity as
    :func:`~crossflow_ctl.domain.capacity.roofline` is (all three are frozen); the last three
    asked for are checked first (an agent asks with the same ones every period)."""
    global _last_terms
    last = _last_terms
    if last is not None and last[0] is model and last[1] is node and last[2] is settings:
        return last[3]
    terms = _TERMS.get(model, node, settings)
    _last_terms = (model, node, settings, terms)
    return terms


_last_terms: tuple[ModelSpec, NodeProfile, LeaseSettings, LeaseTerms] | None = None
"""The last three :func:`lease_terms` was asked for and their terms (it keeps them alive, so
their ids are not reused while they are here)."""


def compute_capacity(
    snapshot: EngineSnapshot,
    model: ModelSpec,
    node: NodeProfile,
    settings: LeaseSettings,
    open_debits: OpenDebits | None = None,
    previous: CapacityBreakdown | None = None,
) -> CapacityBreakdown:
    """The five credits and benefit fields from a plausible snapshot (see the module doc).
    ``previous``: the breakdown a period ago, whose chunk and extra batch seed this one's
    searches (the same answers, usually sooner: :func:`~crossflow_ctl.domain.lending.fit_along`)."""
    terms = lease_terms(model, node, settings)
    roof, budget, horizon_s = terms.roof, terms.budget_s, terms.horizon_s
    batch = max(0, snapshot.running_requests)
    context = max(0, snapshot.decode_context_tokens)
    base = roof.step_s(batch, context)
    throughput = batch / base if base > 0 else 0.0

    step, max_chunk = terms.step, terms.max_chunk
    chunk, chunk_t = (0, 0.0)
    if base <= budget:
        guess = previous.chunk_tokens if previous is not None else 0
        chunk, chunk_t = best_chunk(roof, budget, batch, context, 0, step, max_chunk, base, guess)
    coeff, far = prefill_coefficients(
        roof, budget, batch, context, chunk, chunk_t, base, step, max_chunk,
        previous.far_chunk_tokens if previous is not None else 0,
    )  # fmt: skip
    if coeff.a_s > MAX_S_PER_TOKEN or coeff.b_s > MAX_S_PER_TOKEN_CONTEXT:
        coeff = PrefillCoefficients(
            a_s=min(coeff.a_s, MAX_S_PER_TOKEN), b_s=min(coeff.b_s, MAX_S_PER_TOKEN_CONTEXT)
        )
    a_s, b_s = coeff
    per_token = a_s + b_s * terms.prefix_tokens
    rate = min(1.0 / per_token, MAX_RATE_TPS) if chunk and per_token > 0 else 0.0
    outstanding = max(0, snapshot.outstanding_uncached_tokens)
    reserved = open_debits.uncached_tokens(terms.kv_bytes_per_token) if open_debits else 0
    covered = min(outstanding, reserved)
    uncovered = outstanding - covered
    uncovered_s = uncovered * (a_s + b_s * terms.unknown_prefix_tokens)
    compute = max(0, int(rate * (horizon_s - uncovered_s)))
    if uncovered == 0:
        queue_wait_ms = 0.0
    elif rate > 0:
        queue_wait_ms = min(MAX_MS, uncovered_s * 1000.0)
    else:
        queue_wait_ms = MAX_MS

    free = snapshot.kv_free_tokens
    reserve = int(
        settings.kv_reserve_fraction * snapshot.kv_total_tokens
        + settings.kv_growth_tokens_per_request * batch
    )
    promised = promised_kv_tokens(snapshot, settings)
    held = max(0, snapshot.borrowed_kv_tokens)
    kv_covered = min(held, max(0, open_debits.kv)) if open_debits else 0
    kv = max(0, free - reserve - promised + kv_covered)

    extra, extra_t = (0, 0.0)
    if base <= budget:
        extra, extra_t = _extra_batch(
            roof, budget, batch, context, settings.borrowed_context_tokens,
            settings.max_slots, base, previous.extra_batch if previous is not None else 0,
        )  # fmt: skip
    output = int(extra * horizon_s / extra_t) if extra else 0
    transfer = int(min(terms.transfer_bytes, kv * terms.kv_bytes_per_token, MAX_BYTES))

    credits = Credits.trusted(
        compute_tokens=min(compute, MAX_TOKENS),
        kv_tokens=min(kv, MAX_TOKENS),
        kv_transfer_bytes=transfer,
        output_tokens=min(output, MAX_TOKENS),
        slots=extra,
    )
    return CapacityBreakdown(
        batch=batch,
        context_tokens=context,
        budget_s=budget,
        base_step_s=base,
        decode_throughput_tps=throughput,
        chunk_tokens=chunk,
        chunk_step_s=chunk_t,
        borrowed_prefill_rate_tps=rate,
        coefficients=coeff,
        far_chunk_tokens=far,
        outstanding_tokens=outstanding,
        covered_tokens=covered,
        queue_wait_ms=queue_wait_ms,
        kv_free_tokens=free,
        kv_reserve_tokens=reserve,
        kv_covered_tokens=kv_covered,
        kv_promised_tokens=promised,
        extra_batch=extra,
        output_step_s=extra_t,
        credits=credits,
    )
