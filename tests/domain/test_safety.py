"""The Safety check's one definition (crossflow_ctl.domain.safety)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossflow_ctl.domain.models import CREDIT_NAMES, Credits
from crossflow_ctl.domain.safety import fits, over_committed, room_left, short_credits

amounts = st.tuples(*(st.integers(min_value=0, max_value=10_000) for _ in CREDIT_NAMES))
shares = st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.5, 0.7, 1.0])


def test_room_is_floor_of_lease_times_share_minus_open_and_may_be_negative() -> None:
    lease = Credits(compute_tokens=10, kv_tokens=7, kv_transfer_bytes=0, output_tokens=3, slots=2)
    assert room_left(lease, (4, 0, 0, 5, 1), 0.5) == (1, 3, 0, -4, 0)
    assert over_committed(lease, (4, 0, 0, 5, 1), 0.5) == ("output_tokens",)
    # A zero debit does not fit a credit that is already over (no flooring at zero).
    assert short_credits(lease, (4, 0, 0, 5, 1), 0.5, Credits()) == ("output_tokens",)


@given(amounts, amounts, shares, amounts)
def test_short_credits_name_exactly_the_credits_that_do_not_fit(
    lease: tuple[int, ...], open_: tuple[int, ...], share: float, debit: tuple[int, ...]
) -> None:
    short = short_credits(lease, open_, share, debit)
    for i, name in enumerate(CREDIT_NAMES):
        assert (name in short) == (open_[i] + debit[i] > int(lease[i] * share))
    assert fits(lease, open_, share, debit) == (not short)
    # Credits and plain tuples are the same amounts.
    assert short == short_credits(
        Credits.from_tuple(lease), Credits.from_tuple(open_), share, Credits.from_tuple(debit)
    )


@given(amounts, amounts, shares, amounts)
def test_granting_what_fits_never_over_commits(
    lease: tuple[int, ...], open_: tuple[int, ...], share: float, debit: tuple[int, ...]
) -> None:
    if not over_committed(lease, open_, share) and fits(lease, open_, share, debit):
        after = tuple(a + b for a, b in zip(open_, debit, strict=True))
        assert not over_committed(lease, after, share)
