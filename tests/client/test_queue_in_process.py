"""AdmissionQueue driven the way a discrete-event simulator drives it: over the in-process
service ``Broker`` (MemoryStore), on a ManualClock, with no sleeps and no background task."""

from __future__ import annotations

from crossflow_ctl.client import AdmissionQueue, Dispatch, QueueConfig
from crossflow_ctl.domain.admission import AdmissionRequest, Reason
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.models import Credits, Lease, NodeRole, PoolLoad
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.room import RoomUpdate, RoomWatchRequest
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore

POLICY = PolicySettings(borrow_share=1.0, max_lease_ttl_ms=10_000)


def lease(version: int, compute: int) -> Lease:
    return Lease(
        node_id="d1",
        epoch=1,
        version=version,
        ttl_ms=10_000,
        credits=Credits(
            compute_tokens=compute,
            kv_tokens=100_000,
            kv_transfer_bytes=10**9,
            output_tokens=8_000,
            slots=4,
        ),
        queue_wait_ms=5.0,
        borrowed_prefill_rate_tps=20_000.0,
        itl_ms=20.0,
        itl_slo_ms=50.0,
    )


async def lending_broker(clock: ManualClock, compute: int) -> Broker:
    """A service Broker on MemoryStore with decode node d1 leasing ``compute`` tokens and a
    prefill pool 10 s behind (Demand holds)."""
    broker = Broker(MemoryStore(seed=1), clock, BrokerSettings(policy=POLICY))
    await broker.register("d1", NodeRole.DECODE, "default", {})
    await broker.register("p1", NodeRole.PREFILL, "default", {})
    load = PoolLoad(
        node_id="p1", outstanding_uncached_tokens=200_000, processing_rate_tps=20_000, ttl_ms=9_000
    )
    await broker.ingest_pool_load(load)
    await broker.ingest_lease(lease(1, compute=compute))
    return broker


async def test_simulator_style_step_api_over_the_service_broker() -> None:
    clock = ManualClock(1_700_000_000_000)
    broker = await lending_broker(clock, compute=500)
    queue = AdmissionQueue(broker, QueueConfig(max_hold_ms=200), clock=clock)

    big = await queue.submit(AdmissionRequest(request_id="big", uncached_prompt_tokens=9_000))
    small = await queue.submit(AdmissionRequest(request_id="small", uncached_prompt_tokens=2_000))
    assert queue.held == 2 and big.outcome is None and small.outcome is None
    assert queue.next_deadline_ms() == clock.now_ms() + 200

    clock.advance(50)
    await broker.ingest_lease(lease(2, compute=4_000))
    view = await broker.room_view(RoomWatchRequest())
    assert view.has_room and view.demand_holds and view.max_compute_tokens == 4_000
    step = await queue.on_room(RoomUpdate(seq=1, at_ms=clock.now_ms(), view=view))
    # "big" does not fit any node and is skipped; "small" borrows 50 ms after it was held.
    assert [(o.request.request_id, o.dispatch, o.held_ms) for o in step] == [
        ("small", Dispatch.BORROWED_LATE, 50)
    ]
    assert step[0].admission.reservation_id and step[0].admission.node_id == "d1"
    assert await queue.tick() == []

    clock.advance(150)
    step = await queue.tick()
    assert [(o.request.request_id, o.dispatch) for o in step] == [("big", Dispatch.DEADLINE)]
    assert step[0].admission.reason is Reason.NO_ROOM and big.outcome == step[0]
    assert queue.held == 0 and queue.next_deadline_ms() is None
