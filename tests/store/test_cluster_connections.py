"""A Redis Cluster store's callers wait for a connection at the bound instead of failing.

redis-py's cluster client raises MaxConnectionsError as soon as a node's connections are all
busy (its standalone BlockingConnectionPool waits): with the default bound of 16, a burst of 200
reports lost some of them (StoreUnavailable)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from crossflow_ctl.domain.models import PoolLoad
from crossflow_ctl.store.redis_cluster import BoundedCluster
from crossflow_ctl.store.redis_store import DEFAULT_MAX_CONNECTIONS, RedisStore
from tests.conftest import delete_cluster_namespace, patient_redis_store
from tests.store.helpers import NOW, credits, lease, register

BURST = 240
NODES = 32


@pytest.fixture
def cluster_namespace(redis_cluster_url: str) -> Iterator[str]:
    namespace = f"cfb-{uuid.uuid4().hex[:12]}"
    yield namespace
    delete_cluster_namespace(redis_cluster_url, namespace)


async def _connections_per_master(url: str, name: str) -> list[int]:
    """The store's connections (by client name) open on each master."""
    client = await aioredis.RedisCluster.from_url(url).initialize()
    try:
        counts = []
        for node in client.get_primaries():
            listing = await client.client_list(target_nodes=node)
            counts.append(sum(1 for c in listing if c.get("name") == name))
        print("store connections per master:", counts)
        return counts
    finally:
        await client.aclose()


async def test_a_burst_past_the_bound_waits_and_every_call_succeeds(
    redis_cluster_url: str, cluster_namespace: str
) -> None:
    """Reports, leases and debits (single scripts and pipelines) all at once, while relays wait
    on the wake subscription: every call succeeds, and no master sees more of the store's
    connections than the bound (redis-py keeps the ones it opened, so the count after the burst
    is the most it held)."""
    store = patient_redis_store(redis_cluster_url, cluster_namespace, cluster=True)
    try:
        outcomes, grants, got, per_master = await _burst(
            store, redis_cluster_url, f"crossflow:{cluster_namespace}"
        )
    finally:
        await store.close()
    assert [o for o in outcomes if isinstance(o, BaseException)] == []
    assert [g for g in grants if isinstance(g, BaseException)] == []
    assert all(g.granted for g in grants if not isinstance(g, BaseException))
    assert all(len(notices) >= 1 for notices in got)
    assert len(per_master) == 3
    assert all(1 <= n <= DEFAULT_MAX_CONNECTIONS for n in per_master), per_master


async def _burst(
    store: RedisStore, url: str, name: str
) -> tuple[list[Any], list[Any], list[Any], list[int]]:
    nodes = [f"d{i:02d}" for i in range(NODES)]
    await register(store, *nodes)
    relays = [asyncio.create_task(store.read_notices(n, 0, 10, block_ms=20_000)) for n in nodes[:4]]

    async def report(i: int) -> None:
        load = PoolLoad(
            node_id=f"p{i}", outstanding_uncached_tokens=1, processing_rate_tps=1.0, ttl_ms=5_000
        )
        await store.put_pool_load(load, NOW, 5_000)

    calls = [report(i) for i in range(BURST)]
    calls += [store.upsert_lease(lease(n, ttl_ms=60_000), NOW, 60_000) for n in nodes]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    grants = await asyncio.gather(
        *(store.try_debit(n, credits(1), 1.0, NOW, 60_000) for n in nodes for _ in range(4)),
        return_exceptions=True,
    )
    got = await asyncio.wait_for(asyncio.gather(*relays), timeout=30)
    per_master = await _connections_per_master(url, name)
    return outcomes, grants, got, per_master


async def test_a_call_that_finds_no_permit_in_time_fails_as_the_standalone_pool_does(
    redis_cluster_url: str, cluster_namespace: str
) -> None:
    """One permit, held by a blocking pop: the next call gives up after ``wait_s`` with the
    ConnectionError BlockingConnectionPool raises (the store's StoreUnavailable)."""
    client = BoundedCluster.from_url(redis_cluster_url, permits=1, wait_s=0.05)
    key = f"{cluster_namespace}:q"
    try:
        pop = asyncio.create_task(client.blpop([key], timeout=10))
        await asyncio.sleep(0)  # the pop takes the only permit (and holds it while it waits)
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await client.get(f"{cluster_namespace}:other")
        assert not pop.done()
        async with BoundedCluster.from_url(redis_cluster_url, permits=1, wait_s=1.0) as other:
            await other.rpush(key, b"x")
        assert await pop == (key.encode(), b"x")
    finally:
        await client.aclose()


async def test_a_pipeline_resending_a_redirected_command_does_not_wait_for_itself(
    redis_cluster_url: str, cluster_namespace: str
) -> None:
    """A pipeline sent to the wrong master (a stale slot map) resends the MOVED command on its
    own, under the permit it holds: with one permit, waiting for a second would time out."""
    client = await BoundedCluster.from_url(redis_cluster_url, permits=1, wait_s=1.0).initialize()
    key = f"{cluster_namespace}:k"
    try:
        await client.set(key, b"v")
        slot = client.keyslot(key)
        owner = client.nodes_manager.slots_cache[slot][0]
        stranger = next(n for n in client.get_primaries() if n.name != owner.name)
        client.nodes_manager.slots_cache[slot] = [stranger]  # the map goes stale
        pipe = client.pipeline(transaction=False)
        pipe.get(key)
        assert await pipe.execute() == [b"v"]
    finally:
        await client.aclose()
