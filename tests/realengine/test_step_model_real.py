"""A real vLLM engine's telemetry reaches ``describe node`` as the agent's step model (issue 31).

An in-process agent scrapes the shared plain engine with online calibration on (1 s windows),
priced from a GPU preset, while requests keep the engine decoding; it sends its calibration to
an in-process broker. What ``crossflowctl describe node`` is built from (GetNode) then holds the
agent's prior, a fit status, busy windows from the engine's own counters, and per-constant
prior/fitted/in-use values. Counts periods and windows, never clocks: whether the fit is
accepted on this loaded machine is not asserted (docs/real-engines.md, Benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from crossflow_agent.agent import Agent
from crossflow_agent.settings import AgentSettings
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.vllm import VLLMReader
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.cli.cmd_node import describe_text
from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.online_calibration import StepModelReport
from crossflow_ctl.domain.step_fit import CONSTANTS, constants_of
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.realengine.harness import VLLMEngine, words_prompt

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.timeout(420)]

MODEL, PRIOR = MODEL_PRESETS["llama-3.1-8b"], NODE_PRESETS["h100"]
BUSY_WINDOWS = 3


@pytest.fixture
async def broker() -> AsyncIterator[str]:
    server = BrokerServer(BrokerSettings(listen="127.0.0.1:0"), MemoryStore(seed=5), SystemClock())
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(grace_s=0.5)


async def keep_decoding(http: httpx.AsyncClient, engine: VLLMEngine, stop: asyncio.Event) -> None:
    i = 0
    while not stop.is_set():
        body = {"model": engine.model, "prompt": words_prompt(40 + 60 * (i % 4), seed=i),
                "max_tokens": 48, "ignore_eos": True}  # fmt: skip
        with contextlib.suppress(httpx.HTTPError):
            await http.post(f"{engine.url}/v1/completions", json=body)
        i += 1


async def test_a_real_engines_telemetry_reaches_describe(
    vllm_engine: VLLMEngine, broker: str
) -> None:
    settings = AgentSettings(
        node_id="real-decode",
        brokers=[broker],
        source="vllm",
        metrics_url=vllm_engine.metrics_url,
        period_ms=200,
        scrape_timeout_ms=5_000,
        calibration={"window_s": 1.0, "min_steps": 4.0},
        shutdown_grace_ms=500,
    )
    stop = asyncio.Event()
    async with httpx.AsyncClient(trust_env=False, timeout=120.0) as http:
        source = PrometheusSource(settings.metrics_url, VLLMReader(), client=http)
        agent = Agent(settings, source, MODEL, PRIOR)
        running = asyncio.create_task(agent.run(stop))
        load = [asyncio.create_task(keep_decoding(http, vllm_engine, stop)) for _ in range(2)]
        report: StepModelReport | None = None
        try:
            async with AdminClient(broker) as admin:
                while report is None or report.windows < BUSY_WINDOWS:
                    assert not running.done(), "the agent stopped"
                    await asyncio.sleep(0.5)
                    with contextlib.suppress(Exception):  # not registered yet
                        report = (await admin.get_node("real-decode")).step_model
                detail = await admin.get_node("real-decode")
        finally:
            stop.set()
            await asyncio.gather(running, *load)
    assert report is not None and report.fit_status is not None
    assert report.prior_name == PRIOR.name and report.prior == constants_of(PRIOR)
    assert set(report.fitted) == set(report.active) == set(CONSTANTS)
    assert report.prior_error > 0.0  # the engine's windows were priced against the prior
    text = describe_text(detail, at=report.at_unix_ms)
    assert "Step model:" in text and PRIOR.name in text and report.fit_status.value in text
