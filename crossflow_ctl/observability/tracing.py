"""Traces: the OTLP exporter when configured, W3C context from gRPC metadata, RPC spans.

Without :func:`setup_tracing` (or with no endpoint) nothing is exported and no SDK is installed:
spans are OpenTelemetry API no-ops that still carry the caller's trace context, so a
``traceparent`` sent by a router shows up as ``trace_id`` in the broker's log lines either way.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from crossflow_ctl.domain.errors import ConfigError

log = structlog.get_logger(__name__)

TRACER_NAME = "crossflow"
OTLP_EXPORTER_MODULE = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
UNTRACED_SERVICES = ("/grpc.health.v1.", "/grpc.reflection.")

ATTR_DECISION = "crossflow.decision"
ATTR_REASON = "crossflow.reason"
ATTR_NODE = "crossflow.node_id"

_propagator = TraceContextTextMapPropagator()
Metadata = Iterable[tuple[str, str | bytes]] | None


class _MetadataGetter(Getter[Metadata]):
    """Reads W3C headers out of gRPC invocation metadata (a sequence of key/value pairs)."""

    def get(self, carrier: Metadata, key: str) -> list[str] | None:
        found = [
            v.decode("latin-1") if isinstance(v, bytes) else str(v)
            for k, v in (carrier or ())
            if k.lower() == key
        ]
        return found or None

    def keys(self, carrier: Metadata) -> list[str]:
        return [k for k, _ in (carrier or ())]


_getter = _MetadataGetter()


def setup_tracing(
    otlp_endpoint: str | None,
    *,
    service_name: str = "crossflow",
    exporter: SpanExporter | None = None,
) -> TracerProvider | None:
    """Install an SDK TracerProvider exporting over OTLP/gRPC to ``otlp_endpoint``.

    No endpoint (and no ``exporter``, which tests pass) installs nothing and returns None. The
    OTLP exporter package (``opentelemetry-exporter-otlp-proto-grpc``) is optional and imported
    only here; a configured endpoint without it is a ConfigError.
    """
    if not otlp_endpoint and exporter is None:
        return None
    if exporter is None:
        try:
            module = importlib.import_module(OTLP_EXPORTER_MODULE)
        except ImportError:
            raise ConfigError(
                "an OTLP endpoint is configured but opentelemetry-exporter-otlp-proto-grpc is "
                "not installed",
                field="otlp_endpoint",
            ) from None
        exporter = module.OTLPSpanExporter(endpoint=otlp_endpoint)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing configured", otlp_endpoint=otlp_endpoint or "custom exporter")
    return provider


def extract_context(metadata: Metadata) -> otel_context.Context:
    """The caller's trace context (W3C ``traceparent``/``tracestate``) from gRPC metadata."""
    return _propagator.extract(metadata, getter=_getter)


def inject_metadata(
    metadata: list[tuple[str, str]] | None = None,
) -> list[tuple[str, str]]:
    """Client side: the current trace context appended to outgoing gRPC metadata."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return [*(metadata or []), *carrier.items()]


def _tracer(tracer_provider: trace.TracerProvider | None) -> Tracer:
    return trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)


@contextmanager
def rpc_span(
    method: str,
    metadata: Metadata = None,
    *,
    attributes: Mapping[str, str | int | float | bool] | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> Iterator[Span]:
    """A SERVER span for one RPC, child of the caller's context, current while it runs.

    ``method`` is the full gRPC method (``/crossflow.v1.AdmissionService/Admit``) or a short
    name. Exceptions are recorded on the span and re-raised.

    Without an SDK provider (none given, none installed) nothing could record it: the caller's
    context is made current as it comes, which is what a no-op span leaves current (logs keep
    the caller's trace id), without building one (a seventh of a bare unary call's cost).
    """
    provider = tracer_provider or trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        token = otel_context.attach(extract_context(metadata))
        try:
            yield trace.get_current_span()
        finally:
            otel_context.detach(token)
        return
    name = method.lstrip("/")
    service, _, rpc = name.rpartition("/")
    attrs: dict[str, Any] = {"rpc.system": "grpc", "rpc.method": rpc or name}
    if service:
        attrs["rpc.service"] = service
    attrs.update(attributes or {})
    with _tracer(provider).start_as_current_span(
        name,
        context=extract_context(metadata),
        kind=SpanKind.SERVER,
        attributes=attrs,
        record_exception=True,
        set_status_on_exception=True,
    ) as span:
        yield span


def spans_recorded() -> bool:
    """Whether the process's tracer provider is an SDK one (:func:`setup_tracing`), which
    :func:`span` needs to make a span at all. A hot path asks once (an agent stream, when it
    opens) rather than per item: with no provider installed, the API's lookup reads the
    environment on every call."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def span(
    name: str,
    attributes: Mapping[str, str | int | float | bool] | None = None,
    *,
    tracer_provider: trace.TracerProvider | None = None,
) -> AbstractContextManager[Span]:
    """An internal span (e.g. ``crossflow.lease_batch`` with the node id) under the current one.

    Without an SDK provider (no :func:`setup_tracing`, none given) nothing could record it, so
    none is made: the current span stays current, as a no-op child would leave it. The broker
    opens one per lease, and the API's no-op spans cost a tenth of a lease's ingest."""
    provider = tracer_provider or trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return nullcontext(trace.get_current_span())
    return _tracer(provider).start_as_current_span(name, attributes=dict(attributes or {}))


def annotate_decision(decision: object, reason: object = None, node_id: str | None = None) -> None:
    """Put the decision, its reason and the node on the current span."""
    current = trace.get_current_span()
    if not current.is_recording():
        return
    current.set_attribute(ATTR_DECISION, str(getattr(decision, "value", decision)))
    if reason is not None:
        current.set_attribute(ATTR_REASON, str(getattr(reason, "value", reason)))
    if node_id:
        current.set_attribute(ATTR_NODE, node_id)


def annotate_node(node_id: str) -> None:
    current = trace.get_current_span()
    if node_id and current.is_recording():
        current.set_attribute(ATTR_NODE, node_id)


def mark_error(message: str) -> None:
    current = trace.get_current_span()
    if current.is_recording():
        current.set_status(Status(StatusCode.ERROR, message))
