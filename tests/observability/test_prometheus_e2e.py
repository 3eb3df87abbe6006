"""End to end with a real Prometheus: it scrapes a running cluster (a broker over real Redis, a
decode and a prefill agent, a gateway) on loopback, and every selector an alert rule uses
matches series there, with the labels the processes declare.

The Prometheus is Debian's ``prometheus`` package (.ci/run installs it), started by
:class:`crossflow_ctl.demo.prometheus.LocalPrometheus` as ``crossflow demo --prometheus`` starts
it: a temporary config, a free loopback port, a one-second scrape interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc
from crossflow_ctl.demo.processes import Children, executable
from crossflow_ctl.demo.prometheus import LocalPrometheus, Target, prometheus_binary
from tests.observability.test_end_to_end import start_cluster, wait_log
from tests.promql_catalog import exported, rule_selectors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.redis,
    pytest.mark.skipif(
        prometheus_binary() is None,
        reason="prometheus not found: install Debian's prometheus package (.ci/run installs it)",
    ),
]
WAIT_S = 60.0


@pytest.fixture
async def children(tmp_path: Path) -> AsyncIterator[Children]:
    kids = Children(tmp_path)
    try:
        yield kids
    finally:
        await kids.stop()


async def query(http: httpx.AsyncClient, url: str, path: str, **params: Any) -> Any:
    response = await http.get(f"{url}/api/v1/{path}", params=params)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


async def start_gateway(children: Children, engine: str) -> str:
    """A gateway with no broker in front of an engine that does not speak OpenAI (the agents'
    fake engine): it serves /metrics, and the request below ends in a 5xx."""
    argv = [
        executable("crossflow-gateway"), "serve", "--no-broker", "--model", "m",
        "--listen", "127.0.0.1:0", "--prefill", f"p1={engine}", "--decode", f"d1={engine}",
    ]  # fmt: skip
    child = await children.spawn("gateway", argv, "listening on ", 30.0)
    return child.address


async def test_prometheus_scrapes_every_metric_the_alerts_use(
    children: Children, tmp_path: Path, redis_url: str, redis_namespace: str
) -> None:
    broker, agents = await start_cluster(children, tmp_path, redis_url, redis_namespace)
    broker_metrics = (await wait_log(broker, "metrics endpoint serving"))["url"]
    agent_metrics = [(await wait_log(a, "metrics endpoint serving"))["url"] for a in agents]
    gateway = await start_gateway(children, "http://127.0.0.1:9")

    async with grpc.aio.insecure_channel(broker.address) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        await stub.Admit(
            admission_pb2.AdmitRequest(
                request_id="prom-e2e", uncached_prompt_tokens=2_000, expected_output_tokens=200
            ),
            timeout=10,
        )
    async with httpx.AsyncClient(timeout=10.0) as http:
        reply = await http.post(
            f"http://{gateway}/v1/completions", json={"model": "m", "prompt": "hi"}
        )
        assert reply.status_code >= 500  # no engine can answer: a gateway error, counted

    def address(url: str) -> str:
        return url.removeprefix("http://").removesuffix("/metrics")

    targets = [
        Target(address(broker_metrics), "broker"),
        *(
            Target(address(u), "agent", {"node": a.name})
            for u, a in zip(agent_metrics, agents, strict=True)
        ),
        Target(gateway, "gateway"),
    ]
    prometheus = LocalPrometheus(tmp_path / "prometheus", targets, interval_s=1.0)
    url = await prometheus.start(children)

    wanted = {s.text: s for s in rule_selectors()}
    catalog = exported()
    found: dict[str, list[dict[str, str]]] = {}
    async with httpx.AsyncClient(timeout=5.0) as http:
        deadline = time.monotonic() + WAIT_S
        while True:
            up = await query(http, url, "query", query="up == 1")
            for text in wanted:
                if not found.get(text):
                    found[text] = await query(http, url, "series", **{"match[]": text})
            if (len(up["result"]) == len(targets) and all(found.values())) or (
                time.monotonic() > deadline
            ):
                break
            await asyncio.sleep(0.5)

    missing = sorted(text for text, series in found.items() if not series)
    assert missing == [], f"no series in Prometheus for {missing}"
    print(f"\nPrometheus {url} scraped {len(targets)} targets; the rules' selectors found:")
    for text, series in sorted(found.items()):
        sel = wanted[text]
        labels = set().union(*(s.keys() for s in series)) - {"__name__"}
        declared = catalog.labels.get(sel.metric, set()) - {"le"}
        assert declared <= labels, f"{text}: labels {sorted(labels)} lack {declared - labels}"
        if sel.metric != "up":
            assert {"instance", "job", "crossflow_component"} <= labels
        print(f"  {text}: {len(series)} series, labels {sorted(labels)}")
