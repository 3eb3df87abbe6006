"""The Safety check's one definition (crossflow_ctl.domain.safety)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from crossflow_ctl.domain.models import CREDIT_NAMES, ComputeTime, Credits, Shares
from crossflow_ctl.domain.safety import (
    fits,
    need_for,
    over_committed,
    room_left,
    short_credits,
)

amounts = st.tuples(*(st.integers(min_value=0, max_value=10_000) for _ in CREDIT_NAMES))
share_values = st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.5, 0.7, 1.0])
shares = st.one_of(share_values, st.tuples(*[share_values] * 5).map(lambda t: Shares(*t)))
"""One share for every credit, or each credit its own."""


def test_room_is_floor_of_lease_times_share_minus_open_and_may_be_negative() -> None:
    lease = Credits(compute_tokens=10, kv_tokens=7, kv_transfer_bytes=0, output_tokens=3, slots=2)
    assert room_left(lease, (4, 0, 0, 5, 1), 0.5) == (1, 3, 0, -4, 0)
    assert over_committed(lease, (4, 0, 0, 5, 1), 0.5) == ("output_tokens",)
    # A zero debit does not fit a credit that is already over (no flooring at zero).
    assert short_credits(lease, (4, 0, 0, 5, 1), 0.5, Credits()) == ("output_tokens",)
    # Each credit at its own share: KV lent whole, output at 0.9.
    each = Shares(compute=0.5, kv=1.0, kv_transfer=0.5, output=0.9, slots=0.5)
    assert room_left(lease, (4, 0, 0, 2, 1), each) == (1, 7, 0, 0, 0)
    assert short_credits(lease, (4, 6, 0, 1, 1), each, Credits(kv_tokens=1)) == ()
    assert short_credits(lease, (4, 6, 0, 1, 1), 0.5, Credits(kv_tokens=1)) == ("kv_tokens",)


@given(amounts, amounts, shares, amounts)
def test_short_credits_name_exactly_the_credits_that_do_not_fit(
    lease: tuple[int, ...], open_: tuple[int, ...], share: float | Shares, debit: tuple[int, ...]
) -> None:
    short = short_credits(lease, open_, share, debit)
    for i, name in enumerate(CREDIT_NAMES):
        assert (name in short) == (open_[i] + debit[i] > int(lease[i] * Shares.of(share)[i]))
    assert fits(lease, open_, share, debit) == (not short)
    # Credits and plain tuples are the same amounts.
    assert short == short_credits(
        Credits.from_tuple(lease), Credits.from_tuple(open_), share, Credits.from_tuple(debit)
    )


@given(amounts, amounts, shares, amounts)
def test_granting_what_fits_never_over_commits(
    lease: tuple[int, ...], open_: tuple[int, ...], share: float | Shares, debit: tuple[int, ...]
) -> None:
    if not over_committed(lease, open_, share) and fits(lease, open_, share, debit):
        after = tuple(a + b for a, b in zip(open_, debit, strict=True))
        assert not over_committed(lease, after, share)


UNEVEN_RATES = (2329.3333333333335, 1e5 / 3, 7 / 3, 0.1, 1_000 / 7)
"""Rates no double holds exactly: their products with node time round, so ``ceil`` of them is
not subadditive (two debits that each round up to N and M can sum to N + M + 1)."""
rates = st.one_of(
    st.just(0.0),
    st.sampled_from(UNEVEN_RATES),
    st.floats(min_value=0.1, max_value=1e5, allow_nan=False),
)
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


def test_a_timed_debit_fits_when_the_state_after_it_does() -> None:
    """At 2329.3333333333335 tokens/s, 1.5 s open (3,494 tokens) and 5.25 s more (12,229 on its
    own) are ceil(15723.000000000002) = 15,724 tokens together: the second does not fit a lease
    of 15,723, though its own 12,229 fit the room the first leaves (15,723 - 3,494)."""
    rate, lease = 2329.3333333333335, (15_723, 10, 10, 10, 10)
    open_, time = (3_494, 1, 1, 1, 1), ComputeTime(us=1_500_000, tokens=3_494)
    debit = (12_229, 1, 1, 1, 1)
    assert room_left(lease, open_, 1.0, rate, time)[0] == 12_229
    assert short_credits(lease, open_, 1.0, debit, rate, time, 5_250_000) == ("compute_tokens",)
    assert need_for(debit, 5_250_000, 3_494, time, rate) == (12_230, 1, 1, 1, 1)
    assert fits(lease, open_, 1.0, debit, rate, time, 5_249_999)
    assert need_for(debit, 0, 3_494, time, rate) == debit  # untimed: its own tokens


def test_a_time_that_cannot_be_behind_the_open_tokens_counts_them_untimed() -> None:
    """Totals an older broker rewrote without their node time can, once the timed debits they
    dropped drain, hold a negative time or more timed tokens than open ones: the open compute
    then counts as its tokens (the rule from before debits had node time), never below."""
    lease = (10_000, 10, 10, 10, 10)
    for bad in (ComputeTime(-2_000_000, -2_000), ComputeTime(1_000_000, -500),
                ComputeTime(3_000_000, 3_000)):  # fmt: skip
        assert bad.behind(2_500) == ComputeTime()
        assert bad.tokens_at(2_500, 500.0) == 2_500
        assert room_left(lease, (2_500, 0, 0, 0, 0), 1.0, 500.0, bad)[0] == 7_500
        # a timed debit on top counts its own time, the open tokens still untimed
        need = need_for((1_000, 0, 0, 0, 0), 2_000_000, 2_500, bad, 500.0)
        assert need == (1_000, 0, 0, 0, 0)
    good = ComputeTime(1_000_000, 2_500)
    assert good.behind(2_500) == good and good.tokens_at(2_500, 500.0) == 500


@given(amounts, rates, shares, grants)
@example(  # 1.5 s and 5.25 s each fit 15,723 tokens at this rate; both are 15,724
    (15_723, 10, 10, 10, 10),
    2329.3333333333335,
    1.0,
    [((3_494, 1, 1, 1, 1), 1_500_000), ((12_229, 1, 1, 1, 1), 5_250_000)],
)
def test_granting_what_fits_at_one_rate_never_over_commits_it(
    lease: tuple[int, ...],
    rate: float,
    share: float | Shares,
    debits: list[tuple[tuple[int, ...], int]],
) -> None:
    """Debits granted one after another against one lease (each checked with the open ones in
    the lease's unit) never sum above it, at any rate: each is checked by the state after it,
    its node time added to the open time before the one ``ceil``."""
    open_, time = (0,) * len(CREDIT_NAMES), ComputeTime()
    for debit, us in debits:
        if fits(lease, open_, share, debit, rate, time, us):
            open_ = tuple(a + b for a, b in zip(open_, debit, strict=True))
            time = time.plus(ComputeTime.of_debit(debit[0], us))
            assert not over_committed(lease, open_, share, rate, time)


@given(amounts, rates, shares, grants, amounts, st.integers(min_value=0, max_value=10**8))
def test_a_debit_fits_exactly_when_the_open_compute_after_it_stays_within_the_lease(
    lease: tuple[int, ...],
    rate: float,
    share: float | Shares,
    opened: list[tuple[tuple[int, ...], int]],
    debit: tuple[int, ...],
    us: int,
) -> None:
    """On compute, :func:`need_for` against :func:`room_left` (what Admit plans with, the room
    computed once per node) is the state after the grant against ``floor(lease x share)``."""
    open_, time = (0,) * len(CREDIT_NAMES), ComputeTime()
    for d, d_us in opened:
        open_ = tuple(a + b for a, b in zip(open_, d, strict=True))
        time = time.plus(ComputeTime.of_debit(d[0], d_us))
    after = time.plus(ComputeTime.of_debit(debit[0], us)).tokens_at(open_[0] + debit[0], rate)
    short = short_credits(lease, open_, share, debit, rate, time, us)
    assert ("compute_tokens" in short) == (after > int(lease[0] * Shares.of(share).compute))


def _need_by_compute_time(
    debit: tuple[int, ...], debit_us: int, opened: int, time: ComputeTime, rate: float
) -> tuple[int, ...]:
    """need_for as ComputeTime's own methods say it (the definition need_for writes out)."""
    if rate <= 0.0:
        return debit
    kept = time.behind(opened)
    before = kept.tokens_at(opened, rate)
    after = kept.plus(ComputeTime.of_debit(debit[0], debit_us))
    return (after.tokens_at(opened + debit[0], rate) - before, *debit[1:])


@given(
    st.tuples(*(st.integers(0, 10**9) for _ in range(5))),
    st.integers(-(2**41), 2**41),
    st.integers(0, 10**9),
    st.builds(ComputeTime, st.integers(-(2**41), 2**41), st.integers(-(10**9), 10**9)),
    st.one_of(
        st.just(0.0),
        st.just(2329.3333333333335),
        st.floats(min_value=-1.0, max_value=1e9, allow_nan=False),
    ),
)
@example((12_229, 1, 1, 1, 1), 5_250_000, 3_494, ComputeTime(1_500_000, 3_494), 2329.3333333333335)
@example((1_000, 0, 0, 0, 0), 2_000_000, 2_500, ComputeTime(3_000_000, 3_000), 500.0)
@example((1_000, 0, 0, 0, 0), 2_000_000, 2_500, ComputeTime(-2_000_000, -2_000), 500.0)
def test_need_for_is_compute_times_arithmetic(
    debit: tuple[int, ...], debit_us: int, opened: int, time: ComputeTime, rate: float
) -> None:
    """need_for writes ComputeTime's arithmetic out on its numbers (no time built per call):
    the same need, to the token, for any time (inconsistent ones included) and rate."""
    assert need_for(debit, debit_us, opened, time, rate) == _need_by_compute_time(
        debit, debit_us, opened, time, rate
    )
