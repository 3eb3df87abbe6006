"""A broker replica's Redis connections stay at a small bound however many agents stream to it
(issue #11). Each Hello costs a registration script and its relay's first notice read; a storm
of them, all at once (agents reconnecting after a replica restart), used to grow the pool
towards one connection per concurrent agent (redis-py opens one whenever all are busy) up to
its old bound of 128, whatever the fleet needed in steady state."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import redis.asyncio as aioredis

from crossflow_ctl.api.v1 import common_pb2, lease_pb2, lease_pb2_grpc
from crossflow_ctl.broker.server import BrokerServer, make_store
from crossflow_ctl.domain.admission import AdmissionRequest, Decision
from crossflow_ctl.domain.clock import ManualClock, SystemClock
from crossflow_ctl.domain.models import NodeRole, PoolLoad
from crossflow_ctl.service.config import BrokerSettings
from tests.broker.agents import lease_msg
from tests.broker.conftest import TEST_POLICY, target

AGENTS = 512
STREAMS_PER_CHANNEL = 128
"""Agent streams share HTTP/2 connections here (as in benchmarks/scale.py), so their Hellos
reach the broker together."""
DEFAULT_BOUND = 16
"""``BrokerSettings.redis_max_connections``' default: small, and the same for any fleet."""


async def _connections(redis_url: str, name: str) -> int:
    """The replica's connections Redis lists, the fewest of a few reads 50 ms apart: a
    connection being replaced shows with its predecessor until Redis drops the old socket (a
    storm at the bound then read 17 once under load); a real excess shows in every read."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        counts = []
        for _ in range(5):
            counts.append(sum(1 for c in await client.client_list() if c.get("name") == name))
            if counts[-1] <= DEFAULT_BOUND:
                break
            await asyncio.sleep(0.05)
        return min(counts)
    finally:
        await client.aclose()


class _Stream:
    """One agent stream: Hello, one lease; then counts the grants relayed to it."""

    def __init__(self, stub: Any, node_id: str) -> None:
        self.node_id = node_id
        self.grants = 0
        self.relayed = asyncio.Event()
        """Set at each relayed message."""
        self._call = stub.Connect()

    async def open(self) -> int:
        hello = lease_pb2.Hello(node_id=self.node_id, role=common_pb2.NODE_ROLE_DECODE, epoch=1)
        await self._call.write(lease_pb2.ConnectRequest(hello=hello))
        assert (await self._call.read()).WhichOneof("body") == "welcome"
        lease = lease_msg(self.node_id, 1, 1, ttl_ms=60_000)
        await self._call.write(lease_pb2.ConnectRequest(lease=lease))
        ack = (await self._call.read()).lease_ack
        return int(ack.result)

    async def count_notices(self) -> None:
        while (msg := await self._call.read()) is not grpc.aio.EOF:
            self.grants += msg.WhichOneof("body") == "notice"
            self.relayed.set()

    def cancel(self) -> None:
        self._call.cancel()


async def test_an_agent_storm_keeps_the_replicas_redis_connections_at_the_default_bound(
    redis_url: str, redis_namespace: str
) -> None:
    settings = BrokerSettings(
        listen="127.0.0.1:0",
        redis_url=redis_url,
        redis_namespace=redis_namespace,
        policy=TEST_POLICY,
        stream_grace_s=1.0,
    )
    server = BrokerServer(settings, make_store(settings), ManualClock(SystemClock().now_ms()))
    await server.start()
    channels = [
        grpc.aio.insecure_channel(target(server)) for _ in range(AGENTS // STREAMS_PER_CHANNEL)
    ]
    stubs = [lease_pb2_grpc.LeaseServiceStub(c) for c in channels]
    streams = [_Stream(stubs[i % len(stubs)], f"d{i:03d}") for i in range(AGENTS)]
    name = f"crossflow:{redis_namespace}"
    readers: list[asyncio.Task[None]] = []
    try:
        results = await asyncio.gather(*(s.open() for s in streams))  # every Hello at once
        opened = await _connections(redis_url, name)
        readers = [asyncio.create_task(s.count_notices()) for s in streams]
        broker = server.broker
        await broker.register("p1", NodeRole.PREFILL, "default", {})
        load = PoolLoad(
            node_id="p1", outstanding_uncached_tokens=10**6, processing_rate_tps=1e4, ttl_ms=60_000
        )
        await broker.ingest_pool_load(load)
        request = AdmissionRequest(uncached_prompt_tokens=100, expected_output_tokens=10)
        answers = await asyncio.gather(*(broker.admit(request) for _ in range(64)))
        granted = sum(a.decision is Decision.BORROW for a in answers)
        async with asyncio.timeout(30):
            for s in streams:
                while s.grants < sum(a.node_id == s.node_id for a in answers if a.reservation_id):
                    s.relayed.clear()
                    await s.relayed.wait()
        busy = await _connections(redis_url, name)
    finally:
        for s in streams:
            s.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for c in channels:
            await c.close()
        await server.stop(grace_s=1.0)
    assert results == [lease_pb2.LEASE_RESULT_ACCEPTED] * AGENTS
    assert granted >= 1
    assert settings.redis_max_connections == DEFAULT_BOUND
    assert 1 <= opened <= DEFAULT_BOUND, opened
    assert 1 <= busy <= DEFAULT_BOUND, busy
