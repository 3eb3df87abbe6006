"""Shadow mode, watched through the metrics: every decision recorded, answered NORMAL, no debit.

A real broker over real Redis and gRPC on loopback, with a decode node that has room and a
prefill pool that is backed up, so the policy would borrow; then shadow mode is switched off and
the same request borrows, which proves the scenario was a borrowing one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.domain.admission import Decision, Reason
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.observability import BrokerMetrics, MetricsEndpoint, setup_metrics
from crossflow_ctl.observability.gauges import NodeGauges, refresh_node_gauges
from crossflow_ctl.service.config import BrokerSettings
from tests.broker.agents import FakeAgent
from tests.conftest import patient_redis_store

pytestmark = pytest.mark.redis

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


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
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_shadow_mode_records_decisions_answers_normal_and_debits_nothing(
    endpoint: MetricsEndpoint, redis_url: str, redis_namespace: str
) -> None:
    settings = BrokerSettings(
        listen="127.0.0.1:0",
        policy=PolicySettings(shadow_mode=True, borrow_share=1.0),
        stream_grace_s=1.0,
        notice_block_ms=100,
    )
    metrics = BrokerMetrics(endpoint.meter_provider)
    server = BrokerServer(settings, patient_redis_store(redis_url, redis_namespace), None, metrics)
    await server.start()
    address = f"127.0.0.1:{server.port}"
    decode = FakeAgent(address, "shadow-d1")
    prefill = FakeAgent(address, "shadow-p1", role=common_pb2.NODE_ROLE_PREFILL)
    try:
        await decode.connect()
        await prefill.connect()
        await prefill.send_pool_load()
        await prefill.sync()
        ack = await decode.send_lease()
        assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
        gauges = NodeGauges(metrics, server.broker.clock.now_ms)
        async with AdmissionClient(address, timeout_s=5) as client, AdminClient(address) as admin:
            for i in range(3):
                answer = await client.admit(
                    request_id=f"shadow-{i}",
                    uncached_prompt_tokens=1_000,
                    expected_output_tokens=50,
                )
                assert answer.decision is Decision.NORMAL
                assert answer.reason is Reason.SHADOW_MODE
                assert answer.shadow_decision is Decision.BORROW, answer.message
                assert not answer.reservation_id

            assert await admin.list_reservations() == []
            node = await admin.get_node("shadow-d1")
            assert node.node.state.open_debits.as_tuple() == (0, 0, 0, 0, 0)
            await decode.sync()
            assert not [n for n in decode.notices if n.kind == lease_pb2.NOTICE_KIND_GRANT]
            assert await refresh_node_gauges(gauges, server.broker.list_nodes)
            s = await scrape(endpoint)
            adm = "crossflow_broker_admissions_total"
            assert value(s, adm, decision="normal", reason="shadow_mode") == 3
            assert value(s, adm, decision="borrow", reason="borrowed") == 0
            assert value(s, "crossflow_broker_shadow_decisions_total", decision="borrow") == 3
            assert value(s, "crossflow_broker_open_reservations") == 0
            assert value(s, "crossflow_broker_borrowed_tokens") == 0

            # Control: the same request with shadow mode off borrows, and the gauges see it.
            await admin.set_policy({"shadow_mode": False})
            live = await client.admit(
                request_id="live", uncached_prompt_tokens=1_000, expected_output_tokens=50
            )
            assert live.decision is Decision.BORROW, live.message
            assert await refresh_node_gauges(gauges, server.broker.list_nodes)
            s = await scrape(endpoint)
            assert value(s, adm, decision="borrow", reason="borrowed") == 1
            assert value(s, "crossflow_broker_shadow_decisions_total", decision="borrow") == 3
            assert value(s, "crossflow_broker_open_reservations") == 1
            assert value(s, "crossflow_broker_borrowed_tokens") == 1_000
            await client.commit(live.reservation_id)
            await client.release(live.reservation_id)
            s = await scrape(endpoint)
            events = "crossflow_broker_reservation_events_total"
            assert value(s, events, event="commit") == 1
            assert value(s, events, event="release") == 1
    finally:
        await decode.close()
        await prefill.close()
        await server.stop(grace_s=1.0)
