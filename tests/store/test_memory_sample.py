"""The in-process store's sample of lenders is a function of its seed and its lenders only."""

from __future__ import annotations

from crossflow_ctl.domain.models import ZeroReason
from crossflow_ctl.store.memory import MemoryStore
from tests.store.helpers import MAX_TTL, NOW, lease, register

NODES = [f"d{i}" for i in range(8)]


async def _drawn(order: list[str], zero_first: str | None) -> list[str]:
    store = MemoryStore(seed=7)
    await register(store, *NODES)
    version = {n: 0 for n in NODES}

    async def put(node_id: str, zero: bool = False) -> None:
        version[node_id] += 1
        kw = {"zero_reason": ZeroReason.TELEMETRY_STALE} if zero else {}
        got = await store.upsert_lease(lease(node_id, version=version[node_id], **kw), NOW, MAX_TTL)
        assert got.accepted

    for node_id in order:
        await put(node_id)
    if zero_first is not None:  # a zero lease and a lending one again: the node leaves and returns
        await put(zero_first, zero=True)
        await put(zero_first)
    _, states = await store.admission_view("default", [], 3, NOW)
    return sorted(s.lease.lease.node_id for s in states if s.lease is not None)


async def test_the_same_lenders_give_the_same_draw_whatever_order_their_leases_came_in() -> None:
    """The simulator drops leases nothing read (deferred storing), which changes the order lenders
    entered the index, not who they are: the seeded draw must not depend on that order."""
    base = await _drawn(NODES, None)
    assert await _drawn(list(reversed(NODES)), None) == base
    assert await _drawn(NODES, "d0") == base
