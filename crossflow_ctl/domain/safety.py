"""The Safety check (DESIGN.md §4.3, §5.3), defined once.

A node has room for a debit when, credit by credit,

    floor(lease credit x share) - open debits >= debit

where ``share`` is the policy's cluster-wide borrowing limit applied to each node's own lease
(``PolicySettings.borrow_share``) and open debits are the node's counting reservations. The
in-process store, the admission policy and the simulator's and demo's over-commit checkers call
these functions; the Redis debit script (``store/lua/try_debit.lua``) computes the same thing in
Lua, and tests/store/test_safety_lua.py holds it to this definition on real Redis.

Room may be negative (open debits above a lease that shrank), so a zero debit never fits a
credit that is already over: unlike ``Credits.minus``, nothing here floors at zero.
"""

from __future__ import annotations

from collections.abc import Sequence

from crossflow_ctl.domain.models import CREDIT_NAMES, Credits

Amounts = Credits | Sequence[int]
"""Five credit amounts, as Credits or in CREDIT_NAMES order."""


def _amounts(value: Amounts) -> tuple[int, ...]:
    return value.as_tuple() if isinstance(value, Credits) else tuple(value)


def room_left(lease: Amounts, open_debits: Amounts, share: float) -> tuple[int, ...]:
    """``floor(lease x share) - open`` per credit (CREDIT_NAMES order); may be negative."""
    return tuple(
        int(have * share) - used
        for have, used in zip(_amounts(lease), _amounts(open_debits), strict=True)
    )


def short_of_room(room: Sequence[int], debit: Amounts) -> tuple[str, ...]:
    """Names of the credits on which ``debit`` exceeds ``room`` (as :func:`room_left` gives)."""
    return tuple(
        name
        for name, left, need in zip(CREDIT_NAMES, room, _amounts(debit), strict=True)
        if need > left
    )


def short_credits(
    lease: Amounts, open_debits: Amounts, share: float, debit: Amounts
) -> tuple[str, ...]:
    """Names of the credits on which ``debit`` does not fit; empty when it fits."""
    return short_of_room(room_left(lease, open_debits, share), debit)


def fits(lease: Amounts, open_debits: Amounts, share: float, debit: Amounts) -> bool:
    """Whether ``debit`` fits on every credit (the Safety condition)."""
    return not short_credits(lease, open_debits, share, debit)


def over_committed(lease: Amounts, open_debits: Amounts, share: float) -> tuple[str, ...]:
    """Names of the credits whose open debits exceed ``lease x share`` (an over-commit when the
    debits were all granted against this lease); empty when none do."""
    return tuple(
        name
        for name, room in zip(CREDIT_NAMES, room_left(lease, open_debits, share), strict=True)
        if room < 0
    )
