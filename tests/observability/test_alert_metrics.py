"""The series the alert rules read (deploy/helm/crossflow/rules): decode nodes by lease state,
per-node ITL against its SLO with the borrowed work it holds, reservation expiries and late
Commit/Release, and error counters that exist at zero before the first error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import NotFound
from crossflow_ctl.domain.models import Credits, Lease, NodeRole, ZeroReason
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.observability import AgentMetrics, BrokerMetrics, MetricsEndpoint, setup_metrics
from crossflow_ctl.observability.gauges import NodeGauges, refresh_node_gauges
from crossflow_ctl.observability.instruments import (
    DECODE_NODE_STATES,
    RESERVATION_EVENTS,
    STORE_OPERATIONS,
    ZERO_REASONS,
)
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from crossflow_ctl.store.redis_store import RedisStore
from tests.broker.agents import FakeAgent

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
CREDIT = Credits(compute_tokens=10_000, kv_tokens=50_000, output_tokens=4_000, slots=4)


@pytest.fixture
async def endpoint() -> AsyncIterator[MetricsEndpoint]:
    ep = await setup_metrics("127.0.0.1", 0, set_global=False)
    try:
        yield ep
    finally:
        await ep.close()


async def scrape(ep: MetricsEndpoint) -> Samples:
    async with httpx.AsyncClient(timeout=5.0) as client:
        text = (await client.get(ep.url)).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def test_decode_nodes_by_lease_state_and_itl_against_slo(endpoint: MetricsEndpoint) -> None:
    clock = ManualClock()
    store = MemoryStore(seed=1)
    now = clock.now_ms()
    for node in ("lends", "slow", "zero", "cordoned", "silent", "gone"):
        await store.register_node(node, NodeRole.DECODE, "default", {}, now)
    await store.register_node("p0", NodeRole.PREFILL, "default", {}, now)
    await store.upsert_lease(
        Lease(node_id="lends", epoch=1, version=1, ttl_ms=5_000, credits=CREDIT, itl_ms=20.0,
              itl_slo_ms=50.0),
        now, 5_000,
    )  # fmt: skip
    await store.upsert_lease(
        Lease(node_id="slow", epoch=1, version=1, ttl_ms=5_000, credits=CREDIT), now, 5_000
    )
    await store.upsert_lease(
        Lease(node_id="zero", epoch=1, version=1, ttl_ms=5_000, zero_reason=ZeroReason.STARTING),
        now,
        5_000,
    )
    await store.upsert_lease(
        Lease(node_id="cordoned", epoch=1, version=1, ttl_ms=5_000, credits=CREDIT), now, 5_000
    )
    await store.set_cordon("cordoned", True, "maintenance", now)
    await store.upsert_lease(
        Lease(node_id="gone", epoch=1, version=1, ttl_ms=1_000, credits=CREDIT), now, 1_000
    )
    # "slow" lends, then trips its ITL guard while holding a borrowed prompt.
    granted = await store.try_debit("slow", Credits(compute_tokens=100, slots=1), 1.0, now, 60_000)
    assert granted.granted
    clock.advance(2_000)
    await store.upsert_lease(
        Lease(node_id="slow", epoch=1, version=2, ttl_ms=5_000,
              zero_reason=ZeroReason.ITL_OVER_SLO, itl_ms=80.0, itl_slo_ms=50.0),
        clock.now_ms(), 5_000,
    )  # fmt: skip

    metrics = BrokerMetrics(endpoint.meter_provider)
    gauges = NodeGauges(metrics, clock.now_ms)
    assert await refresh_node_gauges(gauges, lambda: store.list_nodes(clock.now_ms()))
    s = await scrape(endpoint)
    states = {
        dict(labels)["state"]: v
        for (name, labels), v in s.items()
        if name == "crossflow_broker_decode_nodes"
    }
    assert set(states) == DECODE_NODE_STATES | {"other"}
    assert {k: v for k, v in states.items() if v} == {
        "lending": 1,
        "itl_over_slo": 1,
        "starting": 1,
        "cordoned": 1,
        "no_lease": 1,
        "expired": 1,
    }
    assert value(s, "crossflow_broker_node_itl_seconds", node="slow") == pytest.approx(0.08)
    assert value(s, "crossflow_broker_node_itl_slo_seconds", node="slow") == pytest.approx(0.05)
    assert value(s, "crossflow_broker_node_open_reservations", node="slow") == 1
    assert value(s, "crossflow_broker_node_itl_seconds", node="lends") == pytest.approx(0.02)
    assert value(s, "crossflow_broker_node_open_reservations", node="lends") == 0
    # An expired lease says nothing current about the node's ITL.
    assert value(s, "crossflow_broker_node_itl_seconds", node="gone") == 0
    assert not any(dict(labels).get("node") == "p0" for _, labels in s)

    # A node deleted from the store leaves every per-node series.
    await store.delete_node("slow", True, clock.now_ms())
    assert await refresh_node_gauges(gauges, lambda: store.list_nodes(clock.now_ms()))
    s = await scrape(endpoint)
    assert not any(dict(labels).get("node") == "slow" for _, labels in s)
    assert value(s, "crossflow_broker_decode_nodes", state="itl_over_slo") == 0


async def test_error_and_event_series_exist_at_zero(endpoint: MetricsEndpoint) -> None:
    BrokerMetrics(endpoint.meter_provider)
    AgentMetrics(endpoint.meter_provider)
    s = await scrape(endpoint)
    for operation in STORE_OPERATIONS:
        assert value(s, "crossflow_broker_store_errors_total", operation=operation) == 0
    for event in RESERVATION_EVENTS:
        assert value(s, "crossflow_broker_reservation_events_total", event=event) == 0
    for reason in ZERO_REASONS:
        assert value(s, "crossflow_broker_zero_leases_total", reason=reason) == 0
        assert value(s, "crossflow_agent_zero_leases_total", reason=reason) == 0
    adm = "crossflow_broker_admissions_total"
    assert value(s, adm, decision="normal", reason="store_unavailable") == 0
    assert value(s, adm, decision="normal", reason="timeout") == 0
    assert value(s, adm, decision="borrow", reason="borrowed") == 0
    assert value(s, "crossflow_broker_lost_debit_replies_total") == 0
    assert value(s, "crossflow_agent_stream_connected") == 0  # never connected reads 0
    assert value(s, "crossflow_agent_stream_reconnects_total") == 0


@pytest.mark.redis
async def test_expiries_and_late_commit_and_release_are_counted(
    endpoint: MetricsEndpoint, redis_url: str, redis_namespace: str
) -> None:
    hold_ms = 300
    settings = BrokerSettings(
        listen="127.0.0.1:0",
        policy=PolicySettings(borrow_share=1.0, hold_ttl_ms=hold_ms),
        stream_grace_s=1.0,
        notice_block_ms=100,
    )
    metrics = BrokerMetrics(endpoint.meter_provider)
    server = BrokerServer(settings, RedisStore(redis_url, namespace=redis_namespace), None, metrics)
    await server.start()
    address = f"127.0.0.1:{server.port}"
    decode = FakeAgent(address, "late-d1")
    prefill = FakeAgent(address, "late-p1", role=common_pb2.NODE_ROLE_PREFILL)
    events = "crossflow_broker_reservation_events_total"
    try:
        await decode.connect()
        await prefill.connect()
        await prefill.send_pool_load()
        await prefill.sync()
        assert (await decode.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
        async with AdmissionClient(address, timeout_s=5) as client:
            grants = []
            for i in range(3):
                answer = await client.admit(
                    request_id=f"late-{i}", uncached_prompt_tokens=500, expected_output_tokens=20
                )
                assert answer.decision is Decision.BORROW, answer.message
                grants.append(answer.reservation_id)
            await client.commit(grants[2])  # committed: lives commit_ttl_ms, released below
            await asyncio.sleep(2 * hold_ms / 1000)
            with pytest.raises(NotFound):
                await client.commit(grants[0])
            with pytest.raises(NotFound):
                await client.release(grants[1])
            await client.release(grants[2])
        await decode.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_EXPIRE)
        await decode.sync()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while True:
            s = await scrape(endpoint)
            if value(s, events, event="expire") >= 2 or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
        assert value(s, events, event="expire") == 2  # the two held past their TTL
        assert value(s, events, event="commit_late") == 1
        assert value(s, events, event="release_late") == 1
        assert value(s, events, event="release") == 1
        assert value(s, events, event="commit") == 1
    finally:
        await decode.close()
        await prefill.close()
        await server.stop(grace_s=1.0)
