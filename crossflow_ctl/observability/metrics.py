"""The Prometheus endpoint: an OpenTelemetry MeterProvider read by the Prometheus reader.

:func:`setup_metrics` builds a :class:`~opentelemetry.sdk.metrics.MeterProvider` whose only
reader is ``opentelemetry-exporter-prometheus``'s :class:`PrometheusMetricReader` on a registry
of its own, and serves that registry on ``http://host:port/metrics`` from a small asyncio HTTP
server (no thread, closed with the rest of the process's tasks). Port 0 binds a free port;
:attr:`MetricsEndpoint.port` reports the one bound.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from opentelemetry import metrics as otel_metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from crossflow_ctl.domain.errors import ConfigError

log = structlog.get_logger(__name__)

_MAX_REQUEST_HEAD_BYTES = 16 * 1024
_READ_TIMEOUT_S = 5.0
_global_provider_installed = False


def parse_listen(listen: str) -> tuple[str, int]:
    """``"host:port"`` (``[v6]:port`` too) into its parts; ConfigError naming the value."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected host:port, got {listen!r}", field="metrics_listen")
    return host, int(port)


class MetricsEndpoint:
    """A running /metrics endpoint and the MeterProvider it exposes."""

    def __init__(
        self,
        meter_provider: MeterProvider,
        registry: CollectorRegistry,
        server: asyncio.Server,
    ) -> None:
        self.meter_provider = meter_provider
        self.registry = registry
        self._server = server
        sockname = server.sockets[0].getsockname()
        self.host: str = str(sockname[0])
        self.port: int = int(sockname[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def render(self) -> bytes:
        """The exposition text, as a scrape would get it."""
        return generate_latest(self.registry)

    async def close(self) -> None:
        """Stop serving and shut the provider down (idempotent)."""
        if self._server.is_serving():
            self._server.close()
        await self._server.wait_closed()
        self.meter_provider.shutdown()


async def setup_metrics(
    host: str = "0.0.0.0",
    port: int = 9464,
    *,
    service_name: str = "crossflow",
    set_global: bool = True,
) -> MetricsEndpoint:
    """Start the Prometheus endpoint; the process's global MeterProvider becomes its provider.

    ``set_global`` installs the provider as OpenTelemetry's global one, which the API allows
    once per process; later calls (tests start several) keep the first and only serve their own
    provider, which callers then pass to :class:`BrokerMetrics` / :class:`AgentMetrics`.
    """
    global _global_provider_installed
    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(scope_info_enabled=False, registry=registry)
    provider = MeterProvider(
        metric_readers=[reader], resource=Resource.create({SERVICE_NAME: service_name})
    )
    try:
        server = await asyncio.start_server(
            lambda r, w: _serve(registry, r, w), host=host, port=port
        )
    except OSError as exc:
        provider.shutdown()
        raise ConfigError(
            f"cannot serve metrics on {host}:{port}: {exc}", field="metrics_listen"
        ) from None
    if set_global and not _global_provider_installed:
        otel_metrics.set_meter_provider(provider)
        _global_provider_installed = True
    endpoint = MetricsEndpoint(provider, registry, server)
    log.info("metrics endpoint serving", url=endpoint.url)
    return endpoint


async def _serve(
    registry: CollectorRegistry, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """One HTTP/1.x exchange: GET /metrics gets the exposition, anything else 404/405."""
    try:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            return
        if len(head) > _MAX_REQUEST_HEAD_BYTES:
            return
        parts = head.split(b"\r\n", 1)[0].split()
        method, path = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"")
        path = path.split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            status, ctype, body = "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        elif path == b"/metrics":
            # Collection runs off the event loop: with hundreds of nodes it takes a while.
            body = await asyncio.to_thread(generate_latest, registry)
            status, ctype = "200 OK", CONTENT_TYPE_LATEST
        elif path in (b"/", b"/healthz"):
            status, ctype, body = "200 OK", "text/plain", b"ok\n"
        else:
            status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
        header = (
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("ascii")
        writer.write(header if method == b"HEAD" else header + body)
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
