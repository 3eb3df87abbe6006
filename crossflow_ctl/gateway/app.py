"""The gateway's aiohttp application and everything it owns for its lifetime.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as SSE or not, as the
client asks), ``GET /v1/models``, ``GET /health`` (200 while at least one prefill and one decode
engine are up, else 503), ``GET /metrics`` (Prometheus text).

:func:`build_app` wires it; the app's cleanup context starts the HTTP client session, the
engines' health loop, the broker client and the late-binding queue's room watch, and on
shutdown closes the queue (held prompts go to prefill), releases every open reservation and
closes the rest. Handlers are cancelled when their client disconnects (``handler_cancellation``
on the runner), so a borrowed prompt's reservation is released ``cancelled`` and the engine
request is closed, which aborts it on the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from opentelemetry.trace import TracerProvider

from crossflow_ctl.aio import cancel_and_wait
from crossflow_ctl.client import AdmissionClient, AdmissionQueue, QueueConfig
from crossflow_ctl.domain.admission import AdmissionRequest
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.gateway.discovery import DiscoveryError, KubernetesEngines, discover
from crossflow_ctl.gateway.engines import Engine, EnginePool, health_loop
from crossflow_ctl.gateway.metrics import GatewayMetrics
from crossflow_ctl.gateway.pipeline import Gateway
from crossflow_ctl.gateway.protocols import protocol_for
from crossflow_ctl.gateway.reservations import Reservations
from crossflow_ctl.gateway.settings import EngineEndpoint, GatewaySettings

log = structlog.get_logger()

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4"


async def discover_model(
    session: aiohttp.ClientSession, engines: list[Engine], timeout_s: float
) -> str:
    """The first model an engine's ``/v1/models`` lists (engines asked in turn)."""
    errors: list[str] = []
    for engine in engines:
        try:
            async with session.get(
                f"{engine.url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                data = await resp.json(content_type=None)
            return str(data["data"][0]["id"])
        except (
            aiohttp.ClientError,
            TimeoutError,
            ValueError,
            KeyError,
            IndexError,
            TypeError,
        ) as exc:
            errors.append(f"{engine.node_id}: {type(exc).__name__} {exc}".strip())
    raise ConfigError(
        "model: not set, and no engine listed one on /v1/models (" + "; ".join(errors) + ")",
        field="model",
    )


def build_app(
    settings: GatewaySettings, tracer_provider: TracerProvider | None = None
) -> web.Application:
    """``tracer_provider``: where the request spans go (None: the global one, which the entry
    point sets up from ``otlp_endpoint``)."""
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.cleanup_ctx.append(lambda a: _lifetime(a, settings, tracer_provider))
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _lifetime(
    app: web.Application, settings: GatewaySettings, tracer_provider: TracerProvider | None
) -> AsyncIterator[None]:
    timeout = aiohttp.ClientTimeout(
        total=settings.request_timeout_s, sock_connect=settings.connect_timeout_s
    )
    session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
    pool = EnginePool(settings.prefill, settings.decode)
    metrics = GatewayMetrics()
    tasks: list[asyncio.Task[Any]] = []
    client: AdmissionClient | None = None
    queue: AdmissionQueue | None = None
    reservations: Reservations | None = None
    protocol = protocol_for(settings.protocol)
    try:
        model = settings.model or await discover_model(
            session, [*pool.prefill, *pool.decode], settings.connect_timeout_s
        )
        if settings.broker is not None and settings.borrows:
            client = AdmissionClient(
                settings.broker,
                timeout_s=settings.admit_timeout_ms / 1000.0,
                fail_closed=True,
                credentials=settings.broker_auth,
            )
            reservations = Reservations(client, metrics)

            def prefill_room(request: AdmissionRequest) -> bool:
                return pool.prefill_has_room(
                    request.uncached_prompt_tokens, settings.prefill_room_tokens
                )

            queue = AdmissionQueue(
                client,
                QueueConfig(max_hold_ms=settings.max_hold_ms),
                prefill_room=prefill_room,
                prefill_target=lambda _: _least_loaded_prefill(pool),
            )
            tasks.append(asyncio.create_task(queue.run(client.room_updates(pool=settings.pool))))
        gateway = Gateway(
            settings, session, pool, protocol, metrics, queue, reservations, model, tracer_provider
        )
        for engine in pool.all():
            metrics.engine_state(engine)

        def checked(back: list[Engine]) -> None:
            for engine in back:
                gateway.prefix.forget(engine.node_id)
            for engine in pool.all():
                metrics.engine_state(engine)

        tasks.append(
            asyncio.create_task(
                health_loop(
                    pool, session, settings.health_period_s, settings.connect_timeout_s, checked
                )
            )
        )
        if settings.kubernetes is not None:
            tasks.append(
                asyncio.create_task(_discovery_loop(settings.kubernetes, session, gateway))
            )
        app[GATEWAY] = gateway
        log.info(
            "gateway.started",
            model=model,
            protocol=settings.protocol,
            broker=settings.broker if client is not None else "none (static P/D)",
            prefill=[e.node_id for e in pool.prefill],
            decode=[e.node_id for e in pool.decode],
        )
        yield
    finally:
        await cancel_and_wait(tasks)
        await _close(app.get(GATEWAY), queue, reservations, client)
        if hasattr(protocol, "aclose"):
            await protocol.aclose()
        await session.close()


async def _close(
    gateway: Gateway | None,
    queue: AdmissionQueue | None,
    reservations: Reservations | None,
    client: AdmissionClient | None,
) -> None:
    """Staged: clean-ups of departed clients, held prompts to prefill, open reservations
    released, then the broker connection."""
    if gateway is not None:
        await gateway.aclose()
    if queue is not None:
        await queue.close()
    if reservations is not None:
        await reservations.close()
    if client is not None:
        await client.close()


async def _discovery_loop(
    source: KubernetesEngines, session: aiohttp.ClientSession, gateway: Gateway
) -> None:
    """Keep the pools to the cluster's ready engine pods until cancelled."""
    failing = False
    while True:
        try:
            prefill, decode = await discover(session, source)
        except DiscoveryError as exc:
            if not failing:
                log.warning("gateway.discovery_failed", error=str(exc))
            failing = True
        else:
            if failing:
                log.info("gateway.discovery_recovered")
            failing = False
            joined, left = gateway.pool.replace(
                [EngineEndpoint.model_validate(e) for e in prefill],
                [EngineEndpoint.model_validate(e) for e in decode],
            )
            for engine in left:
                gateway.prefix.forget(engine.node_id)
                gateway.metrics.forget_engine(engine)
                log.info("gateway.engine_left", node_id=engine.node_id, role=engine.role)
            for engine in joined:
                gateway.metrics.engine_state(engine)
                log.info("gateway.engine_joined", node_id=engine.node_id, role=engine.role,
                         url=engine.url)  # fmt: skip
        await asyncio.sleep(source.period_s)


def _least_loaded_prefill(pool: EnginePool) -> str | None:
    engine = pool.pick_prefill()
    return engine.node_id if engine is not None else None


async def _completions(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].handle(request, "completions")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].handle(request, "chat")


async def _models(request: web.Request) -> web.Response:
    model = request.app[GATEWAY].model
    return web.json_response(
        {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "crossflow"}]}
    )


async def _health(request: web.Request) -> web.Response:
    pool = request.app[GATEWAY].pool
    up = {role: sum(e.healthy for e in engines) for role, engines in
          (("prefill", pool.prefill), ("decode", pool.decode))}  # fmt: skip
    ok = all(up.values())
    return web.json_response({"status": "ok" if ok else "unavailable", "up": up},
                             status=200 if ok else 503)  # fmt: skip


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[GATEWAY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


class GatewayServer:
    """The app on a TCP site: ``await start()`` (returns the bound port), ``await close()``."""

    def __init__(
        self, settings: GatewaySettings, tracer_provider: TracerProvider | None = None
    ) -> None:
        self.settings = settings
        self.app = build_app(settings, tracer_provider)
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        self.port = 0

    @property
    def url(self) -> str:
        host = self.settings.listen.rpartition(":")[0]
        return f"http://{host}:{self.port}"

    @property
    def gateway(self) -> Gateway:
        return self.app[GATEWAY]

    async def start(self) -> int:
        await self._runner.setup()
        host, _, port = self.settings.listen.rpartition(":")
        site = web.TCPSite(self._runner, host, int(port))
        await site.start()
        addresses = self._runner.addresses
        self.port = int(addresses[0][1])
        return self.port

    async def close(self) -> None:
        await self._runner.cleanup()


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set; prints ``listening on HOST:PORT`` once bound."""
    server = GatewayServer(settings)
    await server.start()
    try:
        print(f"listening on {settings.listen.rpartition(':')[0]}:{server.port}", flush=True)
        await stop.wait()
    finally:
        await server.close()
