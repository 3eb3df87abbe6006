"""WatchRoom over real gRPC on loopback (memory and Redis stores): room caused through one
replica reaches a watcher on another; bursts are coalesced; bad subscriptions are refused;
shutdown ends the stream; and the client's AdmissionQueue borrows a held prompt late."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc, common_pb2, lease_pb2
from crossflow_ctl.client import AdmissionClient, AdmissionQueue, Dispatch, QueueConfig
from crossflow_ctl.domain.admission import AdmissionRequest, Reason
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.room import RoomStatus, RoomUpdate
from tests.broker.conftest import target
from tests.conftest import PATIENCE_S

ROOM = {"poll_ms": 50, "min_read_ms": 5, "max_updates_per_s": 50.0, "heartbeat_ms": 60_000}


async def next_where(
    updates: AsyncIterator[RoomUpdate], predicate: Any, timeout_s: float = 10.0
) -> RoomUpdate:
    async with asyncio.timeout(timeout_s):
        async for update in updates:
            if predicate(update):
                return update
    raise AssertionError("the room stream ended")


async def test_room_from_a_lease_on_another_replica_reaches_the_watcher(
    cluster: Any, agents: Any
) -> None:
    a = await cluster.start(room=ROOM)
    b = await cluster.start(room=ROOM)
    prefill = await agents(b, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    decode = await agents(b, "d1")
    async with AdmissionClient(target(a), timeout_s=5) as client:
        updates = client.watch_room()
        first = await next_where(updates, lambda u: True)
        assert first.seq == 1 and first.view.status is RoomStatus.OK
        assert first.view.demand_holds and not first.view.has_room
        await decode.send_lease(credits={"compute_tokens": 6_000, "slots": 1})
        room = await next_where(updates, lambda u: u.view.has_room)
        assert room.seq > first.seq and not room.heartbeat
        assert [(n.node_id, n.compute_tokens, n.slots) for n in room.view.nodes] == [
            ("d1", 6_000, 1)
        ]
        assert room.view.pool_wait_ms == pytest.approx(10_000.0)

        # The only slot is taken through replica A: the room goes (a change made on A).
        adm = await client.admit(request_id="r1", uncached_prompt_tokens=1_000)
        assert adm.reservation_id
        gone = await next_where(updates, lambda u: not u.view.has_room)
        assert gone.seq > room.seq
        # Released through A, and a lease that saw the release arrives on B: room again.
        await client.release(adm.reservation_id)
        await decode.wait_notice(
            lambda n: (
                n.reservation_id == adm.reservation_id and n.kind == lease_pb2.NOTICE_KIND_RELEASE
            )
        )
        await decode.send_lease(credits={"compute_tokens": 7_000, "slots": 1})
        back = await next_where(updates, lambda u: u.view.has_room)
        assert back.view.nodes[0].compute_tokens == 7_000
        await updates.aclose()  # type: ignore[attr-defined]


async def test_bursts_are_coalesced_to_the_rate_limit_and_the_newest_view_arrives(
    cluster: Any, agents: Any
) -> None:
    # 1 update/s: coalescing shows unless 20 lease sends take 20 s (at 4/s, sends slower than
    # 250 ms each on a loaded machine each got an update of their own: 20, not < 20)
    server = await cluster.start(room={**ROOM, "max_updates_per_s": 1.0})
    decode = await agents(server, "d1")
    async with AdmissionClient(target(server), timeout_s=5) as client:
        updates = client.watch_room()
        await next_where(updates, lambda u: True)
        received: list[RoomUpdate] = []
        newest = asyncio.Event()

        async def collect() -> None:
            async for update in updates:
                received.append(update)
                if update.view.max_compute_tokens == 20_000:
                    newest.set()

        collector = asyncio.create_task(collect())
        started = time.monotonic()
        for i in range(1, 21):  # 20 material changes, each 1,000 tokens apart
            await decode.send_lease(credits={"compute_tokens": 1_000 * i})
        await asyncio.wait_for(newest.wait(), PATIENCE_S)
        elapsed = time.monotonic() - started
        collector.cancel()
        # At 1 update/s, the stream may carry at most one update per second (+1 at the edge).
        assert len(received) <= int(elapsed * 1.0) + 2, (len(received), elapsed)
        assert len(received) < 20
        assert [u.seq for u in received] == list(range(2, 2 + len(received)))


async def test_heartbeats_keep_coming_when_nothing_changes(cluster: Any) -> None:
    server = await cluster.start(room=ROOM)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        updates = client.watch_room(heartbeat_ms=100)
        first = await next_where(updates, lambda u: True)
        beats = [await next_where(updates, lambda u: True) for _ in range(2)]
        assert [b.seq for b in beats] == [first.seq + 1, first.seq + 2]
        assert all(b.heartbeat and b.view == first.view for b in beats)
        assert server.broker.rooms.active == 1
        await updates.aclose()  # type: ignore[attr-defined]
        for _ in range(1_000):  # the broker ends its side: no watch is left behind
            if not server.broker.rooms.active:
                break
            await asyncio.sleep(0.01)
        assert server.broker.rooms.active == 0


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_updates_per_s": -1.0}, "max_updates_per_s"),
        ({"max_updates_per_s": float("nan")}, "max_updates_per_s"),
        ({"heartbeat_ms": 5}, "heartbeat_ms"),
        ({"pool": "bad pool"}, "pool"),
        ({"candidate_node_ids": ["ok", "no/slash"]}, "candidate_node_ids.1"),
    ],
)
async def test_bad_subscription_is_refused_naming_the_field(
    cluster: Any, fields: dict[str, Any], field: str
) -> None:
    server = await cluster.start(room=ROOM)
    async with grpc.aio.insecure_channel(target(server)) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        call = stub.WatchRoom(admission_pb2.WatchRoomRequest(**fields))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(f"{field}:"), err.value.details()
    async with AdmissionClient(target(server)) as client:
        with pytest.raises(InvalidArgument) as local:
            await anext(aiter(client.room_updates(**fields)))
        assert local.value.field == field


async def test_shutdown_ends_the_watch_and_room_updates_reports_unknown(cluster: Any) -> None:
    server = await cluster.start(room=ROOM)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        plain = client.watch_room()
        resilient = client.room_updates(retry_s=0.05)
        await next_where(plain, lambda u: True)
        await next_where(resilient, lambda u: True)
        await cluster.stop_all()
        async with asyncio.timeout(10):
            rest = [u async for u in plain]
        assert all(u.view.status is RoomStatus.OK for u in rest)  # ended cleanly, no error
        down = await next_where(resilient, lambda u: True)
        assert down.seq == 0 and down.view.status is RoomStatus.UNKNOWN
        await resilient.aclose()  # type: ignore[attr-defined]


async def test_admission_queue_borrows_a_held_prompt_when_room_appears(
    cluster: Any, agents: Any
) -> None:
    a = await cluster.start(room=ROOM)
    b = await cluster.start(room=ROOM)
    prefill = await agents(b, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    decode = await agents(b, "d1")
    await decode.send_lease(credits={"compute_tokens": 500})
    async with AdmissionClient(target(a), timeout_s=5) as client:
        queue = AdmissionQueue(client, QueueConfig(max_hold_ms=60_000))
        runner = asyncio.create_task(queue.run(client.room_updates()))
        ticket = await queue.submit(
            AdmissionRequest(request_id="late", uncached_prompt_tokens=2_000)
        )
        assert not ticket.done() and queue.held == 1
        await decode.send_lease(credits={"compute_tokens": 8_000})
        outcome = await asyncio.wait_for(ticket.wait(), 10)
        assert outcome.dispatch is Dispatch.BORROWED_LATE, outcome
        assert outcome.admission.node_id == "d1" and outcome.admission.reservation_id
        assert outcome.offers >= 2 and queue.stats.reoffers >= 1
        await client.commit(outcome.admission.reservation_id)
        held_again = await queue.submit(
            AdmissionRequest(request_id="closing", uncached_prompt_tokens=50_000)
        )
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        assert held_again.outcome is not None
        assert held_again.outcome.dispatch is Dispatch.CLOSED
        assert held_again.outcome.admission.reason is Reason.NO_ROOM


async def test_watches_of_the_same_room_share_one_read_loop(cluster: Any, agents: Any) -> None:
    server = await cluster.start(room=ROOM)
    decode = await agents(server, "d1")
    rooms = server.broker.rooms
    async with AdmissionClient(target(server), timeout_s=5) as client:
        first, second = client.watch_room(), client.watch_room(max_updates_per_s=5.0)
        only_d1 = client.watch_room(candidate_node_ids=("d1",))
        for updates in (first, second, only_d1):
            await next_where(updates, lambda u: True)
        assert rooms.active == 3 and rooms.feeds == 2
        await decode.send_lease(credits={"compute_tokens": 3_000})
        for updates in (first, second, only_d1):
            seen = await next_where(updates, lambda u: u.view.has_room)
            assert seen.view.max_compute_tokens == 3_000
        for updates in (first, second, only_d1):
            await updates.aclose()  # type: ignore[attr-defined]
        for _ in range(1_000):
            if not rooms.active and not rooms.feeds:
                break
            await asyncio.sleep(0.01)
        assert (rooms.active, rooms.feeds) == (0, 0)
