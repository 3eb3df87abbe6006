"""Broker fixtures: real grpc.aio servers on loopback port 0 over a real store.

``store_kind`` runs each test on the embedded MemoryStore and on RedisStore (real Redis, this
test's own namespace); ``cluster`` starts one or more broker replicas sharing that store.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.domain.clock import ManualClock, SystemClock
from crossflow_ctl.domain.models import Credits, Lease, NodeRole, PoolLoad
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.observability import BrokerMetrics
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.base import Store
from crossflow_ctl.store.memory import MemoryStore
from tests.broker.agents import FakeAgent
from tests.conftest import patient_redis_store

HAVE_REDIS_STORE = importlib.util.find_spec("crossflow_ctl.store.redis_store") is not None

TEST_POLICY = PolicySettings(
    borrow_share=1.0, hold_ttl_ms=2_000, max_lease_ttl_ms=2_000, admit_timeout_ms=2_000
)
"""Admission's store deadline is 2 s here, not the production 50 ms: on a loaded CI machine a
50 ms deadline turns BORROW into NORMAL(timeout) in tests that are not about timeouts. Tests of
the deadline set their own (test_fail_closed, test_exact_outcomes)."""
PATIENT_ADMIN_MS = 60_000
"""The brokers' store deadline for releases, commits and admin calls here (production: 2 s):
an orphan release that ran into a 2 s Redis stall on a loaded machine failed, and its grant
stayed HELD. Tests of that deadline set their own (test_fail_closed)."""


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis" and not HAVE_REDIS_STORE:
        pytest.skip("crossflow_ctl.store.redis_store has not landed yet")
    return str(request.param)


@pytest.fixture
def store_factory(store_kind: str, request: pytest.FixtureRequest) -> Callable[[], Store]:
    """New store handles on ONE shared state (same MemoryStore, or same Redis namespace)."""
    if store_kind == "memory":
        shared = MemoryStore(seed=7)
        return lambda: shared
    redis_url = request.getfixturevalue("redis_url")
    namespace = request.getfixturevalue("redis_namespace")
    return lambda: patient_redis_store(redis_url, namespace)


class Cluster:
    def __init__(self, store_factory: Callable[[], Store], clock: ManualClock) -> None:
        self.store_factory = store_factory
        self.clock = clock
        self.servers: list[BrokerServer] = []

    async def start(self, policy: PolicySettings = TEST_POLICY, **settings: Any) -> BrokerServer:
        settings.setdefault("admin_timeout_ms", PATIENT_ADMIN_MS)
        cfg = BrokerSettings(
            listen="127.0.0.1:0", policy=policy, stream_grace_s=1.0, notice_block_ms=200, **settings
        )
        server = BrokerServer(cfg, self.store_factory(), self.clock)
        await server.start()
        self.servers.append(server)
        return server

    async def stop_all(self) -> None:
        for server in self.servers:
            await server.stop(grace_s=1.0)
        self.servers.clear()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(SystemClock().now_ms())


@pytest.fixture
async def cluster(store_factory: Callable[[], Store], clock: ManualClock) -> AsyncIterator[Cluster]:
    c = Cluster(store_factory, clock)
    try:
        yield c
    finally:
        await c.stop_all()


def target(server: BrokerServer) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
async def agents() -> AsyncIterator[Callable[..., Awaitable[FakeAgent]]]:
    opened: list[FakeAgent] = []

    async def open_agent(server: BrokerServer, node_id: str, **kw: Any) -> FakeAgent:
        agent = FakeAgent(target(server), node_id, **kw)
        await agent.connect()
        opened.append(agent)
        return agent

    try:
        yield open_agent
    finally:
        await asyncio.gather(*(a.close() for a in opened))


@pytest.fixture
async def blackhole() -> AsyncIterator[int]:
    """A TCP server that accepts and never answers: a hung Redis."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def lending_broker(
    store: Store,
    policy: PolicySettings,
    decode: tuple[str, ...] = ("d1",),
    slots: int = 100,
    sequential: bool = False,
    metrics: BrokerMetrics | None = None,
) -> Broker:
    """A Broker (no gRPC) on ``store`` with ``decode`` nodes leasing ``slots`` borrowed-prompt
    slots each and a prefill pool with a long queue, so an Admit borrows while room lasts."""
    clock = ManualClock(1_700_000_000_000)
    settings = BrokerSettings(policy=policy, admin_timeout_ms=PATIENT_ADMIN_MS)
    broker = Broker(store, clock, settings, metrics=metrics, sequential=sequential)
    for node_id in decode:
        await broker.register(node_id, NodeRole.DECODE, "default", {})
        credits = Credits(compute_tokens=10**6, kv_tokens=10**6, output_tokens=10**6, slots=slots)
        lease = Lease(node_id=node_id, epoch=1, version=1, ttl_ms=60_000, credits=credits)
        await broker.ingest_lease(lease.model_copy(update={"borrowed_prefill_rate_tps": 50_000.0}))
    await broker.register("p1", NodeRole.PREFILL, "default", {})
    load = PoolLoad(
        node_id="p1", outstanding_uncached_tokens=10**6, processing_rate_tps=1e4, ttl_ms=60_000
    )
    await broker.ingest_pool_load(load)
    return broker
