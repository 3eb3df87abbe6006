"""The room a late-binding router watches: which nodes have room, and what counts as news."""

from __future__ import annotations

from crossflow_ctl.domain.admission import AdmissionRequest, debit_for
from crossflow_ctl.domain.models import (
    Credits,
    Lease,
    NodeInfo,
    NodeState,
    PoolLoad,
    PoolSnapshot,
    StoredLease,
    ZeroReason,
)
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.room import (
    NodeRoom,
    RoomStatus,
    RoomView,
    material_change,
    summarize_room,
    unknown_room,
)

NOW = 1_700_000_000_000
FULL = Credits(
    compute_tokens=8_000, kv_tokens=100_000, kv_transfer_bytes=10**9, output_tokens=800, slots=4
)


def node(node_id: str, credits: Credits = FULL, **kw: object) -> NodeState:
    zero = kw.pop("zero", None)
    lease = Lease(
        node_id=node_id,
        epoch=1,
        version=3,
        ttl_ms=1_000,
        credits=Credits() if zero else credits,
        zero_reason=zero,  # type: ignore[arg-type]
        queue_wait_ms=7.0,
        borrowed_prefill_rate_tps=2_000.0,
        prefill_s_per_token=4e-4,
        prefill_s_per_token_context=1e-8,
    )
    expires = kw.pop("expires", NOW + 1_000)
    return NodeState(
        info=NodeInfo(node_id=node_id, cordoned=bool(kw.pop("cordoned", False))),
        lease=StoredLease(lease=lease, received_at_ms=NOW, expires_at_ms=expires),  # type: ignore[arg-type]
        open_debits=kw.pop("debits", Credits()),  # type: ignore[arg-type]
    )


def pool(outstanding: int) -> PoolSnapshot:
    load = PoolLoad(
        node_id="p1", outstanding_uncached_tokens=outstanding, processing_rate_tps=10_000, ttl_ms=1
    )
    return PoolSnapshot(pool="default", reports=(load,))


def test_summary_lists_only_nodes_with_room_after_share_and_debits() -> None:
    nodes = [
        node("d3"),
        node("d1", debits=Credits(compute_tokens=1_000, slots=1)),
        node("d2", zero=ZeroReason.ITL_OVER_SLO),
        node("d4", expires=NOW),
        node("d5", cordoned=True),
        node("d6", debits=Credits(slots=2)),  # 4 x 0.5 = 2 slots, both taken
        node("d8", debits=Credits(output_tokens=400)),  # 800 x 0.5 output, all taken
        NodeState(info=NodeInfo(node_id="d7")),
    ]
    view = summarize_room("default", pool(50_000), nodes, PolicySettings(borrow_share=0.5), NOW)
    assert [n.node_id for n in view.nodes] == ["d1", "d3"]
    d1 = view.nodes[0]
    assert (d1.compute_tokens, d1.slots, d1.kv_tokens) == (3_000, 1, 100_000)  # KV lent whole
    kv_half = PolicySettings(borrow_share=0.5, borrow_kv_share=0.5)
    assert summarize_room("default", pool(50_000), nodes, kv_half, NOW).nodes[0].kv_tokens == (
        50_000
    )
    # the lease's 7 ms + the broker's 1,000 open tokens at 2,000/s
    assert d1.queue_wait_ms == 507.0 and d1.lease_version == 3
    assert view.nodes[1].queue_wait_ms == 7.0
    # the lease's pricing: a watcher prices a prompt as Admit's debit does
    assert (d1.borrowed_prefill_rate_tps, d1.prefill_s_per_token) == (2_000.0, 4e-4)
    assert d1.prefill_s_per_token_context == 1e-8
    assert (
        d1.compute_need(1_000, 20_000)
        == debit_for(
            AdmissionRequest(uncached_prompt_tokens=1_000, cached_prefix_tokens=20_000),
            "d1",
            PolicySettings(),
            nodes[1].lease.lease if nodes[1].lease else None,
        ).credits.compute_tokens
    )
    assert view.pool_wait_ms == 5_000.0 and view.demand_holds and view.has_room
    assert view.total_compute_tokens == 7_000 and view.max_compute_tokens == 4_000


def test_demand_missing_disabled_and_unknown() -> None:
    view = summarize_room("default", None, [node("d1")], PolicySettings(), NOW)
    assert view.pool_wait_ms is None and not view.demand_holds and view.nodes
    quiet = summarize_room("default", pool(100), [node("d1")], PolicySettings(), NOW)
    assert quiet.pool_wait_ms == 10.0 and not quiet.demand_holds
    off = summarize_room("default", pool(50_000), [node("d1")], PolicySettings(enabled=False), NOW)
    assert not off.nodes and not off.demand_holds and "disabled" in off.detail
    down = unknown_room("p", "redis down")
    assert down.status is RoomStatus.UNKNOWN and not down.has_room and down.pool == "p"


def test_material_change() -> None:
    base = RoomView(
        nodes=(NodeRoom(node_id="d1", compute_tokens=1_000, kv_tokens=1_000, slots=2),),
        demand_holds=True,
        pool_wait_ms=300.0,
    )

    def with_node(**kw: int) -> RoomView:
        return base.model_copy(update={"nodes": (base.nodes[0].model_copy(update=kw),)})

    assert material_change(None, base, 0.1)
    assert not material_change(base, base, 0.1)
    assert not material_change(base, base.model_copy(update={"pool_wait_ms": 900.0}), 0.1)
    assert not material_change(base, with_node(compute_tokens=1_050), 0.1)
    assert material_change(base, with_node(compute_tokens=1_200), 0.1)
    assert material_change(base, with_node(kv_tokens=500), 0.1)
    assert material_change(base, with_node(slots=3), 0.1)
    assert material_change(base, base.model_copy(update={"nodes": ()}), 0.1)
    assert material_change(base, base.model_copy(update={"demand_holds": False}), 0.1)
    assert material_change(base, unknown_room("default", "x"), 0.1)
