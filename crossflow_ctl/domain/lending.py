"""What borrowed prompt work costs a decode node, and which of it the broker already counts.

Pure helpers shared by the lease rules (:mod:`crossflow_ctl.domain.leasing`), the admission
policy's debit (:func:`crossflow_ctl.domain.admission.debit_for`) and the simulator's engine.

**Chunks.** A decode step that carries a borrowed prefill chunk of P uncached tokens over a prefix
of X tokens takes ``t(B, C, P; X)`` and every decode request waits for it, so the engine runs
the best-rate chunk (on the grid of multiples of ``step``) with ``t <= budget``
(:func:`best_chunk`; :class:`ChunkSizer` per prompt). Step time rises with P, so the feasible
chunks are a prefix of the grid and a secant search finds its end in a few step-time
evaluations (:func:`fit_along`).

**Per-token cost.** Borrowed prefill runs back to back in such chunks, so a token of a prompt
whose attended context is x (cached prefix + tokens already done) costs about ``budget / P(x)``
seconds of the node's time, and with step time near-linear in P and x that is linear in x:
``cost_s(U, X) = U * (a + b * (X + U/2))`` for U uncached tokens over a cached prefix X. The agent
measures ``a`` and ``b`` at its current decode load (:func:`prefill_coefficients`) and puts them in
the lease; the broker prices each prompt with them (:func:`compute_debit`).

**Counted once.** The agent's telemetry already shows borrowed work that reached the engine
(outstanding borrowed prompt tokens, the KV borrowed requests hold), while the broker keeps
counting each reservation's debit until it is released (and a causally later lease arrives,
DESIGN.md §5.4). :class:`OpenDebits` is the agent's view of the reservations the broker still
counts, built from its grant/release/expire notices; the lease adds back the part of the telemetry
those debits cover, so each borrowed request is subtracted once, by the broker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from crossflow_ctl.domain.capacity import Roofline
from crossflow_ctl.domain.models import (
    MAX_COMPUTE_US,
    MAX_MS,
    MAX_TOKENS,
    MICROS_PER_S,
    ComputeTime,
    Lease,
    Notice,
    NoticeKind,
    prefill_seconds,
)
from crossflow_ctl.domain.safety import UNTIMED


def fit_along(
    roof: Roofline,
    budget_s: float,
    batch: int,
    context: int,
    prefix: int,
    d_batch: int,
    d_context: int,
    d_chunk: int,
    top: int,
    t_zero: float,
    guess: int = 0,
) -> tuple[int, dict[int, float]]:
    """The largest n in [1, top] whose step fits: ``t(n) <= budget_s`` with ``t(n) =
    step_s(batch + n * d_batch, context + n * d_context, n * d_chunk, prefix)``, rising in n and
    ``t(0) = t_zero`` (0: not even n = 1 fits); and every t it evaluated, by n (the answer's
    among them, and n + 1's unless n = top).

    A secant through the two latest points guesses the crossing, kept strictly inside the
    bracket (lo, hi): two to four evaluations where a scan of the grid takes dozens. Written
    out, with no callback: the agent runs it three times a period (best chunk with no prefix
    and with a far one, the decode batch's room) and the simulator for every agent tick.

    ``guess``: a likely answer (the last one, a period ago): checked with two evaluations, n
    and n + 1 (or n - 1), before any search. The answer is the same whatever the guess (t
    rises in n, so one n fits with n + 1 not fitting), and so are the t's it returns: only
    how many it evaluates changes."""
    seen: dict[int, float] = {}
    if top < 1:
        return 0, seen
    step_s = roof.step_s
    if 1 < guess <= top:
        t_g = seen[guess] = step_s(
            batch + guess * d_batch, context + guess * d_context, guess * d_chunk, prefix
        )
        n = guess + 1 if t_g <= budget_s else guess - 1
        if n > top:
            return guess, seen
        t_n = seen[n] = step_s(batch + n * d_batch, context + n * d_context, n * d_chunk, prefix)
        if n > guess and t_n > budget_s:
            return guess, seen
        if n < guess and t_n <= budget_s:
            return n, seen
    t_lo = seen[1] = step_s(batch + d_batch, context + d_context, d_chunk, prefix)
    if t_lo > budget_s:
        return 0, seen
    lo, hi = 1, top + 1
    a_n, a_t, b_n, b_t = 0, t_zero, 1, t_lo
    while hi - lo > 1:
        slope = (b_t - a_t) / (b_n - a_n)
        n = hi - 1 if slope <= 0.0 else b_n + int((budget_s - b_t) / slope)
        if n >= hi:
            n = hi - 1
        elif n <= lo:
            n = lo + 1
        t_n = seen[n] = step_s(batch + n * d_batch, context + n * d_context, n * d_chunk, prefix)
        a_n, a_t, b_n, b_t = b_n, b_t, n, t_n
        if t_n <= budget_s:
            lo = n
        else:
            hi = n
    return lo, seen


def largest_chunk(
    roof: Roofline,
    budget_s: float,
    batch: int,
    context: int,
    prefix: int,
    step: int,
    max_chunk: int,
    base_s: float | None = None,
) -> tuple[int, float]:
    """(largest grid chunk P with ``t(batch, context, P; prefix) <= budget_s``, its step time);
    (0, 0.0) when not even one grid step fits. ``base_s`` is ``t(batch, context)`` if known."""
    base = roof.step_s(batch, context) if base_s is None else base_s
    n, seen = fit_along(roof, budget_s, batch, context, prefix, 0, 0, step, max_chunk // step, base)
    return (n * step, seen[n]) if n else (0, 0.0)


def best_chunk(
    roof: Roofline,
    budget_s: float,
    batch: int,
    context: int,
    prefix: int,
    step: int,
    max_chunk: int,
    base_s: float | None = None,
    guess: int = 0,
) -> tuple[int, float]:
    """(the grid chunk with the highest rate ``P / t`` among those within the budget, its t;
    ``guess``: a likely largest fitting chunk, which changes nothing but the work, see
    :func:`fit_along`).

    Usually the largest that fits (fixed step costs amortise over more tokens); when the
    chunk's attention, quadratic in P, dominates, the rate peaks below it: ``P / t(P)`` is
    unimodal in P, so a check one grid step down says which, and a ternary search finds the
    peak in the rare second case. The best rate over a set that shrinks as the load grows (or
    the budget tightens) never rises, which keeps every credit monotonic."""
    top, hint = max_chunk // step, guess // step
    if 0 < hint < top:
        # The usual case, a period after the last answer: the guess still fits, one grid step
        # more does not, and the rate still grows at the guess (the convexity check below; one
        # grid step is the answer when two do not fit). The very evaluations and answer of the
        # search that follows, without its bookkeeping.
        t_hint = roof.step_s(batch, context, hint * step, prefix)
        if t_hint <= budget_s:
            t_up = roof.step_s(batch, context, (hint + 1) * step, prefix)
            if t_up > budget_s and (hint == 1 or (t_up - t_hint) * hint <= t_hint):
                return hint * step, t_hint
    base = roof.step_s(batch, context) if base_s is None else base_s
    n, seen = fit_along(roof, budget_s, batch, context, prefix, 0, 0, step, top, base, hint)
    if n == 0:
        return 0, 0.0
    t = seen[n]
    if n == 1:
        return step, t
    above = seen.get(n + 1)
    if above is not None and (above - t) * n <= t:
        # step time is convex in the chunk here (a max of terms linear or quadratic in it), so
        # the rise from n - 1 is at most the rise to n + 1: the rate still grows at n
        return n * step, t

    def t_of(k: int) -> float:
        t_k = seen.get(k)
        if t_k is None:
            t_k = seen[k] = roof.step_s(batch, context, k * step, prefix)
        return t_k

    if (n - 1) / t_of(n - 1) <= n / t:
        return n * step, t
    lo, hi = 1, n - 1
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if m1 / t_of(m1) < m2 / t_of(m2):
            lo = m1 + 1
        else:
            hi = m2
    best = max(range(lo, hi + 1), key=lambda k: k / t_of(k))
    return best * step, t_of(best)


FINE_STEPS = 16
"""Below one grid step, chunks are sized in ``step // FINE_STEPS`` pieces (16 tokens for the
256-token grid: vLLM's KV block)."""


def fine_chunk(
    roof: Roofline,
    budget_s: float,
    batch: int,
    context: int,
    prefix: int,
    step: int,
    base_s: float | None = None,
) -> tuple[int, float]:
    """(the best chunk below one grid ``step``, in ``step // FINE_STEPS`` pieces, within the
    budget, its t); (0, 0.0) when not even one piece fits. Asked only when no grid chunk fits:
    over a long prefix (agent contexts past 80k tokens) with a padded MoE, one grid step alone
    can outlast the budget while a few pieces still fit."""
    fine = max(1, step // FINE_STEPS)
    if fine >= step:
        return 0, 0.0
    return best_chunk(roof, budget_s, batch, context, prefix, fine, step - fine, base_s)


@dataclass(frozen=True, slots=True)
class ChunkSizer:
    """An engine's borrowed-chunk rule: the best-rate grid chunk that keeps the step within the
    ITL budget for this prompt's prefix at the current decode load; when no grid chunk fits, the
    best smaller one (:func:`fine_chunk`); when none fits at all, no chunk (0: the step decodes
    only and the prompt waits for a lighter batch). The budget is never broken for borrowed
    work: with no decode request running there is no ITL to break, and the smallest piece runs,
    so work in hand always progresses."""

    roof: Roofline
    budget_s: float
    step: int
    max_chunk: int

    def chunk(self, batch: int, context: int, prefix: int, guess: int = 0) -> int:
        """The chunk for a prompt over ``prefix`` at this decode load (0: not this step);
        ``guess``: a likely one (the prompt's last), which changes nothing but the work
        (:func:`best_chunk`)."""
        size, _ = best_chunk(
            self.roof, self.budget_s, batch, context, prefix, self.step, self.max_chunk,
            guess=guess,
        )  # fmt: skip
        if size:
            return size
        size, _ = fine_chunk(self.roof, self.budget_s, batch, context, prefix, self.step)
        if size or batch > 0:
            return size
        return max(1, self.step // FINE_STEPS)


class PrefillCoefficients(NamedTuple):
    """Seconds of node time per borrowed uncached token: ``a + b * attended_context``."""

    a_s: float = 0.0
    b_s: float = 0.0

    def cost_s(self, uncached: int, cached: int) -> float:
        """Node seconds to prefill ``uncached`` tokens over a ``cached`` prefix."""
        return prefill_seconds(uncached, cached, self.a_s, self.b_s)


FAR_PREFIX_TOKENS = 40_960
"""Where the second point of the cost line is taken (real agent prefixes reach p90 18-36k)."""


def prefill_coefficients(
    roof: Roofline,
    budget_s: float,
    batch: int,
    context: int,
    chunk: int,
    chunk_s: float,
    base_s: float,
    step: int,
    max_chunk: int,
    far_guess: int = 0,
) -> tuple[PrefillCoefficients, int]:
    """``a`` and ``b`` at the current decode load: the line through the engine's per-token time
    with no prefix and with ``FAR_PREFIX_TOKENS`` of prefix, each run in its own best chunk (as
    :class:`ChunkSizer` does, below the grid when no grid chunk fits; one grid step when nothing
    fits the budget); and the best grid chunk over the far prefix (0: none fits, or no line:
    ``chunk`` is 0).

    ``chunk`` / ``chunk_s`` are the best chunk with no prefix and its step time; ``far_guess``:
    a likely best chunk over the far prefix (the last one), which changes nothing but the work
    (:func:`best_chunk`). Per-token time rises a little faster than linearly with the prefix at
    first, so the line over-prices prompts between the two points by up to ~15% (safe: the
    debit is a little high) and is close at both ends. Both points are non-decreasing in the
    load, with fixed weights, so the price of every prompt is too."""
    if chunk <= 0 or chunk_s <= 0.0:
        return PrefillCoefficients(), 0
    s0 = chunk_s / chunk
    best, t_far = best_chunk(
        roof, budget_s, batch, context, FAR_PREFIX_TOKENS, step, max_chunk, base_s, far_guess
    )
    far = best
    if far == 0:  # as the engine would run it: a smaller chunk, or one grid step at worst
        far, t_far = fine_chunk(roof, budget_s, batch, context, FAR_PREFIX_TOKENS, step, base_s)
    if far == 0:
        far, t_far = step, roof.step_s(batch, context, step, FAR_PREFIX_TOKENS)
    slope = max(0.0, (t_far / far - s0) / FAR_PREFIX_TOKENS)
    return PrefillCoefficients(a_s=s0, b_s=slope), best


class ComputeDebit(NamedTuple):
    """One prompt's compute debit: ``tokens`` in the lease's unit and the node time they stand
    for, ``us`` whole microseconds (0: untimed, the lease has no rate)."""

    tokens: int
    us: int


def compute_debit(
    uncached: int, cached: int, a_s: float, b_s: float, rate_tps: float
) -> ComputeDebit:
    """The compute credit one prompt takes: its node seconds x the lease's borrowed-prefill rate.

    The compute credit counts *tokens at the lease's rate* (seconds of borrowed prefill x
    ``rate_tps``), and that rate changes lease by lease, so the debit keeps its node time too:
    ``us``, the prompt's seconds (``prefill_seconds`` with the lease's coefficients; ``uncached
    / rate_tps`` for a lease without them) in whole microseconds (at least one; rounded down, so
    a prompt over the reference prefix still debits its own uncached tokens: the cost is a
    microsecond short at most, a few thousandths of a token), and ``tokens``, that time at the
    lease's rate rounded up, the very conversion Safety applies to open debits under a later
    lease (:meth:`~crossflow_ctl.domain.models.ComputeTime.tokens_at`). A lease without a rate
    prices every token alike: the uncached tokens, untimed."""
    if rate_tps <= 0.0 or uncached <= 0:
        return ComputeDebit(uncached, 0)
    seconds = prefill_seconds(uncached, cached, a_s, b_s) if a_s > 0.0 else uncached / rate_tps
    us = min(MAX_COMPUTE_US, max(1, math.floor(seconds * MICROS_PER_S + 1e-6)))
    return ComputeDebit(min(MAX_TOKENS, math.ceil(us * rate_tps / MICROS_PER_S)), us)


def queue_wait_ms(
    lease: Lease, open_compute_tokens: int, open_time: ComputeTime = UNTIMED
) -> float:
    """How long a prompt borrowed on this node now waits before its first chunk: the lease's
    wait for the queued borrowed work the broker does not count, plus the broker's open
    compute debits run on the node: their node time (``open_time``), and the untimed ones'
    tokens at the lease's rate. Each reservation granted since the lease lengthens the wait, so
    prompts admitted within one lease period spread over the nodes instead of queueing on the
    one the lease made look idle."""
    rate = lease.borrowed_prefill_rate_tps
    untimed = max(0, open_compute_tokens - open_time.tokens)
    if untimed == 0 and open_time.us <= 0:
        return lease.queue_wait_ms
    if rate <= 0.0:
        return MAX_MS
    open_s = open_time.us / MICROS_PER_S + untimed / rate
    return min(MAX_MS, lease.queue_wait_ms + open_s * 1000.0)


@dataclass(slots=True)
class OpenDebits:
    """The reservations the broker still counts against this node, as its notices tell.

    GRANT opens one (with its debit), RELEASE and EXPIRE close it; COMMIT changes nothing the
    broker counts. ``kv`` and ``output`` are the sums of the open debits' kv and output credits,
    ``pulled_tokens`` and ``transfer_bytes`` their kv_transfer credits (a prefix pulled in from
    elsewhere): what the lease needs to take off the work telemetry shows in telemetry's own
    units (KV slots, raw uncached tokens). Their compute debits are in the credit's unit, priced
    at each prompt's prefix, and are the broker's to subtract. Feed each notice once (the agent
    skips sequence numbers it has seen)."""

    debits: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    """Each open reservation's kv, output, pulled-in tokens and unread transfer bytes."""
    kv_bytes_per_token: int = 0
    """The broker's KV bytes per token, the unit of its debits' kv_transfer (from its Welcome or
    SessionSettings; 0: not told, the served model's is used), for a GRANT that does not carry
    its pulled-in tokens (a broker before ``Notice.pulled_tokens``). The broker's policy and the
    agent's model are configured apart: dividing by the wrong one turns pulled-in prefix into
    uncached work. Even the broker's is only the current one: a grant priced by a replica still
    on the previous policy, or read after the agent took the next, is read in the wrong unit,
    which is why a grant's own ``pulled_tokens`` wins."""
    kv: int = 0
    output: int = 0
    pulled_tokens: int = 0
    """Tokens of the prefixes the open debits pull in: each GRANT's own (``pulled``), or its
    bytes read at the GRANT in the broker's unit then (so a later change of the unit does not
    re-read open grants in the new one)."""
    transfer_bytes: int = 0
    """The kv_transfer bytes of the open debits granted while the broker's unit was unknown:
    read at lease time, in the unit known then (the served model's if none)."""

    def record(
        self,
        kind: NoticeKind,
        reservation_id: str,
        kv: int,
        output: int,
        transfer_bytes: int,
        pulled: int | None = None,
    ) -> None:
        """Feed one notice's debit; ``pulled``: the prefix tokens a GRANT says it pulls in
        (``Notice.pulled_tokens``; None: not told, its bytes are read in the broker's unit)."""
        if kind is NoticeKind.GRANT and reservation_id not in self.debits:
            unit = self.kv_bytes_per_token
            if pulled is not None:
                unread = 0
            elif unit > 0:
                pulled, unread = -(-transfer_bytes // unit), 0
            else:
                pulled, unread = 0, transfer_bytes
            self.debits[reservation_id] = (kv, output, pulled, unread)
            self._add(kv, output, pulled, unread)
        elif kind is NoticeKind.RELEASE or kind is NoticeKind.EXPIRE:
            gone = self.debits.pop(reservation_id, None)
            if gone is not None:
                self._add(-gone[0], -gone[1], -gone[2], -gone[3])

    def _add(self, kv: int, output: int, pulled: int, unread: int) -> None:
        self.kv += kv
        self.output += output
        self.pulled_tokens += pulled
        self.transfer_bytes += unread

    def apply(self, notices: list[Notice]) -> None:
        for n in notices:
            d = n.debit
            self.record(
                n.kind,
                n.reservation_id,
                d.kv_tokens,
                d.output_tokens,
                d.kv_transfer_bytes,
                n.pulled_tokens,
            )

    def uncached_tokens(self, model_kv_bytes_per_token: int) -> int:
        """Uncached prompt tokens of the open reservations, in telemetry's unit (raw tokens).

        A debit's kv credit is the prompt's uncached tokens + a prefix pulled in from elsewhere
        + its output within the horizon (:func:`~crossflow_ctl.domain.admission.debit_for`), and
        its kv_transfer credit is that prefix in bytes at the broker's ``kv_bytes_per_token``,
        so the sums give the uncached tokens exactly (the served model's bytes per token stand
        in for grants made while the broker's were unknown)."""
        unit = self.kv_bytes_per_token or model_kv_bytes_per_token
        pulled = self.pulled_tokens + math.ceil(self.transfer_bytes / max(1, unit))
        return max(0, self.kv - self.output - pulled)

    def totals(self) -> OpenDebits:
        """A copy of the sums alone, frozen in time (for a lease computed later)."""
        return OpenDebits(
            kv=self.kv,
            output=self.output,
            pulled_tokens=self.pulled_tokens,
            transfer_bytes=self.transfer_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )
