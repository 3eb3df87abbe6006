"""The Safety check's one definition (crossflow_ctl.domain.safety)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossflow_ctl.domain.models import CREDIT_NAMES, ComputeTime, Credits
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


rates = st.one_of(st.just(0.0), st.floats(min_value=0.1, max_value=1e5, allow_nan=False))
grants = st.lists(
    st.tuples(amounts, st.one_of(st.just(0), st.integers(min_value=1, max_value=10**8))),
    max_size=8,
)


def test_open_compute_counts_at_the_latest_leases_rate() -> None:
    """Two debits of 0.3 s granted at 1,000 tokens/s (300 tokens each) are 1,200 tokens of a
    lease at 2,000 tokens/s and 300 of one at 500; a debit's own node time counts alike."""
    lease = (1_000, 10, 10, 10, 10)
    open_ = (600, 0, 0, 0, 0)
    time = ComputeTime(us=600_000, tokens=600)
    assert room_left(lease, open_, 1.0, 2_000.0, time)[0] == -200
    assert room_left(lease, open_, 1.0, 500.0, time)[0] == 700
    assert room_left(lease, open_, 1.0, 0.0, time)[0] == 400  # no rate: the tokens as granted
    assert room_left(lease, open_, 1.0)[0] == 400  # untimed: the tokens as granted
    debit = (300, 0, 0, 0, 0)  # 0.15 s at 2,000 tokens/s: 75 tokens at 500
    assert short_credits(lease, open_, 1.0, debit, 2_000.0, time, 150_000) == ("compute_tokens",)
    assert fits(lease, open_, 1.0, (1_000, 0, 0, 0, 0), 500.0, time, 1_400_000)
    assert not fits(lease, open_, 1.0, (1_000, 0, 0, 0, 0), 500.0, time, 1_400_002)
    # untimed open debits beside timed ones count their tokens
    mixed = ComputeTime(us=600_000, tokens=500)
    assert room_left(lease, open_, 1.0, 2_000.0, mixed)[0] == 1_000 - 100 - 1_200


@given(amounts, rates, shares, grants)
def test_granting_what_fits_at_one_rate_never_over_commits_it(
    lease: tuple[int, ...], rate: float, share: float, debits: list[tuple[tuple[int, ...], int]]
) -> None:
    """Debits granted one after another against one lease (each checked with the open ones in
    the lease's unit) never sum above it: the conversion rounds each debit up, and a ceiling of
    a sum is at most the sum of the ceilings."""
    open_, time = (0,) * len(CREDIT_NAMES), ComputeTime()
    for debit, us in debits:
        if fits(lease, open_, share, debit, rate, time, us):
            open_ = tuple(a + b for a, b in zip(open_, debit, strict=True))
            time = time.plus(ComputeTime.of_debit(debit[0], us))
            assert not over_committed(lease, open_, share, rate, time)
