"""RedisStore beyond the contract: concurrent routers and agents, a dead or silent Redis."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.asyncio import Redis

from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import CREDIT_NAMES, ComputeTime, Credits, Lease, NoticeKind
from crossflow_ctl.store.base import Store
from crossflow_ctl.store.redis_scripts import load_script
from crossflow_ctl.store.redis_store import RedisStore
from tests.conftest import free_port, patient_redis_store
from tests.store.helpers import NOW, credits, lease, register

SHARE = 0.5


async def race(
    stores: list[RedisStore], lease_values: list[int], debits: int, seed: int
) -> tuple[list[Credits], int]:
    """``debits`` concurrent try_debit calls over ``stores`` while leases keep changing."""
    rng = random.Random(seed)
    asks = [
        Credits.from_tuple([rng.randint(1, 60) for _ in CREDIT_NAMES[:4]] + [1])
        for _ in range(debits)
    ]

    async def agent() -> int:
        accepted = 0
        for version, value in enumerate(lease_values, start=2):
            offer = lease(version=version, value=value, ttl_ms=60_000)
            accepted += (
                await stores[version % len(stores)].upsert_lease(offer, NOW, 60_000)
            ).accepted
            await asyncio.sleep(0)
        return accepted

    async def router(i: int, ask: Credits) -> Credits | None:
        out = await stores[i % len(stores)].try_debit("d1", ask, SHARE, NOW, 60_000)
        return out.reservation.debit if out.reservation else None

    results = await asyncio.gather(agent(), *(router(i, a) for i, a in enumerate(asks)))
    granted = [r for r in results[1:] if isinstance(r, Credits)]
    accepted = results[0]
    assert isinstance(accepted, int)
    return granted, accepted


@pytest.fixture
async def clients(redis_url: str, redis_namespace: str) -> AsyncIterator[list[RedisStore]]:
    # 300 racing calls on a shared, loaded test Redis: a roomy socket timeout keeps a slow moment
    # from failing the race (the invariant checked does not depend on timing).
    stores = [
        RedisStore(redis_url, namespace=redis_namespace, socket_timeout_s=10.0, op_timeout_s=20.0)
        for _ in range(4)
    ]
    try:
        yield stores
    finally:
        for s in stores:
            await s.close()


@pytest.mark.parametrize("varying", [False, True], ids=["steady-lease", "changing-lease"])
async def test_concurrent_debits_never_over_commit(
    clients: list[RedisStore], varying: bool
) -> None:
    await register(clients[0], "d1")
    await clients[0].upsert_lease(lease(version=1, value=1_000, ttl_ms=60_000), NOW, 60_000)
    rng = random.Random(5)
    values = [rng.randint(600, 1_000) if varying else 1_000 for _ in range(30)]
    granted, accepted = await race(clients, values, debits=300, seed=11)
    total = [sum(col) for col in zip(*(g.as_tuple() for g in granted), strict=True)]
    bound = credits(max([1_000, *values])).scaled(SHARE).as_tuple()
    print(
        f"\n{'changing' if varying else 'steady'} lease: {len(granted)}/300 debits granted, "
        f"{accepted} lease updates raced, granted totals {total} <= bound {list(bound)}"
    )
    assert all(t <= b for t, b in zip(total, bound, strict=True))
    assert granted, "the race must grant something to prove anything"
    # Every grant has its notice, on a gapless per-node sequence, and is open in the store.
    notices = await clients[1].read_notices("d1", 0, 10_000)
    assert [n.seq for n in notices] == list(range(1, len(granted) + 1))
    assert all(n.kind is NoticeKind.GRANT for n in notices)
    node = await clients[2].get_node("d1", NOW)
    assert list(node.open_debits.as_tuple()) == total
    assert node.open_reservations == len(granted)


async def test_a_caller_supplied_client_with_decoded_responses(
    redis_url: str, redis_namespace: str
) -> None:
    client = Redis.from_url(redis_url, decode_responses=True)
    store = patient_redis_store(client, redis_namespace)
    try:
        await register(store, "d1")
        await store.upsert_lease(lease(), NOW, 2_000)
        res = (await store.try_debit("d1", credits(3), 1.0, NOW, 100)).reservation
        assert res is not None
        assert (await store.release(res.reservation_id, NOW)).release_seq == 2
        assert [n.kind for n in await store.read_notices("d1", 0, 10)] == [
            NoticeKind.GRANT,
            NoticeKind.RELEASE,
        ]
        assert (await store.node_events("d1", 5))[0].kind == "new_epoch"
    finally:
        await store.close()
        await client.aclose()


async def test_blocking_read_longer_than_the_socket_timeout(
    redis_url: str, redis_namespace: str
) -> None:
    """XREAD BLOCK runs in chunks under the socket timeout, so long waits are not errors."""
    store = RedisStore(redis_url, namespace=redis_namespace, socket_timeout_s=0.4)
    try:
        await register(store, "d1")
        await store.upsert_lease(lease(), NOW, 2_000)
        assert await store.read_notices("d1", 0, 10, block_ms=900) == []
        reader = asyncio.create_task(store.read_notices("d1", 0, 10, block_ms=10_000))
        await asyncio.sleep(0.9)
        assert not reader.done()
        await store.try_debit("d1", credits(1), 1.0, NOW, 100)
        assert [n.seq for n in await asyncio.wait_for(reader, 10)] == [1]
    finally:
        await store.close()


async def every_call_is_unavailable(store: Store) -> None:
    calls: list[Callable[[], Awaitable[object]]] = [
        store.ping,
        lambda: store.try_debit("d1", credits(1), 1.0, NOW, 100),
        lambda: store.admission_view("default", [], 8, NOW),
        lambda: store.upsert_lease(lease(), NOW, 2_000),
        lambda: store.release(f"{'0' * 32}@d1", NOW),
        lambda: store.read_notices("d1", 0, 10, block_ms=100),
        store.get_policy,
        lambda: store.list_nodes(NOW),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable):
            async with asyncio.timeout(30):  # a hang guard, not a latency assertion
                await call()


async def test_closed_port_is_unavailable_not_a_redis_error() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)
    try:
        await every_call_is_unavailable(store)
    finally:
        await store.close()


async def test_unavailable_says_what_redis_said(redis_url: str) -> None:
    """redis-py 8 shows its errors' repr as a category and type only, so a store error read
    "redis ping failed: server:ResponseError" (for a database index Redis does not have) or
    "network:ConnectionError", in the broker's log and in crossflowctl's one-line error."""
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
    store = RedisStore(f"{base}/9999", socket_timeout_s=2.0)
    try:
        with pytest.raises(StoreUnavailable) as refused:
            await store.ping()
        assert "ResponseError: DB index is out of range" in str(refused.value), refused.value
    finally:
        await store.close()
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)
    try:
        with pytest.raises(StoreUnavailable) as refused:
            await store.ping()
        assert "ConnectionError: " in str(refused.value), refused.value
        assert "connecting to 127.0.0.1:" in str(refused.value), refused.value
    finally:
        await store.close()


async def test_silent_server_times_out_as_unavailable() -> None:
    """A peer that accepts connections and never answers: socket timeouts, not a hang."""
    peers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.1)
    try:
        await every_call_is_unavailable(store)
    finally:
        await store.close()
        server.close()
        for writer in peers:
            writer.close()
        await server.wait_closed()


async def test_node_view_loads_its_script_when_redis_does_not_know_it(
    redis_url: str, redis_namespace: str
) -> None:
    """Pipelined EVALSHA falls back to SCRIPT LOAD on NOSCRIPT (e.g. after a Redis restart)."""
    store = patient_redis_store(redis_url, redis_namespace)
    try:
        await register(store, "d1")
        await store.upsert_lease(lease(), NOW, 2_000)
        # The same script under a SHA this server has never seen.
        fresh = f"{load_script('node_view')}\n-- {uuid.uuid4().hex}\n"
        store._scripts.by_name["node_view"] = store._r.register_script(fresh)
        _, states = await store.admission_view("default", ["d1"], 8, NOW)
        assert [s.info.node_id for s in states] == ["d1"]
    finally:
        await store.close()


async def test_a_reservation_recorded_before_debits_were_timed_reads_as_untimed(
    redis_url: str, redis_namespace: str
) -> None:
    """A record and running totals an earlier broker wrote (compute as plain tokens, totals
    without node time) count their tokens, as before, under a lease with a rate; a timed record
    keeps its node time through commit and release."""
    store = patient_redis_store(redis_url, redis_namespace)
    try:
        await register(store, "d1")
        offer = lease(credits=credits(10_000, compute_tokens=1_000), borrowed_prefill_rate_tps=2e3)
        await store.upsert_lease(offer, NOW, 60_000)
        old = await store.try_debit("d1", credits(1, compute_tokens=300), 1.0, NOW, 60_000)
        timed = await store.try_debit(
            "d1", credits(1, compute_tokens=200), 1.0, NOW, 60_000, compute_us=100_000
        )
        assert old.reservation is not None and timed.reservation is not None
        k = store._k.node("d1")
        rid = timed.reservation.reservation_id
        raw = await store._r.hget(k.reservations, rid)
        record = raw if isinstance(raw, str) else bytes(raw or b"").decode()
        assert "|200:100000|" in record
        # as an earlier broker left them: no node time in the record nor in the totals
        await store._r.hset(k.info, "open", "500,2,2,2,2,2")
        await store._r.hset(k.reservations, rid, record.replace("|200:100000|", "|200|"))
        node = await store.get_node("d1", NOW)
        assert node.open_compute == ComputeTime() and node.available(NOW).compute_tokens == 500
        assert {r.compute_us for r in await store.list_reservations("d1", NOW)} == {0}
        fresh = await store.try_debit(
            "d1", credits(1, compute_tokens=200), 1.0, NOW, 60_000, compute_us=100_000
        )
        assert fresh.reservation is not None
        committed = await store.commit(fresh.reservation.reservation_id, NOW, 60_000)
        released = await store.release(fresh.reservation.reservation_id, NOW)
        assert committed.compute_us == released.compute_us == 100_000
        node = await store.get_node("d1", NOW)
        assert node.open_compute == ComputeTime(us=100_000, tokens=200)
        assert node.available(NOW).compute_tokens == 1_000 - 500 - 200
        # expiry purges both layouts and leaves the totals at zero
        node = await store.get_node("d1", NOW + 60_001)
        assert (node.open_debits, node.open_compute) == (Credits(), ComputeTime())
        await store.upsert_lease(lease(version=2, ttl_ms=60_000), NOW + 60_001, 60_000)
        assert (await store._r.hget(k.info, "open")) in (b"0,0,0,0,0,0,0,0", "0,0,0,0,0,0,0,0")
    finally:
        await store.close()


async def test_totals_an_older_broker_rewrote_count_untimed_and_heal_when_the_node_drains(
    redis_url: str, redis_namespace: str
) -> None:
    """An earlier broker's debit rewrites the node's totals without their node time while timed
    reservations are open (docs/upgrading.md). When those drain, the time they take
    away from the totals was never in them: a time that cannot be right counts the node's open
    compute untimed (as before debits had node time), and the totals are exact again once
    nothing is open. (They used to go negative for good, and later grants were under-counted.)"""
    store = patient_redis_store(redis_url, redis_namespace)

    def at(version: int, rate: float) -> Lease:
        room = credits(10_000, compute_tokens=10_000)
        return lease(version=version, credits=room, borrowed_prefill_rate_tps=rate, ttl_ms=60_000)

    async def timed(tokens: int, us: int, now: int, hold_ms: int) -> None:
        ask = credits(1, compute_tokens=tokens)
        assert (await store.try_debit("d1", ask, 1.0, now, hold_ms, compute_us=us)).granted

    try:
        await register(store, "d1")
        await store.upsert_lease(at(1, 1_000.0), NOW, 60_000)
        await timed(2_000, 2_000_000, NOW, 1_000)  # drains first
        await timed(1_000, 1_000_000, NOW, 10_000)
        info = store._k.node("d1").info
        raw = await store._r.hget(info, "open")
        text = raw if isinstance(raw, str) else bytes(raw or b"").decode()
        assert text == "3000,2,2,2,2,2,3000000,3000"
        await store._r.hset(info, "open", text.rsplit(",", 2)[0])  # what an earlier one writes
        # The 2 s drain, then 3 s at 500 tokens/s: the time left (-2 s + 3 s) is behind fewer
        # timed tokens than none (-2,000 + 1,500): all 2,500 open tokens count untimed.
        later = NOW + 2_000
        await store.upsert_lease(at(2, 500.0), later, 60_000)
        await timed(1_500, 3_000_000, later, 10_000)
        node = await store.get_node("d1", later)
        assert (node.open_debits.compute_tokens, node.open_reservations) == (2_500, 2)
        assert node.open_compute == ComputeTime(us=1_000_000, tokens=-500)
        assert node.available(later).compute_tokens == 10_000 - 2_500
        # Everything drains: nothing open, no time; a fresh grant counts exactly.
        drained = NOW + 20_000
        await store.upsert_lease(at(3, 2_000.0), drained, 60_000)
        assert (await store._r.hget(info, "open")) in (b"0,0,0,0,0,0,0,0", "0,0,0,0,0,0,0,0")
        await timed(6_000, 3_000_000, drained, 10_000)
        node = await store.get_node("d1", drained)
        assert node.open_compute == ComputeTime(us=3_000_000, tokens=6_000)
        assert node.available(drained).compute_tokens == 10_000 - 6_000
    finally:
        await store.close()
