"""End to end, real processes on loopback: a broker over real Redis and two real agents.

Scrapes the broker's and the agents' Prometheus endpoints during the run and checks the metric
families with sensible values, and that a router's W3C ``traceparent`` reaches the broker's
decision log line as its ``trace_id``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc
from crossflow_ctl.demo.processes import Child, Children, executable

pytestmark = [pytest.mark.slow, pytest.mark.redis]

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
START_TIMEOUT_S = 30.0
WAIT_S = 30.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def log_lines(child: Child) -> list[dict[str, Any]]:
    out = []
    for line in child.log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


async def wait_log(child: Child, event: str, **fields: Any) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for record in log_lines(child):
            if record.get("event") == event and all(record.get(k) == v for k, v in fields.items()):
                return record
        if child.proc.returncode is not None:
            break
        await asyncio.sleep(0.05)
    pytest.fail(f"{child.name}: no {event} {fields} log line; tail: {child.log_tail(10)}")


async def scrape(url: str) -> Samples:
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.get(url)
    assert response.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def present(samples: Samples, name: str, **labels: str) -> bool:
    want = set(labels.items())
    return any(n == name and want <= ls for n, ls in samples)


async def wait_scrape(url: str, name: str, minimum: float, **labels: str) -> Samples:
    """Scrape until the series exists with at least ``minimum`` (the caller then asserts)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = await scrape(url)
        ready = present(samples, name, **labels) and total(samples, name, **labels) >= minimum
        if ready or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.1)


@pytest.fixture
async def children(tmp_path: Path) -> AsyncIterator[Children]:
    kids = Children(tmp_path)
    try:
        yield kids
    finally:
        await kids.stop()


async def start_cluster(
    children: Children, tmp_path: Path, redis_url: str, namespace: str
) -> tuple[Child, list[Child]]:
    config = tmp_path / "broker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "metrics_listen": "127.0.0.1:0",
                "metrics_refresh_ms": 100,
                "log_level": "debug",
                "log_json": True,
                "stream_grace_s": 1.0,
                "policy": {"max_lease_ttl_ms": 5_000},
            }
        )
    )
    broker = await children.spawn(
        "broker",
        [
            executable("crossflow-broker"),
            "serve",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:0",
            "--redis-url",
            redis_url,
            "--redis-namespace",
            namespace,
        ],
        "listening on ",
        START_TIMEOUT_S,
    )
    agents = []
    for node_id, role in (("e2e-decode-0", "decode"), ("e2e-prefill-0", "prefill")):
        argv = [
            executable("crossflow-agent"), "run", "--node-id", node_id, "--role", role,
            "--source", "synthetic", "--broker", broker.address, "--period-ms", "100",
            "--metrics-listen", "127.0.0.1:0", "--log-level", "info", "--log-json",
        ]  # fmt: skip
        agents.append(await children.spawn(f"agent-{node_id}", argv, "", START_TIMEOUT_S))
    return broker, agents


async def test_metrics_and_trace_ids_end_to_end(
    children: Children, tmp_path: Path, redis_url: str, redis_namespace: str
) -> None:
    broker, agents = await start_cluster(children, tmp_path, redis_url, redis_namespace)
    broker_url = (await wait_log(broker, "metrics endpoint serving"))["url"]
    agent_urls = [(await wait_log(a, "metrics endpoint serving"))["url"] for a in agents]

    # The agents' streams are up and the decode node's lease reached the broker and its gauges.
    await wait_scrape(broker_url, "crossflow_broker_leases_received_total", 2, result="accepted")
    await wait_scrape(broker_url, "crossflow_broker_stream_connections", 2)
    await wait_scrape(broker_url, "crossflow_broker_node_available_credits", 0, node="e2e-decode-0")

    async with grpc.aio.insecure_channel(broker.address) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        reply = await stub.Admit(
            admission_pb2.AdmitRequest(
                request_id="e2e-traced",
                uncached_prompt_tokens=2_000,
                expected_output_tokens=200,
            ),
            metadata=(("traceparent", TRACEPARENT),),
            timeout=10,
        )
    decision = await wait_log(broker, "admit.decided", request_id="e2e-traced")
    assert decision["trace_id"] == TRACE_ID
    assert decision["level"] == "debug"
    assert (
        decision["decision"]
        == admission_pb2.Decision.Name(reply.decision).removeprefix("DECISION_").lower()
    )
    assert (
        decision["reason"]
        == admission_pb2.Reason.Name(reply.reason).removeprefix("REASON_").lower()
    )

    samples = await scrape(broker_url)
    assert total(samples, "crossflow_broker_admissions_total") == 1
    assert total(samples, "crossflow_broker_admissions_total", reason=decision["reason"]) == 1
    assert total(samples, "crossflow_broker_admission_duration_seconds_count") == 1
    assert 0 < total(samples, "crossflow_broker_admission_duration_seconds_sum") < 10
    assert total(samples, "crossflow_broker_leases_received_total", result="accepted") >= 2
    assert total(samples, "crossflow_broker_leases_received_total", result="stale") == 0
    assert total(samples, "crossflow_broker_stream_connections") == 2
    assert total(samples, "crossflow_broker_open_reservations") >= 0
    credits = [
        v
        for (n, ls), v in samples.items()
        if n == "crossflow_broker_node_available_credits" and ("node", "e2e-decode-0") in ls
    ]
    assert len(credits) == 5 and all(v >= 0 for v in credits)
    assert total(samples, "crossflow_broker_store_operation_duration_seconds_count") >= 1

    decode_url, prefill_url = agent_urls
    a = await wait_scrape(decode_url, "crossflow_agent_leases_sent_total", 2)
    assert total(a, "crossflow_agent_leases_sent_total") >= 2
    for url in agent_urls:
        await wait_scrape(url, "crossflow_agent_stream_connected", 1)
        a = await wait_scrape(url, "crossflow_agent_scrape_duration_seconds_count", 2)
        assert total(a, "crossflow_agent_scrape_duration_seconds_count") >= 2
        assert total(a, "crossflow_agent_scrape_failures_total") == 0
        assert total(a, "crossflow_agent_stream_connected") == 1
        assert total(a, "crossflow_agent_stream_connections_total") >= 1
    # A prefill agent reports pool load, never leases.
    assert total(await scrape(prefill_url), "crossflow_agent_leases_sent_total") == 0
