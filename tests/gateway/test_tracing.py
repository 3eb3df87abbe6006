"""Each request is a span: the caller's trace continues through the gateway, with children for
counting, asking and the engine hops, and the decision on the span."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.gateway.conftest import MODEL, StartCluster

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        yield provider, exporter
    finally:
        provider.shutdown()


@pytest.mark.parametrize(("broker", "path"), [("demand", "borrowed"), ("idle", "normal")])
async def test_a_request_is_a_span_in_the_callers_trace(
    start_cluster: StartCluster,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    broker: str,
    path: str,
) -> None:
    provider, exporter = spans
    cluster = await start_cluster(broker=broker, tracer_provider=provider)
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
    body = {"model": MODEL, "prompt": "a b c d e f", "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{cluster.url}/v1/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status == 200
        await resp.read()
    finished = {span.name: span for span in exporter.get_finished_spans()}
    root = finished["gateway.request"]
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT
    assert root.attributes is not None
    assert root.attributes["crossflow.path"] == path
    assert root.attributes["http.status_code"] == 200
    for child in ("gateway.tokenize", "gateway.admit", f"gateway.{path}"):
        span = finished[child]
        assert span.parent is not None and span.parent.span_id == root.context.span_id
    admit = finished["gateway.admit"].attributes
    assert admit is not None
    assert admit["crossflow.decision"] == ("borrow" if path == "borrowed" else "normal")
