"""The Prometheus endpoint: an OpenTelemetry MeterProvider read by the Prometheus reader.

:func:`setup_metrics` builds a :class:`~opentelemetry.sdk.metrics.MeterProvider` whose only
reader is ``opentelemetry-exporter-prometheus``'s :class:`PrometheusMetricReader` on a registry
of its own, and serves that registry on ``http://host:port/metrics`` with aiohttp's web server
on the process's event loop (no thread; ``/`` and ``/healthz`` answer ``ok``, other paths 404,
other methods 405), closed with the rest of the process's tasks. Port 0 binds a free port;
:attr:`MetricsEndpoint.port` reports the one bound.
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web
from opentelemetry import metrics as otel_metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from crossflow_ctl.domain.errors import ConfigError

log = structlog.get_logger(__name__)

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
        runner: web.AppRunner,
    ) -> None:
        self.meter_provider = meter_provider
        self.registry = registry
        self._runner = runner
        address = runner.addresses[0]
        self.host: str = str(address[0])
        self.port: int = int(address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def render(self) -> bytes:
        """The exposition text, as a scrape would get it."""
        return generate_latest(self.registry)

    async def close(self) -> None:
        """Stop serving and shut the provider down (idempotent)."""
        if self._runner.server is not None:
            await self._runner.cleanup()
            self.meter_provider.shutdown()


def metrics_app(registry: CollectorRegistry) -> web.Application:
    """GET (and HEAD) /metrics: the registry's exposition; / and /healthz: ``ok``."""

    async def exposition(request: web.Request) -> web.Response:
        # Collection runs off the event loop: with hundreds of nodes it takes a while.
        body = await asyncio.to_thread(generate_latest, registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", exposition)
    app.router.add_get("/", ok)
    app.router.add_get("/healthz", ok)
    return app


async def serve_registry(registry: CollectorRegistry, host: str, port: int) -> web.AppRunner:
    """Serve ``registry`` on ``http://host:port/metrics`` (:func:`metrics_app`) until the
    returned runner's ``cleanup``; ConfigError naming ``metrics_listen`` when it cannot bind."""
    runner = web.AppRunner(metrics_app(registry), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(
            f"cannot serve metrics on {host}:{port}: {exc}", field="metrics_listen"
        ) from None
    return runner


async def setup_metrics(
    host: str = "0.0.0.0",
    port: int = 9464,
    *,
    service_name: str = "crossflow",
    set_global: bool = True,
    announce: bool = True,
) -> MetricsEndpoint:
    """Start the Prometheus endpoint; the process's global MeterProvider becomes its provider.

    ``announce`` logs ``metrics endpoint serving`` with the URL (which tests and the demo
    read). ``set_global`` installs the provider as OpenTelemetry's global one, which the API allows
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
        runner = await serve_registry(registry, host, port)
    except ConfigError:
        provider.shutdown()
        raise
    if set_global and not _global_provider_installed:
        otel_metrics.set_meter_provider(provider)
        _global_provider_installed = True
    endpoint = MetricsEndpoint(provider, registry, runner)
    if announce:  # not a broker worker's own (its supervisor serves the pod's: broker.workers)
        log.info("metrics endpoint serving", url=endpoint.url)
    return endpoint
