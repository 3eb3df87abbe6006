"""The agent tells the broker its online calibration (``ConnectRequest.step_model``) after a
calibration period, and ``describe node`` data shows it: fitted against prior constants."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from crossflow_agent.agent import Agent
from crossflow_agent.settings import AgentSettings
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.errors import NotFound
from crossflow_ctl.domain.online_calibration import StepModelReport
from crossflow_ctl.domain.step_fit import constants_of
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.agent.conftest import MetricsServer, fixture_text
from tests.conftest import eventually

MODEL, NODE = MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"]


@pytest.fixture
async def broker() -> AsyncIterator[str]:
    server = BrokerServer(BrokerSettings(listen="127.0.0.1:0"), MemoryStore(seed=3), SystemClock())
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(grace_s=0.5)


async def test_the_agent_sends_its_step_model_to_the_broker(
    broker: str, metrics_server: MetricsServer
) -> None:
    metrics_server.text = fixture_text("sglang_t0.prom")
    settings = AgentSettings(
        node_id="n1",
        brokers=[broker],
        metrics_url=metrics_server.url,
        period_ms=50,
        calibration={"window_s": 0.2},
        shutdown_grace_ms=500,
    )
    source = PrometheusSource(settings.metrics_url, SGLangReader())
    agent = Agent(settings, source, MODEL, NODE)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        async with AdminClient(broker) as admin:

            async def reported() -> StepModelReport | None:
                try:
                    return (await admin.get_node("n1")).step_model
                except NotFound:  # not registered yet
                    return None

            report = await eventually(reported, "the agent's step model at the broker")
    finally:
        stop.set()
        await task
        await source.aclose()
    assert report.periods >= 1
    assert report.prior_name == NODE.name
    assert report.prior == constants_of(NODE)
    # the metrics do not move: every window is idle, and the prior prices the leases
    assert report.using.value == "prior" and report.active == report.prior
