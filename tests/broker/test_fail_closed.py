"""DESIGN.md §5.6 fail closed, plus shadow mode, dry runs and the shared policy.

A broker on a dead Redis, or on a "Redis" that accepts connections and never answers, still
answers every Admit with NORMAL (never an error); admin calls say UNAVAILABLE with the reason.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from crossflow_ctl.api.v1 import common_pb2, lease_pb2, lease_pb2_grpc
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.domain.admission import Decision, Reason
from crossflow_ctl.domain.errors import BrokerUnavailable, StoreUnavailable
from crossflow_ctl.domain.room import RoomStatus
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.redis_store import RedisStore
from tests.broker.agents import FakeAgent
from tests.broker.conftest import TEST_POLICY, target
from tests.conftest import eventually


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _broker_on(url: str) -> BrokerServer:
    settings = BrokerSettings(
        listen="127.0.0.1:0",
        redis_url=url,
        policy=TEST_POLICY.updated({"admit_timeout_ms": 50}),  # below the store's 200 ms socket
        admin_timeout_ms=300,
        stream_grace_s=0.5,
    )
    store = RedisStore(url, namespace="cft-dead", socket_timeout_s=0.2, op_timeout_s=0.3)
    server = BrokerServer(settings, store)
    await server.start()
    return server


@pytest.mark.parametrize("kind", ["dead", "hung"])
async def test_store_down_admit_answers_normal_admin_unavailable(kind, blackhole) -> None:
    port = _closed_port() if kind == "dead" else blackhole
    server = await _broker_on(f"redis://127.0.0.1:{port}/0")
    try:
        async with AdmissionClient(target(server), timeout_s=5) as client:
            answers = [await client.admit(uncached_prompt_tokens=1_000) for _ in range(5)]
            for adm in answers:
                assert adm.decision is Decision.NORMAL
                assert adm.reason in (Reason.STORE_UNAVAILABLE, Reason.TIMEOUT), adm
            if kind == "hung":
                assert answers[0].reason is Reason.TIMEOUT
            # after 3 failures in a row the breaker answers without the store (test_store_breaker)
            assert answers[-1].reason is Reason.STORE_UNAVAILABLE
            assert "circuit breaker is open" in answers[-1].message
        async with AdminClient(target(server), timeout_s=5) as admin:
            with pytest.raises(StoreUnavailable) as err:
                await admin.list_nodes()  # the broker answered: its STORE is down
            assert not isinstance(err.value, BrokerUnavailable)
            with pytest.raises(StoreUnavailable):
                await admin.cordon("d1")
        async with grpc.aio.insecure_channel(target(server)) as channel:
            call = lease_pb2_grpc.LeaseServiceStub(channel).Connect()
            await call.write(lease_pb2.ConnectRequest(hello=lease_pb2.Hello(node_id="d1")))
            with pytest.raises(grpc.aio.AioRpcError) as rpc:
                await call.read()
            assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(grace_s=0.5)


@pytest.mark.parametrize("kind", ["dead", "hung"])
async def test_store_down_room_watch_says_unknown_and_keeps_going(kind, blackhole) -> None:
    port = _closed_port() if kind == "dead" else blackhole
    server = await _broker_on(f"redis://127.0.0.1:{port}/0")
    try:
        async with AdmissionClient(target(server), timeout_s=5) as client:
            updates = client.watch_room(heartbeat_ms=100)
            async with asyncio.timeout(20):
                seen = [await anext(updates) for _ in range(3)]
            assert [u.seq for u in seen] == [1, 2, 3]
            assert all(u.view.status is RoomStatus.UNKNOWN and not u.view.has_room for u in seen)
            assert "room unknown" in seen[0].view.detail
            await updates.aclose()  # type: ignore[attr-defined]
    finally:
        await server.stop(grace_s=0.5)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def test_redis_lost_mid_watch_turns_the_room_unknown(redis_url, redis_namespace) -> None:
    """A TCP proxy in front of the real Redis is cut while a watch runs: the watch reports
    UNKNOWN (no room) and stays up."""
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    links: list[asyncio.Task[None]] = []

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        links.extend(
            [
                asyncio.create_task(_pipe(reader, up_writer)),
                asyncio.create_task(_pipe(up_reader, writer)),
            ]
        )

    proxy = await asyncio.start_server(forward, "127.0.0.1", 0)
    url = f"redis://127.0.0.1:{proxy.sockets[0].getsockname()[1]}/0"
    settings = BrokerSettings(
        listen="127.0.0.1:0", redis_url=url, policy=TEST_POLICY, admin_timeout_ms=300
    )
    store = RedisStore(url, namespace=redis_namespace, socket_timeout_s=0.2, op_timeout_s=0.3)
    server = BrokerServer(settings, store)
    await server.start()
    try:
        async with AdmissionClient(target(server), timeout_s=5) as client:
            updates = client.watch_room(heartbeat_ms=100)
            async with asyncio.timeout(20):
                first = await anext(updates)
                assert first.view.status is RoomStatus.OK
                proxy.close()
                for link in links:
                    link.cancel()
                while (update := await anext(updates)).view.status is RoomStatus.OK:
                    pass
                assert not update.view.has_room and update.seq > first.seq
                after = await anext(updates)
            assert after.seq == update.seq + 1 and after.view.status is RoomStatus.UNKNOWN
            await updates.aclose()  # type: ignore[attr-defined]
    finally:
        await server.stop(grace_s=0.5)
        await proxy.wait_closed()


async def test_client_fail_closed_on_transport_errors() -> None:
    dead = f"127.0.0.1:{_closed_port()}"
    async with AdmissionClient(dead, timeout_s=1, fail_closed=True) as client:
        adm = await client.admit(uncached_prompt_tokens=10)
        assert adm.decision is Decision.NORMAL
        # nothing listens: the broker, not its store, is what is unavailable
        assert adm.reason in (Reason.BROKER_UNAVAILABLE, Reason.TIMEOUT), adm
    async with AdmissionClient(dead, timeout_s=1) as client:
        with pytest.raises(BrokerUnavailable) as err:
            await client.admit(uncached_prompt_tokens=10)
        assert "store" not in str(err.value)


async def test_client_fail_closed_on_deadline(blackhole) -> None:
    async with AdmissionClient(f"127.0.0.1:{blackhole}", timeout_s=0.3, fail_closed=True) as c:
        adm = await c.admit(uncached_prompt_tokens=10)
        assert adm.decision is Decision.NORMAL
        assert adm.reason is Reason.TIMEOUT


async def _ready(cluster, agents, **start) -> tuple[BrokerServer, FakeAgent]:
    server = await cluster.start(**start)
    decode = await agents(server, "d1")
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    assert (await decode.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
    return server, decode


async def test_missing_pool_load_fails_closed(cluster, agents) -> None:
    server = await cluster.start()
    decode = await agents(server, "d1")
    await decode.send_lease()
    async with AdmissionClient(target(server), timeout_s=5) as client:
        adm = await client.admit(uncached_prompt_tokens=1_000, explain=True)
        assert adm.decision is Decision.NORMAL and adm.reason is Reason.POOL_LOAD_MISSING
        assert adm.plan is not None and adm.plan.demand.pool_wait_ms is None


async def test_shadow_mode_decides_records_and_debits_nothing(cluster, agents) -> None:
    server, decode = await _ready(cluster, agents)
    async with (
        AdmissionClient(target(server), timeout_s=5) as client,
        AdminClient(target(server)) as admin,
    ):
        await admin.set_policy({"shadow_mode": True})
        for _ in range(3):
            adm = await client.admit(uncached_prompt_tokens=1_000, explain=True)
            assert adm.decision is Decision.NORMAL and adm.reason is Reason.SHADOW_MODE
            assert adm.shadow_decision is Decision.BORROW
            assert adm.plan is not None and adm.plan.ranked[0].node_id == "d1"
            assert "borrow on d1" in adm.message
        assert server.broker.shadow_decisions[Decision.BORROW] == 3
        assert await admin.list_reservations() == []
        node = (await admin.get_node("d1")).node
        assert node.state.open_reservations == 0 and node.state.open_debits.is_zero()
        assert not [n for n in decode.notices if n.kind == lease_pb2.NOTICE_KIND_GRANT]


async def test_dry_run_explains_and_debits_nothing(cluster, agents) -> None:
    server, _ = await _ready(cluster, agents)
    async with (
        AdmissionClient(target(server), timeout_s=5) as client,
        AdminClient(target(server)) as admin,
    ):
        adm = await client.admit(uncached_prompt_tokens=1_000, dry_run=True)
        assert adm.decision is Decision.NORMAL and adm.reason is Reason.DRY_RUN
        assert adm.node_id == "d1" and adm.shadow_decision is Decision.BORROW
        assert adm.predicted_ttft_ms < adm.normal_ttft_ms
        assert await admin.list_reservations() == []


async def test_policy_is_shared_through_the_store(cluster, agents) -> None:
    a, _ = await _ready(cluster, agents, policy_refresh_ms=50)
    b = await cluster.start(policy_refresh_ms=50)
    async with AdminClient(target(a)) as admin:
        await admin.set_policy({"enabled": False})
    async with AdmissionClient(target(b), timeout_s=5) as client:

        async def disabled() -> bool:  # once b has re-read the policy (every 50 ms)
            adm = await client.admit(uncached_prompt_tokens=1_000)
            return adm.reason is Reason.BORROWING_DISABLED

        await eventually(disabled, "b answers BORROWING_DISABLED")
    async with AdminClient(target(b)) as admin:
        assert not (await admin.get_policy()).policy.enabled
