"""The agent's deadband: credits rounded DOWN, and a lease held back only while that is safe.

The property the broker's no-over-commit proofs rest on, checked over random credit walks: after
every period the credits the broker holds (the last lease sent) are at most what the agent
computed at that period, credit by credit; a held-back lease is never older than half its TTL;
sent versions only rise."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.deadband import Deadband, round_down, rounded
from crossflow_ctl.domain.models import Credits, Lease, ZeroReason

TTL_MS = 1_200
PERIOD_MS = 200


def lease(version: int, credits: Credits, **kw: object) -> Lease:
    fields: dict[str, object] = {
        "node_id": "n1",
        "epoch": 1,
        "version": version,
        "ttl_ms": TTL_MS,
        "credits": credits,
        "borrowed_prefill_rate_tps": 10_000.0,
        "itl_slo_ms": 50.0,
    }
    fields.update(kw)
    return Lease.model_validate(fields)


@given(st.integers(min_value=0, max_value=2**62), st.integers(min_value=1, max_value=20))
def test_round_down_is_below_close_monotonic_and_idempotent(value: int, bits: int) -> None:
    r = round_down(value, bits)
    assert r <= value
    assert value - r < max(1, value) * 2.0 ** -(bits - 1)
    assert round_down(r, bits) == r
    assert round_down(value + 1, bits) >= r
    if value < 2**bits:
        assert r == value


credit_values = st.integers(min_value=0, max_value=10**9)
credit_sets = st.builds(
    Credits,
    compute_tokens=credit_values,
    kv_tokens=credit_values,
    kv_transfer_bytes=credit_values,
    output_tokens=credit_values,
    slots=st.integers(min_value=0, max_value=1000),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(credit_sets, st.sampled_from([None, None, None, ZeroReason.ITL_OVER_SLO])),
        min_size=1,
        max_size=60,
    ),
    st.integers(min_value=1, max_value=12),
)
def test_the_stored_credits_never_exceed_the_latest_computed(
    walk: list[tuple[Credits, ZeroReason | None]], bits: int
) -> None:
    band = Deadband(bits)
    sent: Lease | None = None
    sent_at = 0.0
    versions: list[int] = []
    for period, (computed, reason) in enumerate(walk):
        now = float(period * PERIOD_MS)
        credits = Credits() if reason is not None else computed
        shaped = band.shape(lease(period + 1, credits, zero_reason=reason))
        assert all(
            s <= c for s, c in zip(shaped.credits.as_tuple(), credits.as_tuple(), strict=True)
        )
        going = band.to_send(shaped, sent, now, sent_at)
        if going is not None:
            assert going.version == shaped.version
            sent, sent_at = going, now
            versions.append(going.version)
        assert sent is not None
        for held, computed_now in zip(sent.credits.as_tuple(), credits.as_tuple(), strict=True):
            assert held <= computed_now, (held, computed_now)
        assert sent.zero_reason == reason
        assert now - sent_at < TTL_MS / 2
    assert versions == sorted(set(versions))


def test_a_steady_lease_goes_at_half_its_ttl_and_noise_within_the_band_is_held() -> None:
    """+-2% noise: one extra send when a dip first crosses below the rounded value (safety), then
    only the renewals at TTL/2; with the rule off, every period."""

    def sends(band: Deadband) -> list[int]:
        sent: Lease | None = None
        sent_at, out = 0.0, []
        for period in range(30):  # 6 s
            wobble = 1.0 + 0.02 * (-1) ** period
            noisy = Credits(
                compute_tokens=int(100_000 * wobble),
                kv_tokens=int(50_000 * wobble),
                output_tokens=int(20_000 * wobble),
                slots=8,
            )
            going = band.to_send(
                band.shape(lease(period + 1, noisy)), sent, period * float(PERIOD_MS), sent_at
            )
            if going is not None:
                sent, sent_at = going, period * float(PERIOD_MS)
                out.append(period)
        return out

    held = sends(Deadband(5))
    renewal = TTL_MS // 2 // PERIOD_MS
    assert len(held) <= 30 // renewal + 1, held
    assert all(b - a <= renewal for a, b in itertools.pairwise(held)), held
    assert len(sends(Deadband(0))) == 30


def test_a_fall_a_new_notice_or_a_zero_reason_goes_at_once() -> None:
    band = Deadband(5)
    base = Credits(compute_tokens=100_000, kv_tokens=50_000, slots=8)
    sent = band.shape(lease(1, base))
    fell = band.shape(lease(2, base.model_copy(update={"slots": 7})))
    notice = band.shape(lease(2, base, last_notice_seq=3))
    zero = band.shape(lease(2, Credits(), zero_reason=ZeroReason.CORDONED))
    rose = band.shape(lease(2, base.model_copy(update={"compute_tokens": 180_000})))
    for lease_now in (fell, notice, zero, rose):
        assert band.to_send(lease_now, sent, 200.0, 0.0) is lease_now
    same = band.shape(lease(2, base))
    assert band.to_send(same, sent, 200.0, 0.0) is None
    assert Deadband(0).to_send(same, sent, 200.0, 0.0) is same, "0: the rule off"


def test_rounded_keeps_each_credit_within_its_band() -> None:
    c = rounded(Credits(compute_tokens=123_456, kv_tokens=31, slots=3), 5)
    assert c.compute_tokens == 122_880 and c.kv_tokens == 31 and c.slots == 3
