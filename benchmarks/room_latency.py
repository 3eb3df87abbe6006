"""WatchRoom latency: how soon a router watching for room sees a lease that brings it.

    python benchmarks/room_latency.py [--redis-url redis://127.0.0.1:6379/0] [--samples 40]

Two broker replicas (grpc.aio on loopback) share one Redis namespace (deleted afterwards). An
agent streams leases whose spare compute alternates, so each is a material change; a router
watches room on replica A. For each lease: the time from the broker's ack to the update that
shows it, when the agent streams to A itself (``same replica``: A's ingest wakes its watches) and
to replica B (``other replica``: A sees it on its next poll of the store). Printed next to the
floors measured in the same run: a bare Redis EVALSHA round trip, and the poll interval.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import redis.asyncio as aioredis

from crossflow_ctl.api.v1 import common_pb2, lease_pb2, lease_pb2_grpc
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.room import RoomUpdate
from crossflow_ctl.observability import setup_logging
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.redis_store import RedisStore

POLL_MS = 100


class Agent:
    def __init__(self, target: str, node_id: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.call = lease_pb2_grpc.LeaseServiceStub(self.channel).Connect()
        self.node_id = node_id
        self.version = 0

    async def hello(self) -> None:
        hello = lease_pb2.Hello(node_id=self.node_id, role=common_pb2.NODE_ROLE_DECODE, epoch=1)
        await self.call.write(lease_pb2.ConnectRequest(hello=hello))
        await self.call.read()

    async def lease(self, compute: int) -> None:
        self.version += 1
        credits = common_pb2.Credits(
            compute_tokens=compute, kv_tokens=100_000, kv_transfer_bytes=10**9,
            output_tokens=8_000, slots=4,
        )  # fmt: skip
        msg = common_pb2.Lease(
            node_id=self.node_id, epoch=1, version=self.version, ttl_ms=60_000, credits=credits,
            queue_wait_ms=5.0, borrowed_prefill_rate_tps=20_000.0, itl_ms=20.0, itl_slo_ms=50.0,
        )  # fmt: skip
        await self.call.write(lease_pb2.ConnectRequest(lease=msg))
        while (await self.call.read()).WhichOneof("body") != "lease_ack":
            pass

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def measure(agent: Agent, updates: AsyncIterator[RoomUpdate], samples: int) -> list[float]:
    out = []
    for i in range(samples):
        compute = 4_000 if i % 2 else 8_000
        await asyncio.sleep(random.uniform(0.0, POLL_MS / 1000.0))
        await agent.lease(compute)
        acked = time.perf_counter()
        async for update in updates:
            if update.view.max_compute_tokens == compute:
                break
        out.append((time.perf_counter() - acked) * 1000.0)
    return out


async def evalsha_floor(url: str, n: int = 200) -> list[float]:
    r = aioredis.Redis.from_url(url)
    sha = await r.script_load("return 1")
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await r.evalsha(sha, 0)
        out.append((time.perf_counter() - t) * 1000.0)
    await r.aclose()
    return out


def line(name: str, values: list[float]) -> str:
    q = statistics.quantiles(values, n=100)
    return f"  {name:<34} p50 {q[49]:7.2f} ms   p99 {q[98]:7.2f} ms   (n={len(values)})"


async def main(url: str, samples: int) -> None:
    namespace = f"bench-room-{uuid.uuid4().hex[:8]}"
    policy = PolicySettings(borrow_share=1.0, max_lease_ttl_ms=60_000)
    room = {"poll_ms": POLL_MS, "max_updates_per_s": 1_000.0}
    servers = []
    for _ in range(2):
        cfg = BrokerSettings(listen="127.0.0.1:0", policy=policy, room=room)
        server = BrokerServer(cfg, RedisStore(url, namespace=namespace))
        await server.start()
        servers.append(server)
    a, b = (f"127.0.0.1:{s.port}" for s in servers)
    try:
        async with AdmissionClient(a) as client:
            updates = client.watch_room()
            await anext(updates)
            results = {}
            for name, where, node in (
                ("same replica (A)", a, "d-a"),
                ("other replica (B)", b, "d-b"),
            ):
                agent = Agent(where, node)
                await agent.hello()
                await agent.lease(1)  # register the node's lease before timing
                results[name] = await measure(agent, updates, samples)
                await agent.lease(0)
                await agent.close()
        floor = await evalsha_floor(url)
    finally:
        for server in servers:
            await server.stop(grace_s=0.5)
        r = aioredis.Redis.from_url(url)
        keys = [k async for k in r.scan_iter(match=f"{namespace}*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()
    print("WatchRoom: lease ack -> room update at a watcher on replica A (Redis store)")
    print(line("floor: bare Redis EVALSHA", floor))
    for name, values in results.items():
        print(line(f"lease streamed to {name}", values))
    print(f"  floor for the other replica: poll interval room.poll_ms = {POLL_MS} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--samples", type=int, default=40)
    args = parser.parse_args()
    setup_logging(json=False, level="warning")
    asyncio.run(main(args.redis_url, args.samples))
