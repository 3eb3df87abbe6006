"""Fleet scale on real Redis (issue #11): notices for many agent streams through a bounded
number of connections, and lease upserts coalesced into pipelines without weakening the
monotonic check."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from crossflow_ctl.domain.models import NoticeKind
from crossflow_ctl.store.redis_store import RedisStore
from tests.conftest import PATIENCE_S, eventually, patient_redis_store
from tests.store.helpers import NOW, credits, lease, register

NODES = 300
FEW = 4
"""The wake subscription, two pipelines of reads in flight, and one for the rest."""


async def _connections(redis_url: str, name: str) -> int:
    client = aioredis.Redis.from_url(redis_url)
    try:
        listing = await client.client_list()
    finally:
        await client.aclose()
    return sum(1 for c in listing if c.get("name") == name)


def _count_ranges(store: RedisStore) -> list[int]:
    """Wrap the store's notice XRANGE so a test can count it; the list's one item is the count."""
    count = [0]
    real = store._notices._range

    async def counting(*args: object) -> object:
        count[0] += 1
        return await real(*args)  # type: ignore[arg-type]

    store._notices._range = counting  # type: ignore[method-assign,assignment]
    return count


async def _subscriptions(admin: aioredis.Redis, name: str) -> list[dict[str, Any]]:
    """The store's pub/sub connections that Redis lists, once there is one."""

    async def listed() -> list[dict[str, Any]]:
        clients = await admin.client_list()
        return [c for c in clients if c.get("name") == name and "subscribe" in c.get("cmd", "")]

    return await eventually(listed, f"a subscription named {name}")


async def test_many_waiting_relays_share_a_bounded_set_of_connections(
    redis_url: str, redis_namespace: str
) -> None:
    """300 relays wait at once on a store allowed 8 connections (one blocking XREAD each
    needed 300 and failed past the pool's size); every one wakes on its own node's notice."""
    store = patient_redis_store(redis_url, redis_namespace, max_connections=8)
    nodes = [f"d{i:03d}" for i in range(NODES)]
    try:
        await register(store, *nodes)
        await asyncio.gather(*(store.upsert_lease(lease(n), NOW, 60_000) for n in nodes))
        readers = [
            asyncio.create_task(store.read_notices(n, 0, 10, block_ms=20_000)) for n in nodes
        ]
        await asyncio.sleep(0.5)
        assert not any(r.done() for r in readers)
        timers = len(store._notices.hub.deadlines)  # shared: not one per waiting read
        waiting = await _connections(redis_url, f"crossflow:{redis_namespace}")
        grants = await asyncio.gather(
            *(store.try_debit(n, credits(1), 1.0, NOW, 60_000) for n in nodes)
        )
        got = await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
        busy = await _connections(redis_url, f"crossflow:{redis_namespace}")
    finally:
        await store.close()
    assert all(g.granted for g in grants)
    for node, notices, grant in zip(nodes, got, grants, strict=True):
        assert grant.reservation is not None
        assert [(n.node_id, n.seq, n.reservation_id) for n in notices] == [
            (node, 1, grant.reservation.reservation_id)
        ]
    assert 1 <= waiting <= 8 and busy <= 8
    assert 1 <= timers < NODES // 10  # one per second of registrations, not one per read


async def test_a_wait_with_no_notice_costs_no_round_trip_once_subscribed(
    redis_url: str, redis_namespace: str
) -> None:
    store = patient_redis_store(redis_url, redis_namespace)
    try:
        await register(store, "d1")
        await store.read_notices("d1", 0, 10, block_ms=300)  # subscribes, reads once
        hub = store._notices.hub
        await eventually(lambda: hub.live, "the wake subscription up")
        ranges = _count_ranges(store)
        for _ in range(3):
            assert await store.read_notices("d1", 0, 10, block_ms=30) == []
        idle_calls = ranges[0]
        await store.upsert_lease(lease("d1"), NOW, 60_000)
        await store.try_debit("d1", credits(1), 1.0, NOW, 60_000)
        woke = await store.read_notices("d1", 0, 10, block_ms=5_000)
    finally:
        await store.close()
    assert idle_calls == 0
    assert [n.seq for n in woke] == [1] and ranges[0] == 1


async def test_the_read_after_the_notices_it_found_waits_for_a_wake_not_a_round_trip(
    redis_url: str, redis_namespace: str
) -> None:
    """A relay's read that found notices (fewer than asked) and the next read after them: one
    XRANGE, not a second one that finds nothing; a later notice still wakes it."""
    store = patient_redis_store(redis_url, redis_namespace)
    try:
        await register(store, "d1")
        await store.upsert_lease(lease("d1"), NOW, 60_000)
        await store.read_notices("d1", 0, 10, block_ms=300)  # subscribes, reads once
        hub = store._notices.hub
        await eventually(lambda: hub.live, "the wake subscription up")
        ranges = _count_ranges(store)
        wakes = hub.wakes
        await store.try_debit("d1", credits(1), 1.0, NOW, 60_000)
        # its wake is in before the read (a later one would read again)
        await eventually(lambda: hub.wakes > wakes, "the debit's wake")
        found = await store.read_notices("d1", 0, 10, block_ms=5_000)
        after = await store.read_notices("d1", found[-1].seq, 10, block_ms=30)
        reads_for_one = ranges[0]
        await store.try_debit("d1", credits(1), 1.0, NOW, 60_000)
        woke = await store.read_notices("d1", found[-1].seq, 10, block_ms=5_000)
    finally:
        await store.close()
    assert [n.seq for n in found] == [1] and after == []
    assert reads_for_one == 1
    assert [n.seq for n in woke] == [2]


async def test_leases_arriving_together_go_in_few_pipelines_and_stay_monotonic(
    redis_url: str, redis_namespace: str
) -> None:
    store = patient_redis_store(redis_url, redis_namespace)
    nodes = [f"d{i:03d}" for i in range(200)]
    try:
        await register(store, *nodes)
        before = store._ingest.batches
        newer = [store.upsert_lease(lease(n, version=2), NOW, 60_000) for n in nodes]
        older = [store.upsert_lease(lease(n, version=1), NOW, 60_000) for n in nodes]
        outcomes = await asyncio.gather(*newer, *older)
        batches = store._ingest.batches - before
        states = {s.info.node_id: s for s in await store.list_nodes(NOW)}
        view = await store.admission_view("default", [], 400, NOW)
    finally:
        await store.close()
    assert [o.accepted for o in outcomes] == [True] * 200 + [False] * 200
    assert {(o.stored_epoch, o.stored_version) for o in outcomes} == {(1, 2)}
    assert 1 <= batches < 20
    assert all(s.lease is not None and s.lease.lease.version == 2 for s in states.values())
    assert len(view[1]) == 200  # every node reached the (bucketed) lender index


async def test_a_broken_wake_subscription_loses_no_notice(
    redis_url: str, redis_namespace: str
) -> None:
    """Kill the store's own pub/sub connection while a relay waits: the waiter reads its
    stream again (and polls until the subscription is back), so the notice still arrives."""
    store = patient_redis_store(redis_url, redis_namespace)
    writer = patient_redis_store(redis_url, redis_namespace)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        await register(store, "d1")
        await writer.upsert_lease(lease("d1"), NOW, 60_000)
        await store.read_notices("d1", 0, 10, block_ms=200)  # subscribes
        await eventually(lambda: store._notices.hub.live, "the wake subscription up")
        generation = store._notices.hub.generation
        reader = asyncio.create_task(store.read_notices("d1", 0, 10, block_ms=20_000))
        await asyncio.sleep(0.2)  # the reader waits (were it later, it reads all the same)
        ours = await _subscriptions(admin, f"crossflow:{redis_namespace}")
        assert len(ours) == 1
        await admin.client_kill_filter(_id=ours[0]["id"])
        granted = await writer.try_debit("d1", credits(1), 1.0, NOW, 60_000)
        notices = await asyncio.wait_for(reader, timeout=PATIENCE_S)
        hub = store._notices.hub
        await eventually(  # and the subscription comes back on its own
            lambda: hub.live and hub.generation > generation + 1, "the subscription back"
        )
    finally:
        await store.close()
        await writer.close()
        await admin.aclose()
    assert granted.reservation is not None
    assert [n.reservation_id for n in notices] == [granted.reservation.reservation_id]
    assert store._notices.hub.generation > generation + 1


async def test_one_lease_batch_that_expires_holds_on_two_nodes_wakes_both(
    redis_url: str, redis_namespace: str
) -> None:
    """upsert_leases purges expired holds of every lease in its call: each node whose stream got
    an EXPIRE notice is woken, not only the first (a relay that found its stream drained waits
    for a wake before it reads again)."""
    store = patient_redis_store(redis_url, redis_namespace)
    listener = aioredis.Redis.from_url(redis_url)
    pubsub = listener.pubsub()
    try:
        await register(store, "d1", "d2")
        for node in ("d1", "d2"):
            await store.upsert_lease(lease(node, version=1), NOW, 60_000)
            await store.try_debit(node, credits(1), 1.0, NOW, 10)
        await pubsub.subscribe(f"{redis_namespace}:notices")
        await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
        before = store._ingest.batches
        await asyncio.gather(
            *(store.upsert_lease(lease(n, version=2), NOW + 1_000, 60_000) for n in ("d1", "d2"))
        )
        batches = store._ingest.batches - before
        woken: set[bytes] = set()
        deadline = asyncio.get_running_loop().time() + PATIENCE_S  # a hang guard
        while woken != {b"d1", b"d2"} and asyncio.get_running_loop().time() < deadline:
            message = await pubsub.get_message(timeout=0.2)
            if message is not None and message["type"] == "message":
                woken.add(message["data"])
        expired = {n: await store.read_notices(n, 1, 10) for n in ("d1", "d2")}
    finally:
        await pubsub.aclose()
        await listener.aclose()
        await store.close()
    assert batches == 1, "both leases must go in one script call for this test to mean anything"
    assert all([x.kind for x in notices] == [NoticeKind.EXPIRE] for notices in expired.values())
    assert woken == {b"d1", b"d2"}


async def test_relays_woken_together_read_in_few_pipelines_on_few_connections(
    redis_url: str, redis_namespace: str
) -> None:
    """300 relays start waiting at once, and a break of the wake subscription wakes them all at
    once again (so does its return): their reads go out as a few pipelines of XRANGEs on a few
    connections, not one round trip and one connection each (the pool opened all 64 it may),
    and every relay still gets its own node's notice."""
    store = patient_redis_store(redis_url, redis_namespace, max_connections=64)
    admin = aioredis.Redis.from_url(redis_url)
    nodes = [f"d{i:03d}" for i in range(NODES)]
    name = f"crossflow:{redis_namespace}"
    try:
        await register(store, *nodes)
        await asyncio.gather(*(store.upsert_lease(lease(n), NOW, 60_000) for n in nodes))
        await store.read_notices(nodes[0], 0, 10, block_ms=200)  # subscribes
        await eventually(lambda: store._notices.hub.live, "the wake subscription up")
        readers = [
            asyncio.create_task(store.read_notices(n, 0, 10, block_ms=20_000)) for n in nodes
        ]
        await asyncio.sleep(0.3)
        before = await _connections(redis_url, name)
        ours = await _subscriptions(admin, name)
        await admin.client_kill_filter(_id=ours[0]["id"])  # every relay reads again, at once
        await asyncio.sleep(1.0)  # and again when the subscription is back
        assert not any(r.done() for r in readers)
        burst = await _connections(redis_url, name)
        grants = [await store.try_debit(n, credits(1), 1.0, NOW, 60_000) for n in nodes]
        got = await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
    finally:
        await store.close()
        await admin.aclose()
    for node, notices, grant in zip(nodes, got, grants, strict=True):
        assert grant.reservation is not None
        assert [(n.node_id, n.reservation_id) for n in notices] == [
            (node, grant.reservation.reservation_id)
        ]
    assert 1 <= before <= FEW and 1 <= burst <= FEW, (before, burst)
