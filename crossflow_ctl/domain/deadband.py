"""Which computed leases an agent sends: credits rounded down, sent on a change beyond a deadband.

An agent computes a lease every period, but a steady node's lease barely moves, and sending each
one costs the broker a store write. :func:`rounded` rounds each credit DOWN to its ``bits``
highest significant bits (a loss under ``2**-(bits-1)`` of it, exact below ``2**bits``), and
:class:`Deadband` says whether a lease must go, given the last one sent:

* its epoch changed, or nothing was sent on this session yet;
* a zero reason appears, changes or clears (a zero lease goes at once, so does lending again);
* a new notice sequence (the broker counts releases against the node until a lease stamped after
  them arrives: DESIGN.md §4);
* any rounded credit is below the one sent (the stored lease would offer more than the node
  has: this is the safety rule, and it has no deadband), or above it by more than two grid steps
  (a rise within that band is not worth a message, and the band keeps a value that sits on a grid
  line from flapping);
* the pricing it states (borrowed-prefill rate and coefficients, SLO, horizon) moved by more
  than one grid step, its queue wait by more than a quarter (and 1 ms), or its ITL fell by more
  than a quarter (a grant's output debit is priced at it: a lower ITL debits more, so a rise is
  held; the agent states the lowest ITL it read over the last half TTL, :meth:`Deadband.low_itl`);
* half its TTL has passed since the last one sent (a renewal: the stored one never expires while
  the agent lives; a renewal within the band renews the credits sent, which are at most this
  period's, so noise about a grid line does not send again at the next period).

So the credits the broker holds for a live agent's node are never above what the agent computed
at its latest scrape, credit by credit, and versions stay monotonic (the agent numbers only what it
builds; a lease it does not send burns no check at the broker). Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from crossflow_ctl.domain.models import Credits, Lease

DEFAULT_BITS = 5
"""Credits keep their 5 highest significant bits: each is rounded down by under 1/16."""


def round_down(value: int, bits: int) -> int:
    """``value`` with all but its ``bits`` highest significant bits cleared: monotonic,
    idempotent, never above ``value``, and above ``value * (1 - 2**-(bits-1))``."""
    extra = value.bit_length() - bits
    if extra <= 0:
        return value
    return (value >> extra) << extra


def _step(value: int, bits: int) -> int:
    """The grid step at ``value`` (the gap from it to the next rounded value above it)."""
    return 1 << max(0, value.bit_length() - bits)


def rounded(credits: Credits, bits: int) -> Credits:
    """Every credit rounded down (:func:`round_down`)."""
    return Credits.model_construct(
        compute_tokens=round_down(credits.compute_tokens, bits),
        kv_tokens=round_down(credits.kv_tokens, bits),
        kv_transfer_bytes=round_down(credits.kv_transfer_bytes, bits),
        output_tokens=round_down(credits.output_tokens, bits),
        slots=round_down(credits.slots, bits),
    )


def _credits_moved(sent: Credits, now: Credits, bits: int) -> bool:
    for before, after in zip(sent.as_tuple(), now.as_tuple(), strict=True):
        if after < before:  # safety: never leave more credit standing than the node has
            return True
        if after > before + 2 * _step(before, bits):
            return True
    return False


def _moved(before: float, after: float, relative: float, absolute: float = 0.0) -> bool:
    return abs(after - before) > max(absolute, relative * max(abs(before), abs(after)))


@dataclass(frozen=True)
class Deadband:
    """The send rule (module docstring). ``bits``: the credits' significant bits (0: send every
    lease, credits as computed: the rule off)."""

    bits: int = DEFAULT_BITS

    @property
    def enabled(self) -> bool:
        return self.bits > 0

    def shape(self, lease: Lease) -> Lease:
        """``lease`` with its credits rounded down (unchanged with the rule off or when zero)."""
        if not self.enabled or lease.zero_reason is not None:
            return lease
        credits = rounded(lease.credits, self.bits)
        if credits == lease.credits:
            return lease
        return lease.model_copy(update={"credits": credits})

    @staticmethod
    def low_itl(lease: Lease, low_ms: float) -> Lease:
        """``lease`` stating ``low_ms`` (the lowest ITL read over the last half TTL, this
        period's included) when that is lower: a window's p99 swings period to period, and the
        lower ITL is the safe side of the output debit."""
        if 0.0 < low_ms < lease.itl_ms:
            return lease.model_copy(update={"itl_ms": low_ms})
        return lease

    def to_send(
        self, lease: Lease, sent: Lease | None, now_ms: float, sent_at_ms: float
    ) -> Lease | None:
        """The lease to send now, or None to hold it back. ``lease`` is this period's, already
        :meth:`shape`-d; ``sent`` the last one sent on this session (None: none) at
        ``sent_at_ms`` (the agent's monotonic clock). A renewal whose credits are within the
        band of the sent ones renews those credits (all at most this period's): re-sampling
        them would let noise around a grid line send again at the next period."""
        if not self.enabled or sent is None or lease.epoch != sent.epoch:
            return lease
        if self._changed(lease, sent):
            return lease
        if now_ms - sent_at_ms < sent.ttl_ms / 2:
            return None
        if lease.credits == sent.credits:
            return lease
        return lease.model_copy(update={"credits": sent.credits})

    def _changed(self, lease: Lease, sent: Lease) -> bool:
        if lease.ttl_ms != sent.ttl_ms or lease.zero_reason != sent.zero_reason:
            return True
        if lease.last_notice_seq != sent.last_notice_seq:
            return True
        if _credits_moved(sent.credits, lease.credits, self.bits):
            return True
        grid = 2.0 ** -(self.bits - 1)
        return (
            lease.horizon_ms != sent.horizon_ms
            or lease.itl_slo_ms != sent.itl_slo_ms
            or _moved(sent.borrowed_prefill_rate_tps, lease.borrowed_prefill_rate_tps, grid)
            or _moved(sent.prefill_s_per_token, lease.prefill_s_per_token, grid)
            or _moved(sent.prefill_s_per_token_context, lease.prefill_s_per_token_context, grid)
            or _moved(sent.queue_wait_ms, lease.queue_wait_ms, 0.25, 1.0)
            # the broker prices a grant's output over the horizon at the lease's ITL: a lower
            # one debits more, so a fall goes (the debit must not shrink) and a rise is held
            # (a window's p99 swings: a 15 ms / 57 ms flip sent every period); an ITL that
            # nears the SLO zeroes the lease, which goes at once
            or lease.itl_ms < sent.itl_ms * 0.75 - 1.0
        )
