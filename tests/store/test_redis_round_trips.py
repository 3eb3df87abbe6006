"""Round trips of the Redis store's hot paths on real Redis: the admission-path caches
(crossflow_ctl.store.redis_cache: round trips saved, failing closed when stale, absence never
cached, local writes seen at once, other replicas' writes seen after the age bound, node views
refreshed by debit replies), batched debits, and the notice relay's waiting read."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Connection, ConnectionPool, Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from crossflow_ctl.domain.errors import NotFound
from crossflow_ctl.domain.models import NodeRole, PoolLoad
from crossflow_ctl.store import redis_pipeline
from crossflow_ctl.store.base import DebitRequest, RequestRecord
from crossflow_ctl.store.redis_connect import RedisConnection, connect
from crossflow_ctl.store.redis_scripts import load_script
from crossflow_ctl.store.redis_store import RedisStore
from tests.conftest import eventually, patient_redis_store
from tests.store.helpers import NOW, credits, lease, register

TTL = 1_000


class CountingConnection(Connection):
    """A real connection that counts the packets it writes (one per round trip)."""

    sent = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        await super().send_packed_command(command, check_health)


def load(outstanding: int = 100_000, node_id: str = "p1", ttl_ms: int = TTL) -> PoolLoad:
    return PoolLoad(
        node_id=node_id,
        outstanding_uncached_tokens=outstanding,
        processing_rate_tps=10_000.0,
        ttl_ms=ttl_ms,
    )


@pytest.fixture
async def pair(redis_url: str, redis_namespace: str) -> AsyncIterator[tuple[RedisStore, ...]]:
    """Two replicas on one namespace; the first caches for a long time."""
    a = patient_redis_store(redis_url, redis_namespace, cache_max_age_ms=60_000)
    b = patient_redis_store(redis_url, redis_namespace)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_warm_admission_view_needs_no_round_trip(
    redis_url: str, redis_namespace: str
) -> None:
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace, cache_max_age_ms=60_000)
    try:
        await register(store, "d1", "d2")
        await store.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
        await store.upsert_lease(lease("d2", ttl_ms=TTL), NOW, TTL)
        await store.admission_view("default", ["d1", "d2"], 8, NOW)  # scripts known to Redis
        await client.script_load(load_script("draw_lenders"))
        await store.put_pool_load(load(), NOW, TTL)
        cold_before = CountingConnection.sent
        pool, nodes = await store.admission_view("default", [], 8, NOW)
        cold = CountingConnection.sent - cold_before
        warm_before = CountingConnection.sent
        again, nodes_again = await store.admission_view("default", [], 8, NOW + 1)
        warm = CountingConnection.sent - warm_before
        one_before = CountingConnection.sent
        _, one = await store.admission_view("default", ["d1"], 8, NOW + 2)
        single = CountingConnection.sent - one_before
    finally:
        await store.close()
        await client.aclose()
    assert pool is not None and again == pool
    assert sorted(n.info.node_id for n in nodes) == ["d1", "d2"]
    assert sorted(n.info.node_id for n in nodes_again) == ["d1", "d2"]
    assert [n.info.node_id for n in one] == ["d1"]
    assert cold == 1  # lender draw with the pool's reports (nodes cached by the first read)
    assert warm == 0  # pool, lender draw and node states all cached
    assert single == 0


async def test_cached_pool_fails_closed_once_a_report_expires(pair: tuple[RedisStore, ...]) -> None:
    a, _ = pair
    await a.put_pool_load(load(ttl_ms=TTL), NOW, TTL)
    fresh, _ = await a.admission_view("default", [], 0, NOW)
    assert fresh is not None and fresh.outstanding_uncached_tokens == 100_000
    expired, _ = await a.admission_view("default", [], 0, NOW + TTL)
    assert expired is None
    # A clock that went backwards re-reads rather than trusting what it cached.
    assert (await a.admission_view("default", [], 0, NOW - 10))[0] is not None


async def test_cached_pool_drops_an_expired_report_among_live_ones(
    pair: tuple[RedisStore, ...],
) -> None:
    a, _ = pair
    await a.put_pool_load(load(node_id="p1", ttl_ms=500), NOW, TTL)
    await a.put_pool_load(load(node_id="p2", ttl_ms=TTL), NOW, TTL)
    both, _ = await a.admission_view("default", [], 0, NOW)
    assert both is not None and len(both.reports) == 2
    later, _ = await a.admission_view("default", [], 0, NOW + 600)
    assert later is not None and [r.node_id for r in later.reports] == ["p2"]


async def test_local_write_is_seen_at_once_and_absence_is_never_cached(
    pair: tuple[RedisStore, ...],
) -> None:
    a, b = pair
    assert (await a.admission_view("default", [], 0, NOW))[0] is None
    await b.put_pool_load(load(outstanding=5), NOW, TTL)  # another replica
    first, _ = await a.admission_view("default", [], 0, NOW)
    assert first is not None and first.outstanding_uncached_tokens == 5
    await a.put_pool_load(load(outstanding=7), NOW, TTL)  # this replica
    second, _ = await a.admission_view("default", [], 0, NOW)
    assert second is not None and second.outstanding_uncached_tokens == 7


async def test_other_replicas_writes_are_seen_after_the_age_bound(
    redis_url: str, redis_namespace: str
) -> None:
    reader = patient_redis_store(redis_url, redis_namespace, cache_max_age_ms=20)
    writer = patient_redis_store(redis_url, redis_namespace)
    try:
        await writer.put_pool_load(load(outstanding=1), NOW, TTL)
        assert (await reader.admission_view("default", [], 0, NOW))[0] is not None
        await writer.put_pool_load(load(outstanding=2), NOW, TTL)
        seen = 1
        for _ in range(200):  # bounded; the cache entry is at most 20 ms old
            await asyncio.sleep(0.01)
            snapshot, _ = await reader.admission_view("default", [], 0, NOW)
            assert snapshot is not None
            seen = snapshot.outstanding_uncached_tokens
            if seen == 2:
                break
        assert seen == 2
    finally:
        await reader.close()
        await writer.close()


async def test_lender_draw_skips_expired_and_follows_local_changes(
    pair: tuple[RedisStore, ...],
) -> None:
    a, b = pair
    await register(a, "d1", "d2")
    await a.upsert_lease(lease("d1", ttl_ms=500), NOW, TTL)
    await a.upsert_lease(lease("d2", ttl_ms=TTL), NOW, TTL)
    _, nodes = await a.admission_view("default", [], 8, NOW)
    assert sorted(n.info.node_id for n in nodes) == ["d1", "d2"]
    _, later = await a.admission_view("default", [], 8, NOW + 600)
    assert [n.info.node_id for n in later] == ["d2"]  # d1's lease expired: not sampled
    await a.set_cordon("d2", True, "maintenance", NOW + 600)  # local change: draw renewed
    _, cordoned = await a.admission_view("default", [], 8, NOW + 600)
    assert cordoned == []
    # Nothing lends, so nothing is cached: another replica's new lease is sampled at once.
    await register(b, "d3")
    await b.upsert_lease(lease("d3", ttl_ms=TTL), NOW + 600, TTL)
    _, fresh = await a.admission_view("default", [], 8, NOW + 600)
    assert [n.info.node_id for n in fresh] == ["d3"]


async def test_a_lender_draw_drops_expired_lenders_from_the_index(
    pair: tuple[RedisStore, ...],
) -> None:
    """The draw (``draw_lenders.lua``, one call per bucket) cleans what it skips."""
    a, _ = pair
    await register(a, "d1")
    await a.upsert_lease(lease("d1", ttl_ms=500), NOW, TTL)
    bucket = a._k.lenders(a._k.bucket("d1"))
    assert await a._r.zscore(bucket, "d1") is not None
    _, later = await a.admission_view("default", [], 8, NOW + 600)
    assert later == []
    assert await a._r.zscore(bucket, "d1") is None


async def test_caches_off_reads_every_time(redis_url: str, redis_namespace: str) -> None:
    a = patient_redis_store(redis_url, redis_namespace, cache_max_age_ms=0)
    b = patient_redis_store(redis_url, redis_namespace)
    try:
        await register(a, "d1")
        await a.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
        await a.put_pool_load(load(outstanding=1), NOW, TTL)
        first, nodes = await a.admission_view("default", [], 8, NOW)
        assert first is not None and [n.info.node_id for n in nodes] == ["d1"]
        await b.put_pool_load(load(outstanding=2), NOW, TTL)
        second, _ = await a.admission_view("default", [], 8, NOW)
        assert second is not None and second.outstanding_uncached_tokens == 2
    finally:
        await a.close()
        await b.close()


async def test_a_waiting_read_with_notices_there_is_one_round_trip(
    redis_url: str, redis_namespace: str
) -> None:
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace)
    try:
        await register(store, "d1")
        await store.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
        await store.try_debit("d1", credits(1), 1.0, NOW, 100)
        await store.try_debit("d1", credits(1), 1.0, NOW, 100)
        # The first wait subscribes the store to notice wakes (its own connection, once).
        assert await store.read_notices("d1", 2, 10, block_ms=100) == []
        await eventually(lambda: store._notices.hub.live, "the wake subscription up")
        before = CountingConnection.sent
        found = await store.read_notices("d1", 0, 10, block_ms=10_000)
        sent = CountingConnection.sent - before
        assert [n.seq for n in await store.read_notices("d1", 1, 10, block_ms=10_000)] == [2]
        assert await store.read_notices("d1", 2, 10, block_ms=50) == []
        with pytest.raises(NotFound):
            await store.read_notices("ghost", 0, 10, block_ms=50)
    finally:
        await store.close()
        await client.aclose()
    assert [n.seq for n in found] == [1, 2]
    assert sent == 1


class CountingPool(ConnectionPool):
    """A real pool that counts its checkouts."""

    checkouts = 0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self.checkouts += 1
        return await super().get_connection(*args, **kwargs)


async def test_notice_reads_keep_one_connection_and_outlive_its_loss(
    redis_url: str, redis_namespace: str
) -> None:
    """A relay's reads go out on one kept connection, not a pool checkout each (a lock, a
    timer and a socket probe per wake of every agent stream); one Redis closed while it sat
    idle is replaced by the next read, which still returns the notices."""
    pool = CountingPool.from_url(redis_url)
    client: Redis = Redis(connection_pool=pool)
    killer: Redis = Redis.from_url(redis_url)
    store = patient_redis_store(client, redis_namespace)
    try:
        await register(store, "d1")
        await store.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
        await store.try_debit("d1", credits(1), 1.0, NOW, 100)
        assert [n.seq for n in await store.read_notices("d1", 0, 10, block_ms=0)] == [1]
        before = pool.checkouts
        for _ in range(5):
            assert [n.seq for n in await store.read_notices("d1", 0, 10, block_ms=0)] == [1]
        assert pool.checkouts == before
        kept = store._notices._line._conn  # type: ignore[union-attr]
        assert kept is not None
        writer = kept._writer
        assert writer is not None
        host, port = writer.get_extra_info("sockname")[:2]
        assert await killer.execute_command("CLIENT", "KILL", "ADDR", f"{host}:{port}")
        await asyncio.sleep(0.05)  # the close reaches the client's socket
        after_loss = [n.seq for n in await store.read_notices("d1", 0, 10, block_ms=0)]
    finally:
        await store.close()
        await client.aclose()
        await pool.aclose()
        await killer.aclose()
    assert after_loss == [1]


async def test_a_replica_that_never_saw_the_node_checks_it_exists(
    pair: tuple[RedisStore, ...],
) -> None:
    a, b = pair
    await register(a, "d1")  # through a: b has never seen d1
    await a.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
    await a.try_debit("d1", credits(1), 1.0, NOW, 100)
    assert [n.seq for n in await b.read_notices("d1", 0, 10, block_ms=10_000)] == [1]
    assert await b.read_notices("d1", 1, 10, block_ms=20) == []  # known now: XREAD only
    with pytest.raises(NotFound):
        await b.read_notices("d2", 0, 10, block_ms=20)


async def test_parsed_node_info_follows_every_change(pair: tuple[RedisStore, ...]) -> None:
    """Info and lease are parsed once per stored form; changes still show on the next read."""
    a, b = pair
    await a.register_node("d1", NodeRole.DECODE, "default", {"zone": "a"}, NOW)
    await a.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
    first = await a.get_node("d1", NOW)
    await a.try_debit("d1", credits(1), 1.0, NOW, 100)
    second = await a.get_node("d1", NOW)
    await b.register_node("d1", NodeRole.DECODE, "default", {"zone": "b"}, NOW)
    await b.set_cordon("d1", True, "maintenance", NOW)
    await b.upsert_lease(lease("d1", version=2, value=50, ttl_ms=TTL), NOW, TTL)
    third = await a.get_node("d1", NOW)
    assert (first.info.notice_seq, second.info.notice_seq, third.info.notice_seq) == (0, 1, 2)
    assert first.info.labels == second.info.labels == {"zone": "a"}
    assert third.info.labels == {"zone": "b"}
    assert not second.info.cordoned and third.info.cordoned
    assert third.info.cordon_reason == "maintenance"
    assert second.open_debits == credits(1) and second.open_reservations == 1
    assert first.lease is not None and third.lease is not None
    assert (first.lease.lease.version, third.lease.lease.version) == (1, 2)
    assert third.lease.lease.credits == credits(50)
    assert third == await b.get_node("d1", NOW)


async def test_warm_admission_is_one_round_trip_and_debits_refresh_the_view(
    redis_url: str, redis_namespace: str
) -> None:
    """Plan on the cached view (no trip), debit (one trip); the debit's reply is the new view."""
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace, cache_max_age_ms=60_000)
    try:
        await register(store, "d1")
        await store.upsert_lease(lease("d1", ttl_ms=TTL), NOW, TTL)
        await store.put_pool_load(load(), NOW, TTL)
        await store.admission_view("default", [], 8, NOW)  # cold: fills the caches
        # The debit's own connection opens once per store (a refusal that changes nothing).
        assert (await store.try_debit("ghost", credits(3), 1.0, NOW, 500)).refusal == "unknown_node"
        before = CountingConnection.sent
        _, nodes = await store.admission_view("default", [], 8, NOW + 1)
        out = await store.try_debit("d1", credits(3), 1.0, NOW + 1, 500)
        _, after = await store.admission_view("default", [], 8, NOW + 2)
        trips = CountingConnection.sent - before
        fresh = await store.get_node("d1", NOW + 2)
    finally:
        await store.close()
        await client.aclose()
    assert out.granted
    assert [n.open_reservations for n in nodes] == [0]
    assert trips == 1
    assert after[0].open_debits == credits(3) == fresh.open_debits
    assert after[0].open_reservations == 1 == fresh.open_reservations


async def test_a_cached_view_never_over_commits_and_is_dropped_when_the_debit_disagrees(
    pair: tuple[RedisStore, ...],
) -> None:
    """Another replica shrinks the lease and cordons: the cached view still says roomy, but the
    debit script checks the live lease; its reply drops the stale entry."""
    a, b = pair
    await register(a, "d1")
    await a.upsert_lease(lease("d1", value=100, ttl_ms=TTL), NOW, TTL)
    (_, [seen]) = await a.admission_view("default", ["d1"], 8, NOW)
    await b.upsert_lease(lease("d1", version=2, value=10, ttl_ms=TTL), NOW, TTL)
    (_, [stale]) = await a.admission_view("default", ["d1"], 8, NOW)
    assert stale == seen  # within the age bound: planned on the cached lease ...
    refused = await a.try_debit("d1", credits(50), 1.0, NOW, 500)
    assert not refused.granted and refused.refusal == "short"  # ... checked against the live one
    assert refused.lease_version == 2
    (_, [fresh]) = await a.admission_view("default", ["d1"], 8, NOW)
    assert fresh.lease is not None and fresh.lease.lease.version == 2  # entry dropped, re-read
    # A grant refreshes the entry from the reply; a cordon elsewhere is caught by the script.
    assert (await a.try_debit("d1", credits(4), 1.0, NOW, 500)).granted
    await b.set_cordon("d1", True, "maintenance", NOW)
    (_, [cached]) = await a.admission_view("default", ["d1"], 8, NOW)
    assert not cached.info.cordoned and cached.open_debits == credits(4)
    cordoned = await a.try_debit("d1", credits(1), 1.0, NOW, 500)
    assert cordoned.refusal == "cordoned"
    (_, [now_seen]) = await a.admission_view("default", ["d1"], 8, NOW)
    assert now_seen.info.cordoned


async def test_cached_node_views_are_bounded_in_age_and_by_the_clock(
    redis_url: str, redis_namespace: str
) -> None:
    reader = patient_redis_store(redis_url, redis_namespace, cache_max_age_ms=20)
    writer = patient_redis_store(redis_url, redis_namespace)
    try:
        await register(writer, "d1")
        await writer.upsert_lease(lease("d1", ttl_ms=60_000), NOW, 60_000)
        assert (await reader.admission_view("default", ["d1"], 8, NOW))[1][0].open_reservations == 0
        await writer.try_debit("d1", credits(1), 1.0, NOW, 60_000)
        # A clock that went backwards re-reads rather than trusting what it cached.
        (_, [back]) = await reader.admission_view("default", ["d1"], 8, NOW - 1)
        assert back.open_reservations == 1
        await writer.try_debit("d1", credits(1), 1.0, NOW, 60_000)
        seen = 1
        for _ in range(200):  # bounded; the entry is at most 20 ms old
            await asyncio.sleep(0.01)
            seen = (await reader.admission_view("default", ["d1"], 8, NOW))[1][0].open_reservations
            if seen == 2:
                break
        assert seen == 2
    finally:
        await reader.close()
        await writer.close()


async def test_a_batch_of_debits_is_one_round_trip_each_atomic_in_order(
    redis_url: str, redis_namespace: str
) -> None:
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace)
    try:
        await register(store, "d1", "d2")
        await store.upsert_lease(lease("d1", value=10, ttl_ms=TTL), NOW, TTL)
        await store.upsert_lease(lease("d2", value=10, ttl_ms=TTL), NOW, TTL)
        # The script is loaded; the single debit's own connection and a pooled one are open.
        await store.try_debit("d1", credits(0), 1.0, NOW, 100)
        pair = [DebitRequest("d1", credits(0)), DebitRequest("d2", credits(0))]
        await store.try_debits(pair, 1.0, NOW, 100)
        batch = [
            DebitRequest("d1", credits(6), "r0"),
            DebitRequest("d2", credits(6), "r1"),
            DebitRequest("d1", credits(6), "r2"),  # after r0 on the same node: no room left
            DebitRequest("ghost", credits(1), "r3"),
            DebitRequest("bad id!", credits(1), "r4"),
            DebitRequest("d1", credits(4), "r5"),
        ]
        before = CountingConnection.sent
        outs = await store.try_debits(batch, 1.0, NOW, 100)
        trips = CountingConnection.sent - before
        # NOSCRIPT (a restarted Redis): the calls that met it are sent again, once.
        store._scripts.by_name["try_debit"].sha = "0" * 40
        again = await store.try_debits([DebitRequest("d2", credits(4), "r6")] * 2, 1.0, NOW, 100)
        open_d1 = (await store.get_node("d1", NOW)).open_debits
    finally:
        await store.close()
        await client.aclose()
    assert trips == 1
    assert [o.granted for o in outs] == [True, True, False, False, False, True]
    assert [o.refusal for o in outs[2:5]] == ["short", "unknown_node", "unknown_node"]
    assert [o.reservation.request_id for o in outs if o.reservation] == ["r0", "r1", "r5"]
    assert open_d1 == credits(10)
    assert [o.granted for o in again] == [True, False]


@pytest.mark.parametrize(
    ("request_id", "owner"),
    [
        ("", ""),
        ("q:1,2|3\x1f", "router/a.b_c-1"),  # the header's separators inside a free text
        ("é→≠:9,", "router/x"),  # multi-byte text: lengths are counted in bytes
    ],
)
async def test_a_packed_debit_keeps_its_free_texts_and_record_whole(
    redis_url: str, redis_namespace: str, request_id: str, owner: str
) -> None:
    """One argument per debit: the request id, owner and record text come back exactly as
    sent, whatever bytes they hold, and the debit after it in the same call is unaffected."""
    store = patient_redis_store(redis_url, redis_namespace)
    payload = '{"decision":"borrow","message":"ok: é,:|"}'
    record = RequestRecord(f"key:{request_id}", 60_000, payload)
    try:
        await register(store, "d1")
        await store.upsert_lease(lease("d1", value=10, ttl_ms=TTL), NOW, TTL)
        outs = await store.try_debits(
            [
                DebitRequest("d1", credits(2), request_id, owner, record),
                DebitRequest("d1", credits(3), "next", "router/z"),
            ],
            1.0,
            NOW,
            100,
        )
        stored = await store._r.get(store._k.request(record.key))
        held = await store.list_reservations("d1", NOW)
    finally:
        await store.close()
    first, second = (o.reservation for o in outs)
    assert first is not None and second is not None
    assert (first.request_id, first.owner, first.debit) == (request_id, owner, credits(2))
    assert (second.request_id, second.owner, second.debit) == ("next", "router/z", credits(3))
    assert {(r.request_id, r.owner) for r in held} == {(request_id, owner), ("next", "router/z")}
    assert json.loads(stored) == {
        "reservation_id": first.reservation_id,
        "expires_at_ms": NOW + 100,
        "lease_epoch": first.lease_epoch,
        "lease_version": first.lease_version,
        "decision": "borrow",
        "message": "ok: é,:|",
    }


async def test_a_kept_connection_that_redis_refused_is_not_sent_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After Redis went away, a read goes out once: the first failed read dropped the kept
    connection, which connects anew on its own, so a resend would only knock twice."""

    async def answers_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while b"GET" not in (data := await reader.read(65536)):  # the connection's set-up
            writer.write(b"+OK\r\n" * len(re.findall(rb"(?:^|\r\n)\*\d+\r\n", data)))
        writer.write(b"$-1\r\n")  # the GET's nil
        await writer.drain()
        server.close()  # then Redis is gone: the socket closes, new connections are refused
        writer.close()

    server = await asyncio.start_server(answers_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    trips: list[int] = []
    round_trip = redis_pipeline._round_trip

    async def counted(*args: Any) -> list[Any]:
        trips.append(1)
        return await round_trip(*args)

    monkeypatch.setattr(redis_pipeline, "_round_trip", counted)
    client: Any = connect(f"redis://127.0.0.1:{port}/0", RedisConnection(), 1.0)
    line = redis_pipeline.KeptConnection(client)
    try:
        assert await line.send_all([("GET", "k")]) == [None]  # kept from here
        await server.wait_closed()
        with pytest.raises(RedisConnectionError):
            await line.send_all([("GET", "k")])  # on the kept one, then resent: both fail
        trips.clear()
        with pytest.raises(RedisConnectionError):
            await line.send_all([("GET", "k")])
    finally:
        await line.close()
        await client.aclose(close_connection_pool=True)
    assert trips == [1]
