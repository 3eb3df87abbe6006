"""Random interleavings of leases, debits, commits, releases, cordons and clock steps.

Both stores run the same operations in lockstep, so the test checks three things at once:
open debits never exceed the latest lease x share on any credit at any grant (§5.3), counted in
that lease's unit (leases of their own borrowed-prefill rates, debits with node time or none);
a stale lease changes nothing observable (§5.1); and MemoryStore and RedisStore decide alike.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.domain.models import Credits, NodeState, Share, ZeroReason
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.safety import over_committed
from crossflow_ctl.store.base import DebitOutcome, Store
from crossflow_ctl.store.memory import MemoryStore
from tests.conftest import patient_redis_store
from tests.store.helpers import NOW, lease, register

# Hypothesis's failure report touches mypy_extensions.TypedDict; with warnings as errors that
# warning would replace the falsifying example by an INTERNALERROR.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
)

NODES = ("d0", "d1")
MAX_TTL = 1_000

small = st.integers(min_value=0, max_value=20)
debit_op = st.tuples(
    st.just("debit"),
    st.sampled_from(NODES),
    st.tuples(small, small, small, small, st.integers(min_value=0, max_value=3)),
    st.sampled_from([0.25, 0.5, 1.0, PolicySettings(borrow_share=0.5).shares]),  # KV's own
    st.integers(min_value=50, max_value=2_000),
    st.one_of(st.just(0), st.integers(min_value=1, max_value=20_000_000)),  # node time, us
)
op = st.one_of(
    debit_op,
    debit_op,
    st.tuples(
        st.just("lease"),
        st.sampled_from(NODES),
        st.sampled_from([0, 0, 0, 1]),  # epoch bump
        st.integers(min_value=-1, max_value=2),  # version step (<= 0 is stale)
        st.integers(min_value=0, max_value=60),  # credit value, 0 => zero lease
        st.integers(min_value=100, max_value=3_000),  # ttl (capped at MAX_TTL)
        st.integers(min_value=0, max_value=3),  # notices the snapshot missed
        st.sampled_from([0.0, 0.5, 1.0, 2.5, 7.0, 7 / 3, 0.1]),  # borrowed-prefill rate, tokens/s
    ),
    debit_op,
    st.tuples(
        st.just("commit"), st.integers(min_value=0, max_value=20), st.sampled_from([300, 3_000])
    ),
    st.tuples(st.just("release"), st.integers(min_value=0, max_value=20)),
    st.tuples(st.just("advance"), st.integers(min_value=0, max_value=400)),
    st.tuples(st.just("cordon"), st.sampled_from(NODES), st.booleans()),
)


def comparable(state: NodeState) -> tuple[Any, ...]:
    return (state.info, state.lease, state.open_debits, state.open_reservations, state.open_compute)


async def observe(store: Store, node_id: str, now_ms: int) -> tuple[Any, ...]:
    reservations = await store.list_reservations(node_id, now_ms)
    return (
        comparable(await store.get_node(node_id, now_ms)),
        [
            (r.state, r.debit, r.compute_us, r.expires_at_ms, r.grant_seq, r.release_seq)
            for r in reservations
        ],
        [(n.seq, n.kind, n.debit) for n in await store.read_notices(node_id, 0, 10_000)],
        await store.lease_history(node_id, 100),
        await store.node_events(node_id, 100),
    )


def debit_summary(outcome: DebitOutcome) -> tuple[Any, ...]:
    res = outcome.reservation
    held = (res.state, res.debit, res.compute_us, res.expires_at_ms, res.grant_seq) if res else None
    return (outcome.granted, outcome.refusal, outcome.short_credits, held)


async def call(coro: Any) -> Any:
    try:
        return await coro
    except CrossflowError as exc:
        return type(exc)


class Lockstep:
    def __init__(self, stores: list[Store]) -> None:
        self.stores = stores
        self.now = NOW
        self.ev = dict.fromkeys(NODES, (1, 0))
        self.granted: list[list[str]] = []  # per grant: the id in each store
        self.grants = 0
        self.stale = 0

    async def lease_op(
        self, node: str, bump: int, step: int, value: int, ttl: int, miss: int, rate: float
    ):
        epoch, version = self.ev[node]
        new = (epoch + 1, 1) if bump else (epoch, max(1, version + step))
        seq = (await self.stores[0].get_node(node, self.now)).info.notice_seq
        kw: dict[str, Any] = {} if value else {"zero_reason": ZeroReason.ITL_OVER_SLO}
        offer = lease(
            node,
            *new,
            value=value,
            ttl_ms=ttl,
            last_notice_seq=max(0, seq - miss),
            borrowed_prefill_rate_tps=rate,
            **kw,
        )
        stale = new <= self.ev[node]
        before = [await observe(s, node, self.now) for s in self.stores]
        outcomes = [await s.upsert_lease(offer, self.now, MAX_TTL) for s in self.stores]
        assert len(set(outcomes)) == 1, outcomes
        assert outcomes[0].accepted is not stale
        if stale:
            self.stale += 1
            assert [await observe(s, node, self.now) for s in self.stores] == before
        else:
            self.ev[node] = new

    async def debit_op(
        self, node: str, values: tuple[int, ...], share: Share, hold: int, compute_us: int
    ):
        debit = Credits.from_tuple(values)
        outs = [
            await s.try_debit(node, debit, share, self.now, hold, compute_us=compute_us)
            for s in self.stores
        ]
        assert debit_summary(outs[0]) == debit_summary(outs[1])
        if not outs[0].granted:
            return
        self.grants += 1
        self.granted.append([o.reservation.reservation_id for o in outs if o.reservation])
        for store in self.stores:
            state = await store.get_node(node, self.now)
            assert state.lease is not None
            limit, rate = state.lease.lease.credits, state.lease.lease.borrowed_prefill_rate_tps
            open_debits, time = state.open_debits, state.open_compute
            assert not over_committed(limit, open_debits, share, rate, time), (limit, open_debits)

    async def run(self, step: tuple[Any, ...]) -> None:
        kind = step[0]
        if kind == "lease":
            await self.lease_op(*step[1:])
        elif kind == "debit":
            await self.debit_op(*step[1:])
        elif kind in ("commit", "release") and self.granted:
            ids = self.granted[step[1] % len(self.granted)]
            if kind == "commit":
                outs = [
                    await call(s.commit(i, self.now, step[2]))
                    for s, i in zip(self.stores, ids, strict=True)
                ]
            else:
                outs = [
                    await call(s.release(i, self.now))
                    for s, i in zip(self.stores, ids, strict=True)
                ]
            plain = [o if isinstance(o, type) else (o.state, o.expires_at_ms) for o in outs]
            assert plain[0] == plain[1]
        elif kind == "advance":
            self.now += step[1]
        elif kind == "cordon":
            await self.stores[0].set_cordon(step[1], step[2], "prop", self.now)
            await self.stores[1].set_cordon(step[1], step[2], "prop", self.now)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(op, min_size=1, max_size=40))
async def test_random_interleavings_keep_the_invariants(
    redis_url: str, redis_namespace: str, steps: list[tuple[Any, ...]]
) -> None:
    redis_store = patient_redis_store(redis_url, f"{redis_namespace}-{uuid.uuid4().hex[:8]}")
    stores: list[Store] = [MemoryStore(seed=3), redis_store]
    try:
        for store in stores:
            await register(store, *NODES)
        run = Lockstep(stores)
        for node in NODES:  # start from live leases so that most examples grant something
            await run.lease_op(node, 0, 1, 60, MAX_TTL, 0, 1.0)
        for step in steps:
            await run.run(step)
        event(f"grants>0: {run.grants > 0}")
        event(f"stale leases>0: {run.stale > 0}")
        for node in NODES:
            views = [await observe(s, node, run.now) for s in stores]
            assert views[0] == views[1]
    finally:
        await redis_store.close()
