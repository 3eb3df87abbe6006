"""A failing telemetry source is logged (once, then every repeat_s) and its recovery too."""

from __future__ import annotations

import socket

from structlog.testing import capture_logs

from crossflow_agent.agent import Agent
from crossflow_agent.scrape_log import ScrapeHealth
from crossflow_agent.settings import AgentSettings
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS


def test_first_failure_warns_repeats_are_rate_limited_and_recovery_is_said() -> None:
    now = [0.0]
    health = ScrapeHealth("sglang http://x/metrics", lambda: now[0], repeat_s=30.0)
    with capture_logs() as logs:
        health.failed("unreachable", "connection refused")
        now[0] = 10.0
        health.failed("unreachable", "connection refused")
        now[0] = 31.0
        health.failed("unreachable", "connection refused")
        health.failed("http_error", "HTTP 500")  # a new kind is said at once
        health.ok()
        health.ok()
    events = [(e["event"], e.get("kind")) for e in logs]
    assert events == [
        ("scrape.failed", "unreachable"),
        ("scrape.failed", "unreachable"),
        ("scrape.failed", "http_error"),
        ("scrape.recovered", None),
    ]
    assert logs[0]["log_level"] == "warning" and logs[0]["source"] == "sglang http://x/metrics"


async def test_agent_with_a_bad_metrics_url_logs_why_its_lease_is_zero() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens
    url = f"http://127.0.0.1:{port}/metrics"
    settings = AgentSettings(node_id="n1", brokers=["127.0.0.1:1"], metrics_url=url)
    source = PrometheusSource(url, SGLangReader())
    agent = Agent(settings, source, MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"])
    try:
        with capture_logs() as logs:
            lease = await agent.tick()
    finally:
        await source.aclose()
    assert lease is not None and lease.credits.is_zero()
    (failed,) = [e for e in logs if e["event"] == "scrape.failed"]
    assert url in failed["source"] and failed["kind"] == "unreachable"
