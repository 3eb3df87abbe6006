"""State gauges from a real store listing: open reservations, borrowed tokens, node credits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import Credits, Lease, NodeRole, NodeState
from crossflow_ctl.observability import BrokerMetrics, MetricsEndpoint, setup_metrics
from crossflow_ctl.observability.gauges import NodeGauges, poll_node_gauges, refresh_node_gauges
from crossflow_ctl.store.memory import MemoryStore


@pytest.fixture
async def endpoint() -> AsyncIterator[MetricsEndpoint]:
    ep = await setup_metrics("127.0.0.1", 0, set_global=False)
    try:
        yield ep
    finally:
        await ep.close()


async def scrape(ep: MetricsEndpoint) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        text = (await client.get(ep.url)).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def credit(node: str, name: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return (
        "crossflow_broker_node_available_credits",
        frozenset({("node", node), ("credit", name)}),
    )


async def cluster(clock: ManualClock) -> MemoryStore:
    store = MemoryStore(seed=1)
    now = clock.now_ms()
    for node in ("d0", "d1"):
        await store.register_node(node, NodeRole.DECODE, "default", {}, now)
        lease = Lease(
            node_id=node,
            epoch=1,
            version=1,
            ttl_ms=5_000,
            credits=Credits(compute_tokens=10_000, kv_tokens=50_000, output_tokens=4_000, slots=4),
        )
        await store.upsert_lease(lease, now, 5_000)
    await store.register_node("p0", NodeRole.PREFILL, "default", {}, now)
    debit = Credits(compute_tokens=3_000, kv_tokens=3_500, output_tokens=500, slots=1)
    outcome = await store.try_debit("d0", debit, 1.0, now, 2_000, "req-1")
    assert outcome.granted
    return store


async def test_gauges_follow_the_store(endpoint: MetricsEndpoint) -> None:
    clock = ManualClock()
    store = await cluster(clock)
    metrics = BrokerMetrics(endpoint.meter_provider)
    gauges = NodeGauges(metrics, clock.now_ms)

    assert await refresh_node_gauges(gauges, lambda: store.list_nodes(clock.now_ms()))
    s = await scrape(endpoint)
    assert s[("crossflow_broker_open_reservations", frozenset())] == 1
    assert s[("crossflow_broker_borrowed_tokens", frozenset())] == 3_000
    assert s[credit("d0", "compute_tokens")] == 7_000
    assert s[credit("d0", "slots")] == 3
    assert s[credit("d1", "compute_tokens")] == 10_000
    assert not any(dict(labels).get("node") == "p0" for _, labels in s)  # prefill: no lease
    count = (
        "crossflow_broker_store_operation_duration_seconds_count",
        frozenset({("operation", "list_nodes")}),
    )
    assert s[count] == 1

    # Leases expire on the broker's clock: available credit drops to zero.
    clock.advance(10_000)
    assert await refresh_node_gauges(gauges, lambda: store.list_nodes(clock.now_ms()))
    s = await scrape(endpoint)
    assert s[credit("d1", "compute_tokens")] == 0


async def test_vanished_nodes_are_forgotten_and_failures_counted(
    endpoint: MetricsEndpoint,
) -> None:
    clock = ManualClock()
    store = await cluster(clock)
    metrics = BrokerMetrics(endpoint.meter_provider)
    gauges = NodeGauges(metrics, clock.now_ms)
    listing = await store.list_nodes(clock.now_ms())
    gauges.update(listing)
    gauges.update([n for n in listing if n.info.node_id != "d1"])

    async def failing() -> Sequence[NodeState]:
        raise StoreUnavailable("redis down")

    assert not await refresh_node_gauges(gauges, failing)
    s = await scrape(endpoint)
    assert credit("d1", "compute_tokens") not in s
    assert s[credit("d0", "compute_tokens")] == 7_000
    errors = ("crossflow_broker_store_errors_total", frozenset({("operation", "list_nodes")}))
    assert s[errors] == 1


async def test_poller_stops_on_its_event(endpoint: MetricsEndpoint) -> None:
    clock = ManualClock()
    store = await cluster(clock)
    gauges = NodeGauges(BrokerMetrics(endpoint.meter_provider), clock.now_ms)
    stop = asyncio.Event()
    calls = 0

    async def listing() -> Sequence[NodeState]:
        nonlocal calls
        calls += 1
        if calls == 2:
            stop.set()
        return await store.list_nodes(clock.now_ms())

    await asyncio.wait_for(poll_node_gauges(gauges, listing, 0.001, stop), timeout=10)
    assert calls == 2
    s = await scrape(endpoint)
    assert s[("crossflow_broker_open_reservations", frozenset())] == 1
