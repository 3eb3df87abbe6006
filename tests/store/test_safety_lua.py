"""The Redis debit script answers Safety exactly as crossflow_ctl.domain.safety defines it.

Random leases, open debits (granted against a larger lease, then left above or below a smaller
one), debits and shares on real Redis: the script grants exactly when the domain says the debit
fits, and names the same short credits when it refuses; a batch of debits on the node (one
script call) agrees with the domain applied debit after debit.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.models import CREDIT_NAMES, MAX_BYTES, MAX_SLOTS, MAX_TOKENS, Credits
from crossflow_ctl.domain.safety import fits, short_credits
from crossflow_ctl.store.base import DebitRequest
from crossflow_ctl.store.redis_store import RedisStore
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


shares = st.one_of(
    st.sampled_from([0.0, 0.1, 1 / 3, 0.5, 0.7, 0.9, 1.0]),
    st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    first=amounts(50),
    open_debits=st.lists(amounts(20), max_size=3),
    second=amounts(60),
    debit=amounts(30),
    batch=st.lists(amounts(15), max_size=4),
    share=shares,
)
async def test_lua_debit_agrees_with_the_domain_safety_check(
    redis_url: str,
    redis_namespace: str,
    first: Credits,
    open_debits: list[Credits],
    second: Credits,
    debit: Credits,
    batch: list[Credits],
    share: float,
) -> None:
    store = RedisStore(redis_url, namespace=f"{redis_namespace}-{uuid.uuid4().hex[:8]}")
    try:
        await register(store, "d1")
        await store.upsert_lease(lease("d1", version=1, credits=first), NOW, 60_000)
        opened = [0] * len(CREDIT_NAMES)
        for d in open_debits:  # granted against the first lease, at full share
            out = await store.try_debit("d1", d, 1.0, NOW, 60_000)
            if out.granted:
                opened = [a + b for a, b in zip(opened, d.as_tuple(), strict=True)]
        # A second lease (that has seen no notice) keeps every debit open, above or below it.
        await store.upsert_lease(lease("d1", version=2, credits=second), NOW, 60_000)
        outcome = await store.try_debit("d1", debit, share, NOW, 60_000)
        # A batch on one node is one script call: each debit sees the ones granted before it.
        batched = await store.try_debits([DebitRequest("d1", d) for d in batch], share, NOW, 60_000)
    finally:
        await store.close()
    want = short_credits(second, opened, share, debit)
    if second.is_zero():
        assert outcome.refusal == "zero_lease"  # no credit at all: refused before Safety
        assert all(o.refusal == "zero_lease" for o in batched)
        return
    assert outcome.granted == fits(second, opened, share, debit)
    assert outcome.short_credits == want
    if outcome.granted:
        opened = [a + b for a, b in zip(opened, debit.as_tuple(), strict=True)]
    for d, out in zip(batch, batched, strict=True):
        assert out.short_credits == short_credits(second, opened, share, d)
        assert out.granted == fits(second, opened, share, d)
        if out.granted:
            opened = [a + b for a, b in zip(opened, d.as_tuple(), strict=True)]
