"""The in-process store hands out one pool snapshot and one node state object while they hold.

Admission reads the pool and every candidate node per Admit, and in a simulation most Admits find
them unchanged: the store keeps what it built (the admission service computes Demand once per
snapshot object), and must build afresh the moment anything a reader sees changes, at whatever
time it is asked (the store is clock-free: a caller may ask about an earlier time).
"""

from __future__ import annotations

from crossflow_ctl.domain.models import PoolLoad
from crossflow_ctl.store.memory import MemoryStore
from tests.store.helpers import MAX_TTL, NOW, credits, lease, register


def _load(node_id: str, ttl_ms: int, tokens: int = 1_000) -> PoolLoad:
    return PoolLoad(
        node_id=node_id,
        outstanding_uncached_tokens=tokens,
        processing_rate_tps=10.0,
        ttl_ms=ttl_ms,
    )


async def _reports(store: MemoryStore, now_ms: int) -> list[str]:
    pool, _ = await store.admission_view("default", [], 0, now_ms)
    return [] if pool is None else [r.node_id for r in pool.reports]


async def test_a_pool_snapshot_is_reused_until_a_report_is_stored_or_crosses_its_expiry() -> None:
    store = MemoryStore(seed=1)
    await store.put_pool_load(_load("p1", 100), NOW, 5_000)
    await store.put_pool_load(_load("p2", 300), NOW, 5_000)
    first, _ = await store.admission_view("default", [], 0, NOW + 10)
    again, _ = await store.admission_view("default", [], 0, NOW + 99)
    assert first is not None and again is first
    assert await _reports(store, NOW + 100) == ["p2"]  # p1 expired
    assert await _reports(store, NOW + 50) == ["p1", "p2"]  # an earlier read: p1 live again
    assert await _reports(store, NOW + 300) == []
    assert await _reports(store, NOW + 200) == ["p2"]
    await store.put_pool_load(_load("p1", 1_000, tokens=7), NOW + 200, 5_000)
    pool, _ = await store.admission_view("default", [], 0, NOW + 200)
    assert pool is not None and [r.outstanding_uncached_tokens for r in pool.reports] == [7, 1_000]


async def test_a_node_state_is_reused_until_its_books_change() -> None:
    store = MemoryStore(seed=1)
    await register(store, "d1")
    await store.upsert_lease(lease("d1"), NOW, MAX_TTL)
    state = await store.get_node("d1", NOW)
    assert await store.get_node("d1", NOW + 1) is state

    granted = await store.try_debit("d1", credits(10), 1.0, NOW, hold_ttl_ms=500)
    assert granted.reservation is not None
    held = await store.get_node("d1", NOW)
    assert held.open_debits == credits(10) and held.info.notice_seq == state.info.notice_seq + 1
    assert await store.get_node("d1", NOW + 499) is held
    assert (await store.get_node("d1", NOW + 500)).open_debits == credits(0)  # the hold expired
    assert (await store.get_node("d1", NOW + 10)).open_debits == credits(10)  # not yet, earlier

    await store.commit(granted.reservation.reservation_id, NOW + 10, 5_000)
    committed = await store.get_node("d1", NOW + 600)  # the commit outlives the hold
    assert committed.open_debits == credits(10)
    assert committed.info.notice_seq == held.info.notice_seq + 1

    await store.set_cordon("d1", True, "drain", NOW + 600)
    assert (await store.get_node("d1", NOW + 600)).info.cordoned

    await store.upsert_lease(lease("d1", version=2, value=50), NOW + 700, MAX_TTL)
    renewed = await store.get_node("d1", NOW + 700)
    assert renewed.lease is not None and renewed.lease.lease.credits == credits(50)
    _, states = await store.admission_view("default", ["d1"], 0, NOW + 700)
    assert states == [renewed]


async def test_pools_nobody_reports_on_are_not_kept() -> None:
    """Any pool name can be asked about (Admit and WatchRoom pass the router's); only pools with
    reports are kept, so a router cycling names cannot grow the embedded broker's memory."""
    store = MemoryStore(seed=1)
    await store.put_pool_load(_load("p1", 100), NOW, 5_000)
    for i in range(100):
        pool, _ = await store.admission_view(f"nobody-{i}", [], 0, NOW)
        assert pool is None  # no reports: no pool to read
    await store.admission_view("default", [], 0, NOW)
    assert list(store._snapshots) == ["default"]  # the cache itself: nothing else shows it
