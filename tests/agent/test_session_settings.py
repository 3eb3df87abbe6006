"""A live policy change reaches agents already connected (real brokers over Redis, a real agent):
every replica pushes the policy-derived settings down its open streams when the policy version it
holds changes them, and the agent sizes its next lease with them, without reconnecting."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from crossflow_ctl.broker.server import BrokerServer, make_store
from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.domain.models import Lease
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.service.config import BrokerSettings
from tests.agent.conftest import MetricsServer, fixture_text
from tests.agent.test_stream import running_agent, stored
from tests.conftest import eventually

pytestmark = pytest.mark.redis


@contextlib.asynccontextmanager
async def replicas(redis_url: str, namespace: str, count: int) -> AsyncIterator[list[str]]:
    """``count`` broker replicas on one Redis namespace, re-reading the policy every 50 ms."""
    servers: list[BrokerServer] = []
    try:
        for _ in range(count):
            settings = BrokerSettings(
                listen="127.0.0.1:0",
                redis_url=redis_url,
                redis_namespace=namespace,
                notice_block_ms=100,
                stream_grace_s=0.5,
                policy_refresh_ms=50,
            )
            server = BrokerServer(settings, make_store(settings))
            servers.append(server)
            await server.start()
        yield [f"127.0.0.1:{s.port}" for s in servers]
    finally:
        for server in servers:
            await server.stop(grace_s=0.5)


async def test_a_policy_change_reaches_an_agent_streaming_to_another_replica(
    redis_url: str, redis_namespace: str, metrics_server: MetricsServer
) -> None:
    metrics_server.text = fixture_text("sglang_t0.prom")
    default = PolicySettings()
    async with (
        replicas(redis_url, redis_namespace, 2) as (streaming, other),
        AdminClient(other) as admin,
        running_agent(metrics_server, [streaming]) as run,
    ):
        state = run.agent.stream.state

        async def lending() -> Lease | None:
            lease = await stored(admin)
            return lease if lease is not None and lease.credits.compute_tokens else None

        first = await eventually(lending, "a lease with credit")
        assert state.borrow_horizon_ms == default.borrow_horizon_ms
        horizon, bytes_per_token = default.borrow_horizon_ms // 4, default.kv_bytes_per_token * 2
        changed = await admin.set_policy(
            {"borrow_horizon_ms": horizon, "kv_bytes_per_token": bytes_per_token}
        )

        async def adopted() -> bool:
            return state.borrow_horizon_ms == horizon

        await eventually(adopted, "the new horizon on the open stream")
        assert state.policy_version == changed.version
        assert state.open_debits.kv_bytes_per_token == bytes_per_token
        assert run.agent.lease_settings().horizon_ms == horizon
        # one copy per horizon, not one per period (the capacity model keys on its identity)
        assert run.agent.lease_settings() is run.agent.lease_settings()
        assert state.sessions == 1 and state.connected  # the same stream, no reconnect

        async def sized_over_it() -> Lease | None:
            lease = await lending()
            ok = lease is not None and lease.version > first.version
            return (
                lease
                if ok and lease.credits.compute_tokens < first.credits.compute_tokens / 2
                else None
            )

        await eventually(sized_over_it, "a lease sized over the quarter horizon")
