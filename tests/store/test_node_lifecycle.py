"""Nodes that go away (issue #11): deleted by hand, or expired once not heard of for a while.
Part of the store contract: runs on the memory store, one Redis and a Redis Cluster."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.errors import FailedPrecondition, NotFound
from crossflow_ctl.domain.models import NodeRole, PoolLoad
from crossflow_ctl.store.base import Store
from tests.store.helpers import MAX_TTL, NOW, credits, lease, register

IDLE = 60_000


async def test_delete_refuses_open_reservations_unless_forced(store: Store) -> None:
    await register(store, "d1", "d2")
    for node in ("d1", "d2"):
        await store.upsert_lease(lease(node), NOW, MAX_TTL)
    granted = await store.try_debit("d1", credits(1), 1.0, NOW, 1_000)
    assert granted.granted
    before = await store.get_node("d1", NOW)
    with pytest.raises(FailedPrecondition) as refused:
        await store.delete_node("d1", False, NOW)
    assert refused.value.field == "force" and "has 1 open reservation" in str(refused.value)
    assert await store.get_node("d1", NOW) == before  # nothing changed
    assert await store.delete_node("d1", True, NOW) == 1
    assert await store.delete_node("d2", False, NOW) == 0
    for call in (
        lambda: store.get_node("d1", NOW),
        lambda: store.delete_node("d1", True, NOW),
        lambda: store.read_notices("d1", 0, 10),
        lambda: store.delete_node("no such node", True, NOW),
    ):
        with pytest.raises(NotFound):
            await call()
    assert await store.list_nodes(NOW) == []
    assert await store.list_reservations(None, NOW) == []
    assert (await store.admission_view("default", [], 8, NOW))[1] == []  # not a lender now
    granted = await store.try_debit("d2", credits(1), 1.0, NOW, 1_000)
    assert not granted.granted and granted.refusal == "unknown_node"


async def test_a_deleted_node_registers_anew_from_scratch(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(version=7), NOW, MAX_TTL)
    await store.try_debit("d1", credits(1), 1.0, NOW, 1)  # a notice, expired at once
    await store.delete_node("d1", False, NOW + 10)
    await register(store, "d1", now_ms=NOW + 20)
    node = await store.get_node("d1", NOW + 20)
    assert node.lease is None and node.info.notice_seq == 0
    assert await store.lease_history("d1", 10) == []
    assert (await store.upsert_lease(lease(version=1), NOW + 20, MAX_TTL)).accepted


async def test_nodes_not_heard_of_expire_and_live_ones_stay(store: Store) -> None:
    await register(store, "gone", "leasing", "busy", "fresh", now_ms=NOW)
    await store.register_node("prefill", NodeRole.PREFILL, "default", {}, NOW)
    later = NOW + IDLE + 1
    await store.upsert_lease(lease("busy", ttl_ms=MAX_TTL), NOW, MAX_TTL)
    assert (await store.try_debit("busy", credits(1), 1.0, NOW, 10 * IDLE)).granted
    await store.upsert_lease(lease("leasing", ttl_ms=MAX_TTL), later - 5, MAX_TTL)
    await register(store, "fresh", now_ms=later - 5)
    load = PoolLoad(
        node_id="prefill", outstanding_uncached_tokens=1, processing_rate_tps=1.0, ttl_ms=500
    )
    await store.put_pool_load(load, later - 5, MAX_TTL)
    assert await store.expire_nodes(IDLE, later) == ["gone"]
    assert await store.expire_nodes(IDLE, later) == []  # idempotent
    ids = [n.info.node_id for n in await store.list_nodes(later)]
    assert ids == ["busy", "fresh", "leasing", "prefill"]
    # Once its reservation no longer counts, the silent node goes too.
    assert await store.expire_nodes(IDLE, NOW + 10 * IDLE + 1) == [
        "busy",
        "fresh",
        "leasing",
        "prefill",
    ]
