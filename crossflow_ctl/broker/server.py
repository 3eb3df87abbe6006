"""The broker's grpc.aio server: Lease, Admission and Admin services, standard health and
reflection, message size limits, one supervisor for every background task, staged shutdown.

Shutdown (``BrokerServer.stop``): health NOT_SERVING; end room watches; stop accepting RPCs;
ask agent streams to end and give them ``stream_grace_s``; cancel the supervisor's tasks; let
Admit batches still being decided finish, the store read the debit replies of Admits that
stopped waiting and the broker release what they granted (one ``stream_grace_s`` for all);
close the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from crossflow_ctl.api.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
)
from crossflow_ctl.broker.auth import (
    Authorizer,
    check_startup,
    load_tokens,
    server_credentials,
)
from crossflow_ctl.broker.interceptor import BrokerInterceptor
from crossflow_ctl.broker.servicers.admin import AdminServicer
from crossflow_ctl.broker.servicers.admission import AdmissionServicer
from crossflow_ctl.broker.streams import LeaseStreamServicer, StreamRegistry
from crossflow_ctl.domain.clock import Clock, SystemClock
from crossflow_ctl.domain.errors import (
    ConfigError,
    CrossflowError,
    StoreAuthFailed,
    StoreUnavailable,
)
from crossflow_ctl.observability import BrokerMetrics
from crossflow_ctl.observability.gauges import NodeGauges, poll_node_gauges
from crossflow_ctl.security.channel import read_secret
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.base import Store

log = structlog.get_logger()

SERVICE_NAMES = (
    lease_pb2.DESCRIPTOR.services_by_name["LeaseService"].full_name,
    admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
)


class Supervisor:
    """Owns every background task of the process; ``shutdown`` cancels and awaits them all."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task.failed", task=task.get_name(), error=repr(task.exception()))

    @property
    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        return frozenset(self._tasks)

    async def shutdown(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def make_store(settings: BrokerSettings) -> Store:
    """RedisStore when ``redis_url`` is set, else the embedded in-process store.

    Credentials come from the URL (``redis://user:password@host``) or ``redis_password_file``
    (and ``redis_username``); ``rediss://`` URLs use TLS, checked against ``redis_ca_file``."""
    if settings.redis_url:
        from crossflow_ctl.store.redis_connect import RedisConnection
        from crossflow_ctl.store.redis_store import RedisStore

        password = None
        if settings.redis_password_file is not None:
            raw = read_secret(settings.redis_password_file, "redis_password_file")
            password = raw.decode(errors="replace").strip()
        connection = RedisConnection(
            username=settings.redis_username,
            password=password,
            ca_file=str(settings.redis_ca_file) if settings.redis_ca_file else None,
        )
        return RedisStore(
            settings.redis_url,
            namespace=settings.redis_namespace,
            connection=connection,
            cluster=settings.redis_cluster,
            max_connections=settings.redis_max_connections,
        )
    from crossflow_ctl.store.memory import MemoryStore

    return MemoryStore()


def describe_store(settings: BrokerSettings) -> str:
    """The store for the logs: the Redis URL without its password, or the embedded one."""
    if not settings.redis_url:
        return "embedded (in-process; one replica only, lost on exit)"
    url = urlsplit(settings.redis_url)
    host = url.hostname or ""
    user = (url.username or "") + (":***" if url.password else "")
    netloc = (f"{user}@" if user else "") + (f"[{host}]" if ":" in host else host)
    if url.port is not None:
        netloc += f":{url.port}"
    kind = " (cluster)" if settings.redis_cluster else ""
    where = urlunsplit((url.scheme, netloc, url.path, "", ""))
    return f"{where}{kind}, key prefix {settings.redis_namespace!r}"


class BrokerServer:
    """One broker replica: ``await start()``, then ``await stop()`` (or ``serve(stop_event)``)."""

    def __init__(
        self,
        settings: BrokerSettings,
        store: Store,
        clock: Clock | None = None,
        metrics: BrokerMetrics | None = None,
        *,
        reuse_port: bool = False,
        node_gauges: bool = True,
    ) -> None:
        """``reuse_port``: bind with SO_REUSEPORT, sharing the port with the other workers of
        ``serve --workers N`` (:mod:`.workers`); off otherwise, so a second broker started on
        a port in use fails instead of silently taking half its connections. ``node_gauges``:
        poll the store for the node state gauges (with metrics on); one worker of a pod does,
        the same figures from the others would only be counted twice."""
        self._node_gauges = node_gauges
        self.settings = settings
        self.store = store
        broker_id = settings.broker_id or f"{socket.gethostname()}:{os.getpid()}"
        self._metrics_enabled = metrics is not None
        self.broker = Broker(store, clock or SystemClock(), settings, broker_id, metrics)
        self.streams = StreamRegistry()
        self.supervisor = Supervisor()
        self.health = health.aio.HealthServicer()
        self._stop_policy = asyncio.Event()
        limit = settings.max_message_bytes
        authorizer = (
            Authorizer(settings.auth, load_tokens(settings.auth))
            if settings.auth.authenticates
            else None
        )
        self._credentials = server_credentials(settings.auth)
        self._server = grpc.aio.server(
            # One wrapper per method: its span, then its caller's check, then its decoding.
            interceptors=[BrokerInterceptor(authorizer)],
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 1 if reuse_port else 0),
                # Find agents that vanished without closing their stream (node crash, partition).
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ],
        )
        self.port = 0

    async def start(self) -> int:
        """Bind, load the shared policy (best effort), start serving; returns the bound port."""
        server = self._server
        lease_pb2_grpc.add_LeaseServiceServicer_to_server(
            LeaseStreamServicer(self.broker, self.streams), server
        )
        admission_pb2_grpc.add_AdmissionServiceServicer_to_server(
            AdmissionServicer(self.broker), server
        )
        admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(self.broker), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        warnings = check_startup(self.settings.auth, self.settings.listen)
        for warning in warnings:
            log.warning("auth.insecure", listen=self.settings.listen, message=warning)
        self.broker.warnings = warnings
        try:
            if self._credentials is None:
                self.port = server.add_insecure_port(self.settings.listen)
            else:
                self.port = server.add_secure_port(self.settings.listen, self._credentials)
        except RuntimeError as exc:
            raise ConfigError(
                f"cannot listen on {self.settings.listen}: {exc}", field="listen"
            ) from None
        await self._check_store()
        try:
            await self.broker.load_policy()
        except CrossflowError as exc:
            log.warning("policy.initial_load_failed", error=str(exc))
        await server.start()
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.supervisor.spawn(
            "policy-refresh", self.broker.refresh_policy_forever(self._stop_policy)
        )
        if self.settings.node_expiry_s > 0:
            self.supervisor.spawn(
                "node-expiry", self.broker.expire_nodes_forever(self._stop_policy)
            )
        if self._metrics_enabled and self._node_gauges:
            broker = self.broker
            gauges = NodeGauges(broker.metrics, broker.clock.now_ms, lambda: broker.policy.shares)
            interval_s = self.settings.metrics_refresh_ms / 1000.0
            self.supervisor.spawn(
                "metrics-gauges",
                poll_node_gauges(gauges, broker.list_nodes, interval_s, self._stop_policy),
            )
        log.info(
            "broker.started",
            listen=self.settings.listen,
            port=self.port,
            tls=self._credentials is not None,
            authenticates=self.settings.auth.authenticates,
            insecure=bool(warnings),
            store=describe_store(self.settings),
        )
        return self.port

    async def _check_store(self) -> None:
        """Refused credentials stop the start (a config error); an unreachable store does not
        (admission fails closed until it answers)."""
        try:
            await self.store.ping()
        except StoreAuthFailed as exc:
            with contextlib.suppress(CrossflowError):
                await self.store.close()
            raise ConfigError(str(exc), field="redis_url") from None
        except StoreUnavailable as exc:
            log.warning(
                "store.unreachable_at_start",
                store=describe_store(self.settings),
                error=str(exc),
                effect="serving anyway: Admit answers NORMAL and agent streams are refused "
                "until the store answers; check redis_url",
            )

    async def stop(self, grace_s: float | None = None) -> None:
        grace = self.settings.stream_grace_s if grace_s is None else grace_s
        log.info("broker.stopping", streams=len(self.streams), grace_s=grace)
        await self.health.enter_graceful_shutdown()
        self.broker.rooms.close()
        stopping = asyncio.create_task(self._server.stop(grace))
        self.streams.close_all()
        drained = await self.streams.wait_idle(grace)
        await stopping
        self._stop_policy.set()
        await self.supervisor.shutdown()
        # Admit batches still being decided first (their callers may be gone), then late debit
        # replies (their grants go to the orphan releases), then those releases, then the
        # store closes: a release started after the wait, or cut off by the close, leaves its
        # grant HELD for nobody until its hold TTL. All within one grace.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self.broker.settle_admissions(grace)
        await self.store.settle(max(0.0, deadline - loop.time()))
        await self.broker.drain(max(0.0, deadline - loop.time()))
        with contextlib.suppress(CrossflowError):
            await self.store.close()
        log.info("broker.stopped", streams_drained=drained)

    async def serve(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set (signal handlers set it), then shut down in stages."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()
