"""The Safety check (DESIGN.md §4.3, §5.3), defined once.

A node has room for a debit when, credit by credit,

    floor(lease credit x share) - open debits >= debit

where ``share`` is the policy's cluster-wide borrowing limit applied to each node's own lease,
that credit's own (``PolicySettings.shares``), and open debits are the node's counting
reservations, each credit in the lease's unit.

**One unit.** The compute credit counts tokens at the lease's borrowed-prefill rate (node
seconds x rate), and that rate follows the decode batch, lease by lease. Each open compute debit
was priced against the lease current at its grant, so it also keeps its node time
(``Reservation.compute_us``), and the node's open compute is counted in the unit of the lease
it is checked against: ``ceil(open_us x rate / 1e6)`` plus the untimed debits' tokens
(:meth:`~crossflow_ctl.domain.models.ComputeTime.tokens_at`). So a lease whose rate rose does
not promise the node's open work twice over, and one whose rate fell does not count it too
high. Without a rate (``rate_tps`` 0) the tokens are summed as they are.

**The state after the grant.** A debit fits when the open debits WITH it stay within
``floor(lease x share)``: on compute, ``tokens_at(open + debit)``, the node time summed before
the one ``ceil`` (:func:`need_for`). Comparing the debit's own ``ceil(us x rate / 1e6)`` with
the room left by ``ceil(open_us x rate / 1e6)`` is not the same on doubles: ``ceil`` of a
rounded product is not subadditive, so two debits that each fit could sum one token above the
lease (at a rate like 2329.3333333333335 tokens/s). :func:`over_committed` reads the same
state the same way, so nothing this check grants is ever reported over. The in-process store,
the admission policy and the simulator's and demo's over-commit checkers call these functions;
the Redis debit script (``store/lua/try_debit.lua``) computes the same thing in Lua, and
tests/store/test_safety_lua.py holds it to this definition on real Redis.

Room may be negative (open debits above a lease that shrank), so a zero debit never fits a
credit that is already over: unlike ``Credits.minus``, nothing here floors at zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    MICROS_PER_S,
    ComputeTime,
    Credits,
    Share,
    Shares,
)

Amounts = Credits | Sequence[int]
"""Five credit amounts, as Credits or in CREDIT_NAMES order."""

UNTIMED = ComputeTime()


def _amounts(value: Amounts) -> tuple[int, ...]:
    if isinstance(value, tuple):  # already five amounts (immutable: no copy)
        return value
    return value.as_tuple() if isinstance(value, Credits) else tuple(value)


def in_lease_unit(amounts: Amounts, time: ComputeTime, rate_tps: float) -> tuple[int, ...]:
    """Open debits ``amounts`` with the node time ``time`` behind their compute, in the unit of
    a lease whose borrowed-prefill rate is ``rate_tps`` (only the compute credit changes)."""
    values = _amounts(amounts)
    if rate_tps <= 0.0 or time.us <= 0:
        return values
    return (time.tokens_at(values[0], rate_tps), *values[1:])


def need_for(
    debit: Amounts,
    debit_us: int,
    open_compute_tokens: int,
    open_time: ComputeTime,
    rate_tps: float,
) -> tuple[int, ...]:
    """What granting ``debit`` (``debit_us`` microseconds of node time behind its compute, 0:
    untimed) adds to open debits whose compute is ``open_compute_tokens`` with ``open_time``
    behind them, per credit in the unit of a lease whose rate is ``rate_tps``: on compute,
    ``tokens_at(open + debit) - tokens_at(open)``, so ``need <= room`` (:func:`room_left`)
    exactly when the open compute after the grant stays within the lease."""
    values = _amounts(debit)
    if rate_tps <= 0.0:
        return values
    # ComputeTime's arithmetic (behind, of_debit, plus, tokens_at) written out on its numbers,
    # in the same order (no time built per call: admission asks this per node per request):
    # kept = open_time.behind(open); before = kept.tokens_at(open, rate);
    # after = kept.plus(ComputeTime.of_debit(debit, debit_us)); after.tokens_at(open + debit).
    open_us, open_timed = open_time
    if not (open_us > 0 and 0 <= open_timed <= open_compute_tokens):
        open_us = open_timed = 0
    before = open_compute_tokens
    if open_us > 0:
        before += math.ceil(open_us * rate_tps / MICROS_PER_S) - open_timed
    compute = values[0]
    total = open_compute_tokens + compute
    after_us, after_timed = open_us, open_timed
    if debit_us > 0:
        after_us, after_timed = open_us + debit_us, open_timed + compute
    after = total
    if after_us > 0 and 0 <= after_timed <= total:
        after += math.ceil(after_us * rate_tps / MICROS_PER_S) - after_timed
    return (after - before, *values[1:])


def room_left(
    lease: Amounts,
    open_debits: Amounts,
    share: Share,
    rate_tps: float = 0.0,
    open_time: ComputeTime = UNTIMED,
) -> tuple[int, ...]:
    """``floor(lease x share) - open`` per credit (CREDIT_NAMES order; ``share``: one for every
    credit, or each credit's own), the open debits in the unit of the lease (``rate_tps``, its
    borrowed-prefill rate; ``open_time``, the node time behind their compute); may be
    negative."""
    l0, l1, l2, l3, l4 = _amounts(lease)
    s0, s1, s2, s3, s4 = Shares.of(share)
    u0, u1, u2, u3, u4 = in_lease_unit(open_debits, open_time, rate_tps)
    return (
        int(l0 * s0) - u0,
        int(l1 * s1) - u1,
        int(l2 * s2) - u2,
        int(l3 * s3) - u3,
        int(l4 * s4) - u4,
    )


def short_of_room(room: Sequence[int], need: Sequence[int]) -> tuple[str, ...]:
    """Names of the credits on which ``need`` (as :func:`need_for` gives) exceeds ``room`` (as
    :func:`room_left` gives)."""
    r0, r1, r2, r3, r4 = room
    n0, n1, n2, n3, n4 = need
    if n0 <= r0 and n1 <= r1 and n2 <= r2 and n3 <= r3 and n4 <= r4:
        return ()  # the common answer, without walking the names
    return tuple(name for name, left, n in zip(CREDIT_NAMES, room, need, strict=True) if n > left)


def short_credits(
    lease: Amounts,
    open_debits: Amounts,
    share: Share,
    debit: Amounts,
    rate_tps: float = 0.0,
    open_time: ComputeTime = UNTIMED,
    debit_us: int = 0,
) -> tuple[str, ...]:
    """Names of the credits on which ``debit`` (with ``debit_us`` microseconds of node time
    behind its compute, 0: untimed) does not fit; empty when it fits: the open debits with it
    would exceed ``floor(lease x share)``, counted in the lease's unit."""
    opened = _amounts(open_debits)
    need = need_for(debit, debit_us, opened[0], open_time, rate_tps)
    return short_of_room(room_left(lease, opened, share, rate_tps, open_time), need)


def fits(
    lease: Amounts,
    open_debits: Amounts,
    share: Share,
    debit: Amounts,
    rate_tps: float = 0.0,
    open_time: ComputeTime = UNTIMED,
    debit_us: int = 0,
) -> bool:
    """Whether ``debit`` fits on every credit (the Safety condition)."""
    return not short_credits(lease, open_debits, share, debit, rate_tps, open_time, debit_us)


def over_committed(
    lease: Amounts,
    open_debits: Amounts,
    share: Share,
    rate_tps: float = 0.0,
    open_time: ComputeTime = UNTIMED,
) -> tuple[str, ...]:
    """Names of the credits whose open debits, in the lease's unit, exceed ``lease x share``
    (an over-commit when the debits were all granted against this lease); empty when none do."""
    room = room_left(lease, open_debits, share, rate_tps, open_time)
    return tuple(name for name, left in zip(CREDIT_NAMES, room, strict=True) if left < 0)
