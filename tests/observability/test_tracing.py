"""RPC spans from the caller's W3C context over real gRPC, and trace ids in JSON log lines."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc
from crossflow_ctl.broker.interceptor import BrokerInterceptor
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.observability import (
    annotate_decision,
    rpc_span,
    setup_logging,
    setup_tracing,
    span,
)
from crossflow_ctl.observability.logs import reset_logging
from crossflow_ctl.observability.tracing import OTLP_EXPORTER_MODULE

TRACE_ID = "4bf92f3577b34e0ea1c2d3e4f5a6b7c8"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


class DecidingServicer(admission_pb2_grpc.AdmissionServiceServicer):
    """Answers like a broker would: annotate the span, log the decision at debug."""

    async def Admit(self, request: Any, context: Any) -> Any:
        annotate_decision("borrow", "borrowed", "decode-7")
        structlog.get_logger().debug(
            "admission decided", decision="borrow", reason="borrowed", node_id="decode-7"
        )
        return admission_pb2.AdmitResponse(
            decision=admission_pb2.DECISION_BORROW, node_id="decode-7"
        )

    async def Commit(self, request: Any, context: Any) -> Any:
        raise RuntimeError("boom")

    async def Release(self, request: Any, context: Any) -> Any:
        return admission_pb2.ReleaseResponse(reservation_id=request.reservation_id)


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    setup_logging(json=True, level="debug", stream=stream)
    try:
        yield stream
    finally:
        reset_logging()


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        yield provider, exporter
    finally:
        provider.shutdown()


async def serve(provider: TracerProvider | None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[BrokerInterceptor(tracer_provider=provider)])
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(DecidingServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture
async def channel_for() -> AsyncIterator[Any]:
    opened: list[tuple[grpc.aio.Server, grpc.aio.Channel]] = []

    async def make(provider: TracerProvider | None) -> Any:
        server, port = await serve(provider)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        opened.append((server, channel))
        return admission_pb2_grpc.AdmissionServiceStub(channel)

    yield make
    for server, channel in opened:
        await channel.close()
        await server.stop(None)


def decision_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == "admission decided"]


async def test_caller_trace_id_appears_in_decision_log_without_sdk(
    log_stream: io.StringIO, channel_for: Any
) -> None:
    stub = await channel_for(None)
    reply = await stub.Admit(
        admission_pb2.AdmitRequest(uncached_prompt_tokens=100),
        metadata=(("traceparent", TRACEPARENT),),
    )
    assert reply.node_id == "decode-7"
    [line] = decision_lines(log_stream)
    assert line["trace_id"] == TRACE_ID
    assert line["level"] == "debug"
    assert line["decision"] == "borrow"


async def test_span_per_rpc_is_child_of_caller_with_decision_attributes(
    log_stream: io.StringIO,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    channel_for: Any,
) -> None:
    provider, exporter = spans
    stub = await channel_for(provider)
    await stub.Admit(
        admission_pb2.AdmitRequest(uncached_prompt_tokens=100),
        metadata=(("traceparent", TRACEPARENT),),
    )
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Commit(admission_pb2.CommitRequest(reservation_id="r1"))

    admit, commit = exporter.get_finished_spans()
    assert admit.name == "crossflow.v1.AdmissionService/Admit"
    assert admit.kind is SpanKind.SERVER
    assert format(admit.context.trace_id, "032x") == TRACE_ID
    assert admit.parent is not None
    assert format(admit.parent.span_id, "016x") == PARENT_SPAN_ID
    assert admit.attributes is not None
    assert admit.attributes["crossflow.decision"] == "borrow"
    assert admit.attributes["crossflow.reason"] == "borrowed"
    assert admit.attributes["crossflow.node_id"] == "decode-7"
    assert admit.attributes["rpc.method"] == "Admit"
    # The log line carries the broker's own span, child of the caller's.
    [line] = decision_lines(log_stream)
    assert line["trace_id"] == TRACE_ID
    assert line["span_id"] == format(admit.context.span_id, "016x")
    # No caller context: a fresh trace; a failing handler marks its span as an error.
    assert commit.parent is None
    assert not commit.status.is_ok
    assert commit.events and commit.events[0].name == "exception"


def test_rpc_span_without_metadata_starts_a_root(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    with rpc_span("Release", None, tracer_provider=provider) as current:
        assert current.is_recording()
    [finished] = exporter.get_finished_spans()
    assert finished.parent is None
    assert finished.name == "Release"


def test_internal_span_is_recorded_under_the_rpc_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    attrs = {"crossflow.node_id": "d1"}
    with (
        rpc_span("Connect", None, tracer_provider=provider) as rpc,
        span("crossflow.lease_batch", attrs, tracer_provider=provider),
    ):
        pass
    inner, outer = exporter.get_finished_spans()
    assert inner.name == "crossflow.lease_batch" and inner.attributes == {"crossflow.node_id": "d1"}
    assert inner.parent is not None and inner.parent.span_id == rpc.get_span_context().span_id
    assert outer.name == "Connect"


def test_internal_span_without_an_sdk_keeps_the_current_context(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """No SDK provider installed globally: nothing could record the span, so none is made and
    the caller's span stays current (what a no-op child would leave)."""
    provider, exporter = spans
    with (
        rpc_span("Connect", None, tracer_provider=provider) as rpc,
        span("crossflow.lease_batch", {"crossflow.node_id": "d1"}) as inner,
    ):
        assert inner is rpc
    assert [s.name for s in exporter.get_finished_spans()] == ["Connect"]


def test_logs_without_a_span_have_no_trace_id(log_stream: io.StringIO) -> None:
    structlog.get_logger().info("lease zeroed", node_id="n1")
    [line] = [json.loads(x) for x in log_stream.getvalue().splitlines()]
    assert line["event"] == "lease zeroed"
    assert "trace_id" not in line
    assert line["level"] == "info"
    assert "timestamp" in line


def test_info_level_drops_debug_lines() -> None:
    stream = io.StringIO()
    setup_logging(json=True, level="info", stream=stream)
    try:
        structlog.get_logger().debug("admission decided")
        structlog.get_logger().info("node cordoned", node_id="n1")
    finally:
        reset_logging()
    events = [json.loads(x)["event"] for x in stream.getvalue().splitlines()]
    assert events == ["node cordoned"]


def test_tracing_is_off_without_endpoint() -> None:
    assert setup_tracing(None) is None
    assert setup_tracing("") is None


@pytest.mark.may_skip
@pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.exporter.otlp") is not None,
    reason="the optional OTLP exporter is installed here",
)
def test_endpoint_without_the_otlp_package_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        setup_tracing("http://127.0.0.1:4317")
    assert err.value.field == "otlp_endpoint"
    assert OTLP_EXPORTER_MODULE.startswith("opentelemetry.exporter.otlp")


def test_rpc_span_without_an_sdk_makes_the_callers_context_current() -> None:
    """No SDK provider: no span is built, but the caller's trace context is current while the
    RPC runs (as a no-op span would leave it: logs carry the caller's trace id) and not after."""
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = (("traceparent", f"00-{trace_id}-{span_id}-01"),)
    with rpc_span("/crossflow.v1.AdmissionService/Admit", metadata) as current:
        assert not current.is_recording()
        assert trace.get_current_span() is current
        assert format(current.get_span_context().trace_id, "032x") == trace_id
        assert format(current.get_span_context().span_id, "016x") == span_id
    assert not trace.get_current_span().get_span_context().is_valid
    with pytest.raises(RuntimeError), rpc_span("Release", None):
        raise RuntimeError("handler failed")  # re-raised, the context restored
    assert not trace.get_current_span().get_span_context().is_valid


@pytest.mark.parametrize("level", ["info", "warning"])
def test_a_write_to_a_gone_peer_is_one_info_line_not_an_error(level: str) -> None:
    """grpc.aio's ERROR (with traceback) for a streaming write that lost the race with its peer
    closing becomes one INFO ``stream.peer_gone`` line naming the method; other grpc errors stay."""
    stream = io.StringIO()
    setup_logging(json=True, level=level, stream=stream)
    core = logging.getLogger("grpc._cython.cygrpc")
    try:
        try:
            raise RuntimeError('Failed "execute_batch"')
        except RuntimeError:
            core.exception(
                "ExecuteBatchError raised in core by servicer method "
                "[/crossflow.v1.LeaseService/Connect]"
            )
            core.exception("Unexpected [AioRpcError] raised by servicer method [/x/Y]")
    finally:
        reset_logging()
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    kept = [(x["event"], x["level"], x.get("method")) for x in lines]
    gone = ("stream.peer_gone", "info", "/crossflow.v1.LeaseService/Connect")
    other = ("Unexpected [AioRpcError] raised by servicer method [/x/Y]", "error", None)
    assert kept == ([gone, other] if level == "info" else [other])
    assert all("exception" not in x for x in lines if x["event"] == "stream.peer_gone")
