"""Gateway fixtures: fake engines speaking vLLM's or SGLang's protocols over real HTTP, a real
gRPC broker on loopback whose decode nodes lease under the engines' ids, and the gateway.

The broker runs on a frozen ManualClock with leases ingested directly (no agents), so what it
answers depends only on the test's leases and pool load, never on the machine's speed: a
``demand`` cluster has a prefill pool far behind (Admit borrows while a lease has room); an
``idle`` one has none (Admit answers NO_DEMAND: every prompt takes the normal path).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from crossflow_agent.fake_engine import FakeEngineServer
from crossflow_agent.sources.synthetic import EngineScript, SyntheticEngine
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.clock import ManualClock, SystemClock
from crossflow_ctl.domain.models import Credits, Lease, NodeRole, PoolLoad, ReservationState
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.gateway.app import GatewayServer
from crossflow_ctl.gateway.settings import GatewaySettings
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore

MODEL = "fake-model"
POLICY = PolicySettings(
    borrow_share=1.0, hold_ttl_ms=60_000, max_lease_ttl_ms=60_000, admit_timeout_ms=2_000
)


@dataclass
class Engine:
    """A fake engine and the node id it serves under."""

    node_id: str
    server: FakeEngineServer

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def bootstrap_port(self) -> int | None:
        return self.server.bootstrap_port if self.server.bootstrap_port else None


@dataclass
class Cluster:
    broker: BrokerServer | None
    prefill: list[Engine]
    decode: list[Engine]
    gateway: GatewayServer
    extra: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.gateway.url

    async def open_reservations(self) -> int:
        """Reservations HELD or COMMITTED (a RELEASED one still counts on its node until a
        later lease, by design, but the router is done with it)."""
        assert self.broker is not None
        listed = await self.broker.broker.list_reservations()
        return sum(r.state is not ReservationState.RELEASED for r in listed)


async def metric(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus series' samples whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def lend(broker: BrokerServer, node_id: str, slots: int, version: int = 1) -> None:
    credits = Credits(
        compute_tokens=10**7, kv_tokens=10**7, kv_transfer_bytes=10**12, output_tokens=10**7,
        slots=slots,
    )  # fmt: skip
    lease = Lease(
        node_id=node_id, epoch=1, version=version, ttl_ms=60_000, credits=credits,
        borrowed_prefill_rate_tps=1e6, itl_ms=5.0, itl_slo_ms=50.0,
    )  # fmt: skip
    await broker.broker.ingest_lease(lease)


async def behind(broker: BrokerServer, prefill_id: str, tokens: int) -> None:
    load = PoolLoad(
        node_id=prefill_id, outstanding_uncached_tokens=tokens, processing_rate_tps=1_000.0,
        ttl_ms=60_000,
    )  # fmt: skip
    await broker.broker.ingest_pool_load(load)


StartCluster = Callable[..., Awaitable[Cluster]]


async def eventually(check: Callable[[], Awaitable[Any]], what: str, limit_s: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true; fail naming ``what`` after ``limit_s``
    (generous: only a broken gateway takes that long, a loaded machine does not)."""
    try:
        async with asyncio.timeout(limit_s):
            while not (value := await check()):  # noqa: ASYNC110 - polling another process
                await asyncio.sleep(0.02)
            return value
    except TimeoutError:
        raise AssertionError(f"not within {limit_s} s: {what}") from None


@pytest.fixture
async def start_cluster() -> AsyncIterator[StartCluster]:
    opened: list[Cluster] = []

    async def start(
        *,
        protocol: str = "vllm",
        prefill: int = 1,
        decode: int = 2,
        broker: str = "demand",
        slots: int = 4,
        max_hold_ms: int = 0,
        tracer_provider: Any = None,
        **gateway: Any,
    ) -> Cluster:
        engines: dict[str, list[Engine]] = {"prefill": [], "decode": []}
        for role, count in (("prefill", prefill), ("decode", decode)):
            for i in range(1, count + 1):
                synthetic = SyntheticEngine(
                    MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"], EngineScript(),
                    model_name=MODEL,
                )  # fmt: skip
                server = FakeEngineServer(
                    synthetic, protocol=protocol, pd_role=role, model=MODEL,
                    engine_id=f"{role}-{i}",
                )  # fmt: skip
                await server.start()
                engines[role].append(Engine(f"{role}-{i}", server))
        server_b: BrokerServer | None = None
        broker_addr: str | None = None
        if broker in ("demand", "idle"):
            settings_b = BrokerSettings(listen="127.0.0.1:0", policy=POLICY, stream_grace_s=1.0)
            server_b = BrokerServer(
                settings_b, MemoryStore(seed=7), ManualClock(SystemClock().now_ms())
            )
            await server_b.start()
            broker_addr = f"127.0.0.1:{server_b.port}"
            for e in engines["decode"]:
                await server_b.broker.register(e.node_id, NodeRole.DECODE, "default", {})
                await lend(server_b, e.node_id, slots)
            for e in engines["prefill"]:
                await server_b.broker.register(e.node_id, NodeRole.PREFILL, "default", {})
                await behind(server_b, e.node_id, 10**7 if broker == "demand" else 0)
        elif broker == "unreachable":
            from tests.conftest import free_port

            broker_addr = f"127.0.0.1:{free_port()}"
        settings = GatewaySettings(
            listen="127.0.0.1:0",
            broker=broker_addr,
            protocol=protocol,
            prefill=[_endpoint(e) for e in engines["prefill"]],
            decode=[_endpoint(e) for e in engines["decode"]],
            max_hold_ms=max_hold_ms,
            admit_timeout_ms=2_000 if broker != "unreachable" else 100,
            health_period_s=0.2,
            **gateway,
        )
        gw = GatewayServer(settings, tracer_provider)
        await gw.start()
        cluster = Cluster(server_b, engines["prefill"], engines["decode"], gw)
        opened.append(cluster)
        return cluster

    try:
        yield start
    finally:
        for cluster in opened:
            with contextlib.suppress(Exception):
                await cluster.gateway.close()
            for engine in (*cluster.prefill, *cluster.decode):
                with contextlib.suppress(Exception):
                    await engine.server.close()
            if cluster.broker is not None:
                await cluster.broker.stop(grace_s=0.5)


def _endpoint(engine: Engine) -> dict[str, Any]:
    out: dict[str, Any] = {"node_id": engine.node_id, "url": engine.url}
    if engine.bootstrap_port:
        out["bootstrap_port"] = engine.bootstrap_port
    return out
