"""Lease ingest at fleet scale (issue #11): leases that arrive together share ``upsert_leases``
calls, yet each is still checked and stored on its own (one failing lease fails only itself);
waits are bounded per batch, not per lease; and the replica's admission caches follow its own
lease writes in place instead of emptying, and renew themselves off the request path."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from redis.asyncio import Redis

from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import NodeInfo, NodeState, StoredLease, ZeroReason
from crossflow_ctl.store.coalescer import Coalescer
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_cache import LenderSample, NodeCache
from tests.conftest import patient_redis_store
from tests.store.helpers import NOW, lease, register
from tests.store.test_redis_round_trips import CountingConnection, load

TTL = 60_000


async def test_a_failing_lease_fails_only_itself_within_its_batch(
    redis_url: str, redis_namespace: str
) -> None:
    store = patient_redis_store(redis_url, redis_namespace)
    raw = Redis.from_url(redis_url)
    try:
        await register(store, "d1", "d2", "d3")
        await raw.set(Keys(redis_namespace).node("d2").lease, "not a hash")  # WRONGTYPE
        before = store._ingest.batches
        outcomes = await asyncio.gather(
            *(store.upsert_lease(lease(n), NOW, TTL) for n in ("d1", "d2", "d3")),
            return_exceptions=True,
        )
        batches = store._ingest.batches - before
        d1, d3 = await store.get_node("d1", NOW), await store.get_node("d3", NOW)
    finally:
        await store.close()
        await raw.aclose()
    assert batches == 1
    assert isinstance(outcomes[1], StoreUnavailable)
    assert [o.accepted for o in (outcomes[0], outcomes[2])] == [True, True]  # type: ignore[union-attr]
    assert d1.lease is not None and d3.lease is not None


async def test_a_batch_writes_the_lender_index_in_its_own_round_trip(
    redis_url: str, redis_namespace: str
) -> None:
    """On a plain Redis the upsert script adds a lending lease's node to the lender index (scored
    by its expiry) and removes a zero or cordoned one: the batch is ONE round trip, with no
    pipeline of index writes after it."""
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace)
    keys, zero = Keys(redis_namespace), ZeroReason.ITL_OVER_SLO
    try:
        await register(store, "d1", "d2", "d3")
        for n in ("d2", "d3"):
            await store.upsert_lease(lease(n, ttl_ms=TTL), NOW, TTL)
        await store.set_cordon("d3", True, "maintenance", NOW)
        before = CountingConnection.sent
        await asyncio.gather(
            store.upsert_lease(lease("d1", ttl_ms=TTL), NOW + 1, TTL),
            store.upsert_lease(lease("d2", version=2, zero_reason=zero), NOW + 1, TTL),
            store.upsert_lease(lease("d3", version=2, ttl_ms=TTL), NOW + 1, TTL),
        )
        sent = CountingConnection.sent - before
        scores = [await client.zscore(keys.lenders(keys.bucket(n)), n) for n in ("d1", "d2", "d3")]
    finally:
        await store.close()
        await client.aclose()
    assert sent == 1
    assert scores == [NOW + 1 + TTL, None, None]


async def test_a_failing_lender_index_write_still_stores_the_lease(
    redis_url: str, redis_namespace: str
) -> None:
    """The index only steers sampling: a write to it that fails (here a bucket of the wrong
    type) must not turn a stored lease into an error."""
    store = patient_redis_store(redis_url, redis_namespace)
    raw = Redis.from_url(redis_url)
    keys = Keys(redis_namespace)
    try:
        await register(store, "d1")
        await raw.set(keys.lenders(keys.bucket("d1")), "not a zset")
        outcome = await store.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
        d1 = await store.get_node("d1", NOW)
    finally:
        await store.close()
        await raw.aclose()
    assert outcome.accepted
    assert d1.lease is not None and d1.lease.lease.version == 1


async def test_waits_are_bounded_per_batch_not_per_call() -> None:
    """A batch slower than the bound fails its callers; a call queued behind it past the bound
    fails when its turn comes, without running."""
    ran: list[Sequence[str]] = []

    async def run_batch(calls: Sequence[str]) -> list[Any]:
        ran.append(calls)
        if calls[0] == "slow":
            await asyncio.sleep(0.5)
        return [f"done {c}" for c in calls]

    coalescer: Coalescer[str] = Coalescer(run_batch, max_batch=1, max_in_flight=1, timeout_s=0.1)
    try:
        slow, queued = coalescer.submit("slow"), coalescer.submit("queued")
        results = await asyncio.gather(slow, queued, return_exceptions=True)
        after = await coalescer.submit("after")
    finally:
        await coalescer.close()
    assert [type(r) for r in results] == [TimeoutError, TimeoutError]
    assert after == "done after"
    assert ran == [["slow"], ["after"]]  # the queued call never ran


def test_a_coalescer_serves_each_loop_that_uses_it_in_turn() -> None:
    """Its futures are made on the loop of its last submit while that loop runs (no loop lookup
    per call): one used from a loop, then from the next once the first has stopped, answers on
    the loop that asks, and batches calls of one turn together on each."""
    ran: list[Sequence[str]] = []

    async def run_batch(calls: Sequence[str]) -> list[Any]:
        ran.append(calls)
        return [f"done {c}" for c in calls]

    coalescer: Coalescer[str] = Coalescer(run_batch, max_in_flight=1)

    async def use(*calls: str) -> list[Any]:
        futures = [coalescer.submit(c) for c in calls]
        assert all(f.get_loop() is asyncio.get_running_loop() for f in futures)
        return list(await asyncio.gather(*futures))

    first = asyncio.run(use("a", "b"))
    second = asyncio.run(use("c", "d"))
    assert (first, second) == (["done a", "done b"], ["done c", "done d"])
    assert ran == [["a", "b"], ["c", "d"]]


async def test_a_warm_view_takes_local_leases_in_place(
    redis_url: str, redis_namespace: str
) -> None:
    """A lease every agent period must not empty the cache: the entry takes the new lease (no
    read), and is dropped when the write purged reservations."""
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace, cache_max_age_ms=60_000)
    try:
        await register(store, "d1", "d2")
        for n in ("d1", "d2"):
            await store.upsert_lease(lease(n, ttl_ms=TTL), NOW, TTL)
        await store.put_pool_load(load(ttl_ms=TTL), NOW, TTL)
        await store.admission_view("default", [], 8, NOW)  # cold: draw, pool and views
        await store.upsert_lease(lease("d1", version=2, value=7, ttl_ms=TTL), NOW + 1, TTL)
        before = CountingConnection.sent
        _, nodes = await store.admission_view("default", [], 8, NOW + 2)
        warm = CountingConnection.sent - before
        grant = await store.try_debit("d2", lease("d2").credits, 1.0, NOW + 2, 10)
        await store.upsert_lease(lease("d2", version=2, ttl_ms=TTL), NOW + 20, TTL)  # purges
        (_, [d2]) = await store.admission_view("default", ["d2"], 8, NOW + 21)
    finally:
        await store.close()
        await client.aclose()
    assert warm == 0
    by_id = {n.info.node_id: n for n in nodes}
    assert by_id["d1"].lease is not None and by_id["d1"].lease.lease.version == 2
    assert by_id["d1"].lease.lease.credits.compute_tokens == 7
    assert grant.granted and d2.open_reservations == 0  # re-read after the purge


async def test_the_lender_draw_is_renewed_off_the_request_path(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past half its age bound, a warm Admit starts a renewal in the background and answers
    from the cache; after it, Admits past the first draw's bound still read nothing.

    The caches' ages run on a clock of the test's own: with real sleeps (0.25 s, then 0.2 s
    against a 0.4 s bound) a loaded machine slept past the bound and the warm Admit read."""
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace, cache_max_age_ms=400)
    clock = [0.0]
    for cache in store._view.caches:
        monkeypatch.setattr(cache, "_monotonic", lambda: clock[0])
    try:
        await register(store, "d1")
        await store.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
        await store.put_pool_load(load(ttl_ms=TTL), NOW, TTL)
        await store.admission_view("default", [], 8, NOW)  # cold
        clock[0] += 0.25  # past half the bound
        before = CountingConnection.sent
        _, warm = await store.admission_view("default", [], 8, NOW)
        on_request = CountingConnection.sent - before
        assert store._view.renewal is not None
        await store._view.renewal  # the renewal, in the background
        clock[0] += 0.2  # the first draw is past its bound now, the renewed one not
        before = CountingConnection.sent
        _, later = await store.admission_view("default", [], 8, NOW)
        after_bound = CountingConnection.sent - before
    finally:
        await store.close()
        await client.aclose()
    assert on_request == 0 and after_bound == 0
    assert [n.info.node_id for n in warm] == [n.info.node_id for n in later] == ["d1"]


def _state(node_id: str, cordoned: bool = False) -> NodeState:
    stored = StoredLease(lease=lease(node_id), received_at_ms=NOW, expires_at_ms=NOW + TTL)
    info = NodeInfo(node_id=node_id, cordoned=cordoned)
    return NodeState(info=info, lease=stored)


@pytest.mark.parametrize(
    ("purged", "cordoned", "kept"), [(0, False, True), (1, False, False), (0, True, False)]
)
def test_node_cache_takes_a_lease_in_place_unless_more_changed(
    purged: int, cordoned: bool, kept: bool
) -> None:
    cache = NodeCache(60_000)
    cache.put(_state("d1"), NOW)
    cache.leased(lease("d1", version=5), NOW + 1, NOW + 9, purged, cordoned)
    cache.leased(lease("d9", version=5), NOW + 1, NOW + 9, 0, False)  # not cached: ignored
    entry = cache.get("d1", NOW + 1)
    assert cache.get("d9", NOW + 1) is None
    if not kept:
        assert entry is None
        return
    assert entry is not None and entry.lease is not None
    assert (entry.lease.lease.version, entry.lease.expires_at_ms) == (5, NOW + 9)


def test_lender_draw_follows_local_index_changes() -> None:
    sample = LenderSample(60_000)
    working = sample.working_set([("d1", NOW + 10), ("d2", NOW + 10), ("d0", NOW)], 2, NOW)
    assert sorted(working) == [("d1", NOW + 10), ("d2", NOW + 10)]  # d0 expired
    sample.put(working, NOW)
    sample.changed({"d1": None, "d2": NOW + 50, "d3": NOW + 20, "d4": NOW + 20})
    # d1 stopped lending, d2 renewed, d3 joined; d4 found the working set (2) full.
    assert sorted(sample.pick(8, NOW + 30) or []) == ["d2"]
    assert sorted(sample.pick(8, NOW + 1) or []) == ["d2", "d3"]
    sample.changed({"d2": None, "d3": None})
    assert sample.pick(8, NOW) is None  # nothing left: absence is never cached
