"""The Redis debit script answers Safety exactly as crossflow_ctl.domain.safety defines it.

Random leases, open debits (granted against a larger lease, then left above or below a smaller
one), debits and shares (one for every credit, or each credit its own) on real Redis: the script
grants exactly when the domain says the debit fits, and names the same short credits when it
refuses; a batch of debits on the node (one script call) agrees with the domain applied debit
after debit. The two leases have borrowed-prefill rates of their own (0: none) and the debits
node time or none, so the open compute debits granted against the first lease are counted in the
second's unit by both, to the token.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    MAX_BYTES,
    MAX_COMPUTE_US,
    MAX_SLOTS,
    MAX_TOKENS,
    ComputeTime,
    Credits,
    Shares,
)
from crossflow_ctl.domain.safety import fits, over_committed, short_credits
from crossflow_ctl.store.base import DebitRequest
from tests.conftest import patient_redis_store
from tests.domain.test_safety import UNEVEN_RATES
from tests.store.helpers import NOW, lease, register

pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
)

LIMITS = (MAX_TOKENS, MAX_TOKENS, MAX_BYTES, MAX_TOKENS, MAX_SLOTS)


def amounts(scale: int) -> st.SearchStrategy[Credits]:
    """Credits mixing small values, values near the field limits and the limits themselves."""
    fields = [
        st.one_of(
            st.integers(min_value=0, max_value=scale),
            st.integers(min_value=max(0, limit - scale), max_value=limit),
        )
        for limit in LIMITS
    ]
    return st.tuples(*fields).map(Credits.from_tuple)


share_values = st.one_of(
    st.sampled_from([0.0, 0.1, 1 / 3, 0.5, 0.7, 0.9, 1.0]),
    st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
)
shares = st.one_of(share_values, st.tuples(*[share_values] * 5).map(lambda t: Shares(*t)))
"""One share for every credit, or one per credit (as ``PolicySettings.shares`` gives: the KV
credit's own, ``borrow_kv_share``)."""
rates = st.one_of(
    st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0, 1_000.0]),
    st.sampled_from(UNEVEN_RATES),
    st.floats(min_value=0.0, max_value=1e5, allow_nan=False, allow_infinity=False),
)
"""Leases' borrowed-prefill rates: none, round ones, ones no double holds exactly (whose
products with node time round, so the script must sum the time before its one ``ceil`` as the
domain does), and any."""
micros = st.one_of(
    st.just(0),
    st.integers(min_value=1, max_value=60_000_000),
    st.integers(min_value=MAX_COMPUTE_US - 1_000, max_value=MAX_COMPUTE_US),
)
"""A debit's node time: none (untimed), up to a minute, or near the cap."""


REVIEWED = Credits(compute_tokens=15_723, kv_tokens=10, output_tokens=10, slots=10)


def timed(d: Credits, us: int) -> ComputeTime:
    return ComputeTime.of_debit(d.compute_tokens, us)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    first=amounts(50),
    first_rate=rates,
    open_debits=st.lists(st.tuples(amounts(20), micros), max_size=3),
    second=amounts(60),
    second_rate=rates,
    debit=st.tuples(amounts(30), micros),
    batch=st.lists(st.tuples(amounts(15), micros), max_size=4),
    share=shares,
)
@example(  # two timed debits that each fit; together one token over (the reviewer's find)
    first=REVIEWED,
    first_rate=2329.3333333333335,
    open_debits=[(Credits(compute_tokens=3_494, slots=1), 1_500_000)],
    second=REVIEWED,
    second_rate=2329.3333333333335,
    debit=(Credits(compute_tokens=12_229, slots=1), 5_250_000),
    batch=[(Credits(compute_tokens=12_229, slots=1), 5_249_999)],
    share=1.0,
)
@example(  # KV lent whole (borrow_kv_share 1.0), the rest at half: the debit fits only on KV's
    first=REVIEWED,
    first_rate=0.0,
    open_debits=[(Credits(kv_tokens=4, slots=1), 0)],
    second=REVIEWED,
    second_rate=0.0,
    debit=(Credits(kv_tokens=6, slots=1), 0),
    batch=[(Credits(kv_tokens=1, slots=1), 0), (Credits(compute_tokens=1, slots=1), 0)],
    share=Shares(0.5, 1.0, 0.5, 0.5, 0.5),
)
@example(  # open debits totalling one token over MAX_TOKENS: the node view raised reading them
    first=Credits(compute_tokens=1),
    first_rate=0.5,
    open_debits=[(Credits(compute_tokens=11), 1), (Credits(compute_tokens=999_999_990), 1)],
    second=Credits(),
    second_rate=0.0,
    debit=(Credits(compute_tokens=1, slots=1), 0),
    batch=[],
    share=1.0,
)
async def test_lua_debit_agrees_with_the_domain_safety_check(
    redis_url: str,
    redis_namespace: str,
    first: Credits,
    first_rate: float,
    open_debits: list[tuple[Credits, int]],
    second: Credits,
    second_rate: float,
    debit: tuple[Credits, int],
    batch: list[tuple[Credits, int]],
    share: float | Shares,
) -> None:
    store = patient_redis_store(redis_url, f"{redis_namespace}-{uuid.uuid4().hex[:8]}")
    try:
        await register(store, "d1")
        one = lease("d1", version=1, credits=first, borrowed_prefill_rate_tps=first_rate)
        await store.upsert_lease(one, NOW, 60_000)
        opened, time = [0] * len(CREDIT_NAMES), ComputeTime()
        for d, us in open_debits:  # granted against the first lease, at full share
            out = await store.try_debit("d1", d, 1.0, NOW, 60_000, compute_us=us)
            if out.granted:
                opened = [a + b for a, b in zip(opened, d.as_tuple(), strict=True)]
                time = time.plus(timed(d, us))
        # A second lease (that has seen no notice) keeps every debit open, above or below it,
        # and counts them at its own rate.
        two = lease("d1", version=2, credits=second, borrowed_prefill_rate_tps=second_rate)
        await store.upsert_lease(two, NOW, 60_000)
        outcome = await store.try_debit("d1", debit[0], share, NOW, 60_000, compute_us=debit[1])
        state = await store.get_node("d1", NOW)
        # A batch on one node is one script call: each debit sees the ones granted before it.
        batched = await store.try_debits(
            [DebitRequest("d1", d, compute_us=us) for d, us in batch], share, NOW, 60_000
        )
    finally:
        await store.close()
    rate = second_rate
    want = short_credits(second, opened, share, debit[0], rate, time, debit[1])
    if second.is_zero():
        assert outcome.refusal == "zero_lease"  # no credit at all: refused before Safety
        assert all(o.refusal == "zero_lease" for o in batched)
        return
    assert outcome.granted == fits(second, opened, share, debit[0], rate, time, debit[1])
    assert outcome.short_credits == want
    over = set(over_committed(second, opened, share, rate, time))
    if outcome.granted:
        opened = [a + b for a, b in zip(opened, debit[0].as_tuple(), strict=True)]
        time = time.plus(timed(*debit))
        # a grant never takes a credit over the lease it was checked against
        assert set(over_committed(second, opened, share, rate, time)) <= over
    assert state.open_compute == time  # the script's running totals, as node_view reads them
    for (d, us), out in zip(batch, batched, strict=True):
        assert out.short_credits == short_credits(second, opened, share, d, rate, time, us)
        assert out.granted == fits(second, opened, share, d, rate, time, us)
        if out.granted:
            over = set(over_committed(second, opened, share, rate, time))
            opened = [a + b for a, b in zip(opened, d.as_tuple(), strict=True)]
            time = time.plus(timed(d, us))
            assert set(over_committed(second, opened, share, rate, time)) <= over
