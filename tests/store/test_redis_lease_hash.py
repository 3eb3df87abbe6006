"""The lease HASH is the one stored form of a node's current lease: no JSON copy, every field
round-trips exactly, and a corrupt hash is a StoreUnavailable, not a crash."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis, RedisCluster

from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import Credits, Lease, StoredLease, ZeroReason
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.keys import HISTORY_CAP, Keys
from crossflow_ctl.store.redis_store import RedisStore
from tests.conftest import delete_cluster_namespace, patient_redis_store
from tests.store.helpers import NOW, credits, register

MAX_TTL = 60_000
TOP = 2**63 - 1

LEASES = {
    "lending, every value set": Lease(
        node_id="d1",
        epoch=TOP,
        version=TOP - 1,
        ttl_ms=5_000,
        credits=Credits(
            compute_tokens=123_457,
            kv_tokens=98_765,
            kv_transfer_bytes=2**40 + 3,
            output_tokens=777,
            slots=9,
        ),
        queue_wait_ms=12.345678901234567,
        borrowed_prefill_rate_tps=1e-7 + 4321.0,
        prefill_s_per_token=0.1 + 0.2,
        prefill_s_per_token_context=1.5e-9,
        itl_ms=33.3,
        itl_slo_ms=50.0,
        last_notice_seq=TOP,
        snapshot_unix_ms=1_700_000_123_456,
        horizon_ms=8_000,
    ),
    "zero, with its detail": Lease(
        node_id="d1",
        epoch=TOP,
        version=TOP,
        ttl_ms=1_000,
        zero_reason=ZeroReason.ITL_OVER_SLO,
        zero_detail="itl 61.5 ms > slo 50 ms | a=b; 'quoted' \"and\" ünïcode",
    ),
    "all-zero credits, no reason": Lease(node_id="d1", epoch=3, version=1, ttl_ms=1_000),
}


@pytest.fixture
async def store(redis_url: str, redis_namespace: str) -> AsyncIterator[tuple[RedisStore, Redis]]:
    s = patient_redis_store(redis_url, redis_namespace)
    raw = Redis.from_url(redis_url)
    await register(s, "d1")
    try:
        yield s, raw
    finally:
        await s.close()
        await raw.aclose()


@pytest.mark.parametrize("name", list(LEASES))
async def test_the_lease_hash_holds_each_field_once_and_round_trips(
    store: tuple[RedisStore, Redis], redis_namespace: str, name: str
) -> None:
    s, raw = store
    # An older lease first, so the stored one replaces a hash rather than creating it.
    await s.upsert_lease(Lease(node_id="d1", epoch=1, version=1, ttl_ms=1_000), NOW, MAX_TTL)
    lease = LEASES[name]
    assert (await s.upsert_lease(lease, NOW, MAX_TTL)).accepted

    stored = await raw.hgetall(Keys(redis_namespace).node("d1").lease)
    fields = {k.decode(): v.decode() for k, v in stored.items()}
    assert set(fields) == set(codec.LEASE_FIELDS)
    assert not any(v.lstrip().startswith("{") for v in fields.values()), "a JSON copy"
    expected = StoredLease(lease=lease, received_at_ms=NOW, expires_at_ms=NOW + lease.ttl_ms)
    assert fields["ev"] == f"{lease.epoch:020d}{lease.version:020d}"
    assert int(fields["epoch"]) == lease.epoch and int(fields["nseq"]) == lease.last_notice_seq
    assert codec.stored_lease_from_fields(stored) == expected
    node = await s.get_node("d1", NOW)
    assert node is not None and node.lease == expected
    assert node.lease.lease.zero_detail == lease.zero_detail
    assert (await s.lease_history("d1", 1)) == [expected]


async def test_stale_leases_still_compare_63_bit_epochs_exactly(
    store: tuple[RedisStore, Redis],
) -> None:
    s, _ = store
    top = Lease(node_id="d1", epoch=TOP, version=2, ttl_ms=1_000, credits=credits(5))
    assert (await s.upsert_lease(top, NOW, MAX_TTL)).accepted
    older = top.model_copy(update={"epoch": TOP - 1, "version": TOP})
    out = await s.upsert_lease(older, NOW, MAX_TTL)
    assert not out.accepted and (out.stored_epoch, out.stored_version) == (TOP, 2)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("epoch", "x", "field 'epoch'"),
        ("a", "nan", "prefill_s_per_token"),
        ("c3", "-1", "kv_transfer_bytes"),
        ("reason", "bogus", "zero_reason"),
        ("ev", "0" * 40, "field 'ev'"),
        ("zero", "no_capacity", "field 'zero'"),
        ("recv", None, "field 'recv'"),
    ],
)
async def test_a_corrupt_lease_hash_is_store_unavailable_naming_the_field(
    store: tuple[RedisStore, Redis],
    redis_namespace: str,
    field: str,
    value: str | None,
    named: str,
) -> None:
    s, raw = store
    lease = LEASES["lending, every value set"].model_copy(update={"prefill_s_per_token": 0.25})
    assert (await s.upsert_lease(lease, NOW, MAX_TTL)).accepted
    key = Keys(redis_namespace).node("d1").lease
    if value is None:
        await raw.hdel(key, field)
    else:
        await raw.hset(key, field, value)
    stored = await raw.hgetall(key)
    with pytest.raises(StoreUnavailable, match=f"stored lease is corrupt.*{named}"):
        codec.stored_lease_from_fields(stored)
    with pytest.raises(StoreUnavailable, match="corrupt"):
        await s.get_node("d1", NOW + 1)


async def test_a_hash_of_another_layout_is_replaced_whole(
    store: tuple[RedisStore, Redis], redis_namespace: str
) -> None:
    """The script writes every field in place (no DEL per lease); a hash with a field it does
    not write (an older layout's JSON copy) is still replaced whole."""
    s, raw = store
    key = Keys(redis_namespace).node("d1").lease
    assert (
        await s.upsert_lease(Lease(node_id="d1", epoch=1, version=1, ttl_ms=1_000), NOW, MAX_TTL)
    ).accepted
    await raw.hset(key, "json", '{"lease": {}}')
    lease = LEASES["lending, every value set"]
    assert (await s.upsert_lease(lease, NOW, MAX_TTL)).accepted
    fields = {k.decode() for k in await raw.hkeys(key)}
    assert fields == set(codec.LEASE_FIELDS)
    node = await s.get_node("d1", NOW)
    assert node is not None and node.lease is not None and node.lease.lease == lease


async def test_history_entries_are_the_packed_lease_and_read_back_checked(
    store: tuple[RedisStore, Redis], redis_namespace: str
) -> None:
    """The lease is serialized once: its history entry is the packed hash values (no JSON
    copy); a corrupt entry reads as StoreUnavailable naming the field."""
    s, raw = store
    zero = LEASES["zero, with its detail"]
    older = LEASES["lending, every value set"].model_copy(update={"version": 5})
    for one in (older, zero):
        assert (await s.upsert_lease(one, NOW, MAX_TTL)).accepted
    key = Keys(redis_namespace).node("d1").history
    entries = await raw.lrange(key, 0, -1)
    hash_values = await raw.hmget(Keys(redis_namespace).node("d1").lease, list(codec.LEASE_FIELDS))
    assert entries[0] == codec.PACKED_SEPARATOR.encode().join(hash_values)
    expected = [
        StoredLease(lease=x, received_at_ms=NOW, expires_at_ms=NOW + x.ttl_ms)
        for x in (zero, older)
    ]
    assert await s.lease_history("d1", 10) == expected
    await raw.lset(key, 1, entries[1].replace(b"\x1f5000\x1f", b"\x1f-1\x1f", 1))
    with pytest.raises(StoreUnavailable, match=r"stored lease is corrupt.*ttl_ms"):
        await s.lease_history("d1", 10)


async def test_history_written_by_an_earlier_broker_still_reads(
    store: tuple[RedisStore, Redis], redis_namespace: str
) -> None:
    """Earlier brokers pushed StoredLease JSON: after a rolling upgrade the node's history mixes
    both forms until newer leases push the old ones out, and reads whole."""
    s, raw = store
    older = LEASES["lending, every value set"].model_copy(update={"version": 5})
    assert (await s.upsert_lease(older, NOW, MAX_TTL)).accepted
    key = Keys(redis_namespace).node("d1").history
    was = StoredLease(lease=older.model_copy(update={"version": 4}), received_at_ms=NOW - 500,
                      expires_at_ms=NOW + 4_500)  # fmt: skip
    await raw.rpush(key, was.model_dump_json())
    history = await s.lease_history("d1", 10)
    assert [h.lease.version for h in history] == [5, 4] and history[1] == was
    await raw.rpush(key, "{not json")
    with pytest.raises(StoreUnavailable, match="history entry is corrupt"):
        await s.lease_history("d1", 10)


async def test_a_lease_an_earlier_broker_stored_without_its_horizon_reads_as_not_said(
    store: tuple[RedisStore, Redis], redis_namespace: str
) -> None:
    """Brokers older than ``horizon`` wrote the hash and packed history entries without it:
    after a rolling upgrade both still read, as a lease that does not say its horizon."""
    s, raw = store
    lease = LEASES["lending, every value set"]
    assert (await s.upsert_lease(lease, NOW, MAX_TTL)).accepted
    keys = Keys(redis_namespace).node("d1")
    await raw.hdel(keys.lease, "horizon")
    unsaid = StoredLease(
        lease=lease.model_copy(update={"horizon_ms": 0}),
        received_at_ms=NOW,
        expires_at_ms=NOW + lease.ttl_ms,
    )
    node = await s.get_node("d1", NOW)
    assert node is not None and node.lease == unsaid
    values = list(codec.lease_hash_values(lease, NOW, NOW + lease.ttl_ms))
    del values[list(codec.LEASE_FIELDS).index("horizon")]
    await raw.lset(keys.history, 0, codec.PACKED_SEPARATOR.join(values))
    assert await s.lease_history("d1", 1) == [unsaid]


# -- partial writes: only the fields a node's next lease changes ---------------------------------
@pytest.fixture(params=["redis", "redis-cluster"])
async def replicas(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[RedisStore, RedisStore, Redis | RedisCluster, Keys]]:
    """Two replicas (stores) sharing one namespace, on one Redis and on a real Redis Cluster,
    with a raw client to read the hashes."""
    cleanup = None
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        namespace = request.getfixturevalue("redis_namespace")
        stores = [patient_redis_store(url, namespace) for _ in range(2)]
        raw: Redis | RedisCluster = Redis.from_url(url)
    else:
        url = request.getfixturevalue("redis_cluster_url")
        namespace = f"cft-{uuid.uuid4().hex[:12]}"
        stores = [patient_redis_store(url, namespace, cluster=True) for _ in range(2)]
        raw = RedisCluster.from_url(url)
        cleanup = (url, namespace)
    await register(stores[0], "d1")
    try:
        yield stores[0], stores[1], raw, Keys(namespace)
    finally:
        for s in stores:
            await s.close()
        await raw.aclose()
        if cleanup is not None:
            delete_cluster_namespace(*cleanup)


BASE = LEASES["lending, every value set"].model_copy(update={"epoch": 7, "version": 1})


def _next(before: Lease, **update: object) -> Lease:
    return before.model_copy(update={"version": before.version + 1, **update})


async def _stored_is(
    raw: Redis | RedisCluster, keys: Keys, s: RedisStore, stored: StoredLease
) -> None:
    """The hash holds exactly ``stored``'s values, and the store reads it back whole."""
    values = codec.lease_hash_values(stored.lease, stored.received_at_ms, stored.expires_at_ms)
    fields = codec.text_map(await raw.hgetall(keys.node("d1").lease))
    assert fields == dict(zip(codec.LEASE_FIELDS, values, strict=True))
    node = await s.get_node("d1", stored.received_at_ms)
    assert node is not None and node.lease == stored


async def test_fields_a_lease_does_not_change_still_read_back_after_partial_writes(
    replicas: tuple[RedisStore, RedisStore, Redis | RedisCluster, Keys],
) -> None:
    """A replica writes only the fields that changed since the node's last lease it wrote; every
    lease of a sequence that changes a few fields at a time (credits, zeroing with a reason and
    detail, lending again, model constants) still reads back exactly, as does the last of two
    leases of one node sent together."""
    s, _, raw, keys = replicas
    leases = [BASE]
    leases.append(_next(leases[-1], credits=credits(5)))
    leases.append(_next(leases[-1], itl_ms=61.5, queue_wait_ms=0.0))
    leases.append(
        _next(
            leases[-1],
            credits=Credits(),
            zero_reason=ZeroReason.ITL_OVER_SLO,
            zero_detail="itl 61.5 ms > slo 50 ms",
        )
    )
    leases.append(_next(leases[-1], zero_detail="itl 70 ms > slo 50 ms"))
    leases.append(_next(leases[-1], credits=credits(9), zero_reason=None, zero_detail=""))
    leases.append(_next(leases[-1], ttl_ms=2_500, horizon_ms=4_000, itl_slo_ms=40.0))
    leases.append(_next(leases[-1], epoch=8, version=1, last_notice_seq=0))
    for i, lease in enumerate(leases):
        now = NOW + 10 * i
        assert (await s.upsert_lease(lease, now, MAX_TTL)).accepted
        expires = now + min(lease.ttl_ms, MAX_TTL)
        await _stored_is(
            raw, keys, s, StoredLease(lease=lease, received_at_ms=now, expires_at_ms=expires)
        )
    a, b = _next(leases[-1], credits=credits(3)), _next(leases[-1], version=leases[-1].version + 2)
    now = NOW + 1_000
    outcomes = await asyncio.gather(
        s.upsert_lease(a, now, MAX_TTL), s.upsert_lease(b, now, MAX_TTL)
    )
    assert [o.accepted for o in outcomes] == [True, True]
    await _stored_is(
        raw, keys, s, StoredLease(lease=b, received_at_ms=now, expires_at_ms=now + b.ttl_ms)
    )


async def test_a_lease_writes_only_the_fields_that_changed(
    replicas: tuple[RedisStore, RedisStore, Redis | RedisCluster, Keys],
) -> None:
    """The next lease from the replica that wrote the last one rewrites only its changed fields:
    a value planted in a field it does not change stays (shown here; nothing else writes the
    hash), while a changed one is written."""
    s, _, raw, keys = replicas
    key = keys.node("d1").lease
    assert (await s.upsert_lease(BASE, NOW, MAX_TTL)).accepted
    await raw.hset(key, mapping={"itl_slo": "1234.5", "c2": "1"})
    assert (await s.upsert_lease(_next(BASE, credits=credits(5)), NOW + 1, MAX_TTL)).accepted
    assert codec.text_map(await raw.hgetall(key))["itl_slo"] == "1234.5"
    assert codec.text_map(await raw.hgetall(key))["c2"] == "5"


async def test_a_lease_another_replica_stored_meanwhile_means_a_whole_write(
    replicas: tuple[RedisStore, RedisStore, Redis | RedisCluster, Keys],
) -> None:
    """Replica A compares its next lease with the one A wrote last, but replica B stored another
    since (the agent moved): A's write is whole, so a field A's lease keeps from A's last one is
    not left at B's value. A lease refused as stale leaves A's next write whole too."""
    a, b, raw, keys = replicas
    first = BASE
    theirs = _next(first, itl_slo_ms=60.0, credits=credits(6))
    ours = _next(theirs, credits=credits(7))  # itl_slo back to first's: unchanged for A
    assert (await a.upsert_lease(first, NOW, MAX_TTL)).accepted
    assert (await b.upsert_lease(theirs, NOW + 1, MAX_TTL)).accepted
    await raw.hset(keys.node("d1").lease, "a", "0.5")  # shows the next write is whole
    ours = ours.model_copy(update={"itl_slo_ms": first.itl_slo_ms})
    assert (await a.upsert_lease(ours, NOW + 2, MAX_TTL)).accepted
    expires = NOW + 2 + ours.ttl_ms
    await _stored_is(
        raw, keys, a, StoredLease(lease=ours, received_at_ms=NOW + 2, expires_at_ms=expires)
    )
    assert not (await a.upsert_lease(first, NOW + 3, MAX_TTL)).accepted
    await raw.hset(keys.node("d1").lease, "a", "0.5")
    last = _next(ours)
    assert (await a.upsert_lease(last, NOW + 4, MAX_TTL)).accepted
    expires = NOW + 4 + last.ttl_ms
    await _stored_is(
        raw, keys, a, StoredLease(lease=last, received_at_ms=NOW + 4, expires_at_ms=expires)
    )


async def test_history_is_trimmed_in_steps_and_reads_at_most_its_cap(
    store: tuple[RedisStore, Redis], redis_namespace: str
) -> None:
    """The history LIST is trimmed back to its cap once it holds a few more (not on every
    lease); lease_history never returns more than the cap, newest first."""
    s, raw = store
    key = Keys(redis_namespace).node("d1").history
    for v in range(1, HISTORY_CAP + 20):
        assert (await s.upsert_lease(_next(BASE, version=v), NOW + v, MAX_TTL)).accepted
        assert HISTORY_CAP <= await raw.llen(key) <= HISTORY_CAP + 8 or v < HISTORY_CAP
    history = await s.lease_history("d1", 100)
    assert [h.lease.version for h in history] == list(range(HISTORY_CAP + 19, 19, -1))


@pytest.mark.parametrize(
    "value", [0.0, -0.0, 1.0, -2.5, 1e-300, 2e-9, 0.1 + 0.2, 1e22, float("inf"), float("nan")]
)
def test_float_text_is_repr_whatever_it_remembered(value: float) -> None:
    """The remembered float texts are exactly repr, also for 0.0 after -0.0 (one dict key)."""
    for _ in range(2):
        for v in (value, -value):
            assert codec.float_text(v) == repr(v)


@pytest.mark.parametrize("epoch,version", [(0, 0), (1, 2), (TOP, TOP - 1), (10**25, 7)])
def test_the_order_marker_pads_each_number_to_20_digits(epoch: int, version: int) -> None:
    lease = Lease.model_construct(epoch=epoch, version=version)
    assert codec.order_marker(lease) == f"{epoch:020d}{version:020d}"


def test_float_text_of_a_number_that_is_not_a_float_is_its_own_repr() -> None:
    """1, 1.0 and True are one dict key: a remembered 1.0 must not answer for an int 1."""
    assert codec.float_text(1.0) == "1.0"
    assert codec.float_text(1) == "1"  # type: ignore[arg-type]
    assert codec.float_text(True) == "True"  # type: ignore[arg-type]


def test_the_lease_fields_fit_the_upsert_scripts_one_match() -> None:
    """upsert_leases.lua splits a lease's values with one pattern of one capture per field, and
    Lua allows 32 captures: a 33rd field would fail every lease at run time."""
    assert len(codec.LEASE_FIELDS) <= 32
