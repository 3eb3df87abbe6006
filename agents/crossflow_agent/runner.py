"""Process entry: build the agent from its settings and supervise it until a signal.

The supervisor owns every background task (the lease loop, which owns the stream); signal
handlers only set the stop event; shutdown is staged: final SHUTTING_DOWN lease, stream closed,
source closed, metrics endpoint closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import structlog

from crossflow_agent.agent import Agent
from crossflow_agent.profile import load_profile
from crossflow_agent.settings import AgentSettings, SourceKind
from crossflow_agent.sources.base import TelemetrySource
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_agent.sources.synthetic import SyntheticEngine, SyntheticSource
from crossflow_agent.sources.vllm import VLLMReader
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, ModelSpec, NodeProfile
from crossflow_ctl.observability import AgentMetrics, parse_listen, setup_metrics, setup_tracing

log = structlog.get_logger()


def resolve_model(settings: AgentSettings) -> tuple[ModelSpec, NodeProfile]:
    model = MODEL_PRESETS[settings.model]
    if settings.profile_file is not None:
        return model, load_profile(settings.profile_file)
    return model, NODE_PRESETS[settings.node_preset]


def build_source(settings: AgentSettings, model: ModelSpec, node: NodeProfile) -> TelemetrySource:
    timeout_s = settings.scrape_timeout_ms / 1000
    if settings.source is SourceKind.SGLANG:
        return PrometheusSource(settings.metrics_url, SGLangReader(), timeout_s=timeout_s)
    if settings.source is SourceKind.VLLM:
        return PrometheusSource(settings.metrics_url, VLLMReader(), timeout_s=timeout_s)
    return SyntheticSource(SyntheticEngine(model, node, settings.synthetic))


async def run_agent(settings: AgentSettings, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set or SIGINT/SIGTERM arrives."""
    stop = stop or asyncio.Event()
    model, node = resolve_model(settings)
    tracer = setup_tracing(settings.otlp_endpoint, service_name="crossflow-agent")
    endpoint = None
    if settings.metrics_listen:
        endpoint = await setup_metrics(
            *parse_listen(settings.metrics_listen), service_name="crossflow-agent"
        )
    metrics = AgentMetrics(endpoint.meter_provider) if endpoint else AgentMetrics.noop()
    source = build_source(settings, model, node)
    agent = Agent(settings, source, model, node, metrics=metrics)
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        await agent.run(stop)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await source.aclose()
        if endpoint is not None:
            await endpoint.close()
        if tracer is not None:
            tracer.shutdown()
