"""``crossflow-broker serve --workers N``: N broker worker processes sharing one gRPC port.

One Python process runs one event loop on one core; a pod with more cores runs more workers.
The supervisor (the process ``serve`` started) runs no broker itself: it starts N copies of
``crossflow-broker serve`` with the same flags, each bound to the same address with
``SO_REUSEPORT`` (the kernel spreads new connections over them), and restarts a worker that
exits (logged ``broker.worker_exited``, with a backoff). Each worker is a replica of its own, as
a second pod is: its own ``broker_id`` (host:pid), Redis connections, caches, notice
subscription and background renewals; all state stays in Redis. A worker that exits with a
usage error (2) before it ever served stops the whole process with that error (a bad setting
would only fail again). SIGTERM/SIGINT go to every worker, which drain as one broker does; the
supervisor exits when they have. Workers die with the supervisor (``PR_SET_PDEATHSIG``).

Metrics: only the supervisor serves ``metrics_listen``. Each worker serves its own on a
loopback port it picks (``metrics on HOST:PORT`` on its stdout), and the supervisor's /metrics
is every worker's exposition merged, each series labelled ``worker="i"`` (Prometheus sums
them as it sums replicas), plus ``crossflow_broker_worker_restarts_total``. The node state
gauges, read from the store (the same for every worker), come from worker 0 alone. So the
chart and its ServiceMonitor keep one metrics port whatever N is.

``workers`` unset: the pod's CPUs (the cgroup CPU quota rounded up, else the CPUs this process
may run on), one on the embedded store (it lives in one process: more is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import click
import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.observability import parse_listen
from crossflow_ctl.observability.metrics import serve_registry
from crossflow_ctl.service.config import BrokerSettings

log = structlog.get_logger()

LISTENING = "listening on "
METRICS_ON = "metrics on "
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
"""Waits before restarting a worker that exited, by how many times it did in a row."""
STEADY_S = 60.0
"""A worker up this long resets its backoff."""
SCRAPE_TIMEOUT_S = 5.0


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup's CPU quota in whole CPUs (rounded up), None without one (v2, then v1)."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        if quota_us > 0 and period_us > 0:
            return max(1, math.ceil(quota_us / period_us))
    return None


def available_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its affinity, capped by the cgroup's quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpus(root)
    return max(1, min(cpus, quota) if quota is not None else cpus)


def worker_count(settings: BrokerSettings) -> int:
    """``settings.workers``, or the pod's CPUs when unset; one on the embedded store
    (ConfigError naming ``workers`` when more were asked for)."""
    if not settings.redis_url:
        if settings.workers not in (None, 1):
            raise ConfigError(
                "the embedded store lives in one process: workers must be 1 (or set redis_url)",
                field="workers",
            )
        return 1
    return settings.workers if settings.workers is not None else available_cpus()


def reserve_port(listen: str) -> tuple[str, socket.socket | None]:
    """``listen`` with its port fixed: port 0 picks a free one, held by a bound (not listening)
    ``SO_REUSEPORT`` socket so no other program takes it while workers bind it; the socket is
    returned to keep (None when the port was given)."""
    host, port = parse_listen(listen)
    if port:
        return listen, None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, 0))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {listen}: {exc}", field="listen") from None
    bound = sock.getsockname()[1]
    return f"{'[' + host + ']' if family == socket.AF_INET6 else host}:{bound}", sock


def _die_with_parent() -> None:
    """In a worker before exec: SIGTERM when the supervisor dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class WorkerMetrics(Collector):
    """The workers' expositions merged, each series labelled with its worker, read at each
    scrape (off the event loop: :func:`serve_registry`); a worker that does not answer (one
    restarting) is left out of that scrape."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for index, port in sorted(self._supervisor.metrics_ports.items()):
            try:
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as answer:
                    text = answer.read().decode()
            except OSError as exc:
                log.warning("broker.worker_scrape_failed", worker=index, error=repr(exc))
                continue
            for family in text_string_to_metric_families(text):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    labels = {**sample.labels, "worker": str(index)}
                    into.samples.append(sample._replace(labels=labels))
        restarts = Metric(
            "crossflow_broker_worker_restarts",
            "Broker worker processes restarted after they exited, by worker.",
            "counter",
        )
        for index, count in enumerate(self._supervisor.restarts):
            restarts.add_sample(
                "crossflow_broker_worker_restarts_total", {"worker": str(index)}, count
            )
        yield from merged.values()
        yield restarts


class Supervisor:
    """Runs ``count`` workers of ``serve`` (``argv``: its flags) on ``listen`` until ``stop``."""

    def __init__(self, count: int, argv: Iterable[str], listen: str, grace_s: float) -> None:
        self.count = count
        self._argv = list(argv)
        self.listen = listen
        self._grace_s = grace_s
        self.metrics_ports: dict[int, int] = {}
        self.restarts = [0] * count
        self.pids: list[int | None] = [None] * count
        self._ready = [asyncio.Event() for _ in range(count)]
        self._stopping = False
        self._procs: list[asyncio.subprocess.Process | None] = [None] * count
        self.fatal: int | None = None
        """A worker's exit status that ends the whole process (a usage error at start)."""

    async def run(self, stop: asyncio.Event, on_ready: asyncio.Event) -> None:
        """Keep every worker running until ``stop`` (or a fatal exit); ``on_ready`` is set once
        all of them have served."""
        loops = [asyncio.create_task(self._keep(i, stop)) for i in range(self.count)]
        ready = asyncio.create_task(self._all_ready(on_ready))
        try:
            await stop.wait()
        finally:
            self._stopping = True
            ready.cancel()
            await self._terminate()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _all_ready(self, on_ready: asyncio.Event) -> None:
        for event in self._ready:
            await event.wait()
        on_ready.set()

    async def _keep(self, index: int, stop: asyncio.Event) -> None:
        failures = 0
        while not self._stopping:
            started = time.monotonic()
            code = await self._run_once(index)
            if self._stopping:
                return
            served = self._ready[index].is_set()
            log.error(
                "broker.worker_exited",
                worker=index,
                pid=self.pids[index],
                returncode=code,
                effect="restarting it" if code != 2 or served else "stopping the broker",
            )
            if code == 2 and not served:  # a usage error: it would only fail again
                self.fatal = code
                stop.set()
                return
            self.metrics_ports.pop(index, None)
            self.restarts[index] += 1
            failures = 0 if time.monotonic() - started > STEADY_S else failures + 1
            delay = RESTART_BACKOFF_S[min(max(failures, 1), len(RESTART_BACKOFF_S)) - 1]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stop.wait()

    async def _run_once(self, index: int) -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "crossflow_ctl.broker",
            "serve",
            *self._argv,
            "--listen",
            self.listen,
            "--worker-index",
            str(index),
            stdout=asyncio.subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        self._procs[index], self.pids[index] = proc, proc.pid
        log.info("broker.worker_started", worker=index, pid=proc.pid)
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(LISTENING):
                self._ready[index].set()
            elif line.startswith(METRICS_ON):
                self.metrics_ports[index] = parse_listen(line[len(METRICS_ON) :])[1]
            else:
                click.echo(line)
        return await proc.wait()

    async def _terminate(self) -> None:
        """SIGTERM every worker, SIGKILL those still up after their drain's grace."""
        live = [p for p in self._procs if p is not None and p.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(2 * self._grace_s + 10.0):
                await asyncio.gather(*(p.wait() for p in live))
        except TimeoutError:
            for proc in live:
                if proc.returncode is None:
                    log.error("broker.worker_killed", pid=proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            await asyncio.gather(*(p.wait() for p in live))


async def supervise(settings: BrokerSettings, count: int, argv: list[str]) -> int:
    """Run ``count`` workers until SIGINT/SIGTERM; the exit status (0, or a worker's fatal)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    listen, held = reserve_port(settings.listen)
    supervisor = Supervisor(count, argv, listen, settings.stream_grace_s)
    endpoint = None
    if settings.metrics_listen:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(WorkerMetrics(supervisor))
        host, port = parse_listen(settings.metrics_listen)
        endpoint = await serve_registry(registry, host, port)
        bound = endpoint.addresses[0]
        where = f"[{bound[0]}]" if ":" in str(bound[0]) else str(bound[0])
        log.info("metrics endpoint serving", url=f"http://{where}:{bound[1]}/metrics")
    ready = asyncio.Event()
    announce = asyncio.create_task(_announce(ready, listen, count))
    try:
        await supervisor.run(stop, ready)
    finally:
        announce.cancel()
        if endpoint is not None:
            await endpoint.cleanup()
        if held is not None:
            held.close()
    return supervisor.fatal or 0


async def _announce(ready: asyncio.Event, listen: str, count: int) -> None:
    await ready.wait()
    log.info("broker.workers_serving", listen=listen, workers=count)
    click.echo(f"{LISTENING}{listen}")
