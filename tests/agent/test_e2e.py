"""End to end with real processes: fake engine, two brokers on Redis, agent restarts.

Counts periods by lease versions, never by wall-clock time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from crossflow_agent.agent import hello_request, lease_request
from crossflow_ctl.api.v1 import lease_pb2, lease_pb2_grpc
from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.domain.models import Lease, NodeRole, ZeroReason

pytestmark = [pytest.mark.redis, pytest.mark.slow]

NODE = "e2e-1"
PERIOD_MS = 100


def _open_log(path: Path) -> Any:
    return path.open("wb")


class Procs:
    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[asyncio.subprocess.Process] = []

    async def spawn(self, name: str, ready: str, *args: str, **env: str) -> tuple[Any, str]:
        """Start ``python -m args...``; wait for a stdout line starting with ``ready``."""
        log = _open_log(self.logdir / f"{name}.log")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env={**os.environ, **env},
        )
        log.close()
        self.procs.append(proc)
        if not ready:
            return proc, ""
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            while True:
                line = (await proc.stdout.readline()).decode()
                if not line:
                    raise AssertionError(
                        f"{name} exited: {(self.logdir / f'{name}.log').read_text()}"
                    )
                if line.startswith(ready):
                    return proc, line[len(ready) :].strip()

    async def stop(self, proc: Any, sig: int = signal.SIGTERM) -> int:
        if proc.returncode is None:
            proc.send_signal(sig)
        async with asyncio.timeout(20):
            return int(await proc.wait())

    async def close(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        await p.close()


async def eventually(check: Callable[[], Awaitable[Any]], what: str, limit_s: float = 20.0) -> Any:
    async with asyncio.timeout(limit_s):
        while True:
            with contextlib.suppress(Exception):
                value = await check()
                if value:
                    return value
            await asyncio.sleep(0.03)
    raise AssertionError(what)  # pragma: no cover


async def stored(admin: AdminClient) -> Lease | None:
    view = await admin.get_node(NODE)
    return None if view.node.state.lease is None else view.node.state.lease.lease


async def stored_version(admin: AdminClient) -> int:
    lease = await stored(admin)
    assert lease is not None
    return lease.version


async def stale_ack_for(target: str, epoch: int, version: int) -> lease_pb2.LeaseAck:
    """Send one lease of (epoch, version) on a raw stream and return the broker's ack."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = lease_pb2_grpc.LeaseServiceStub(channel).Connect()
        await call.write(
            hello_request(
                node_id=NODE,
                role=NodeRole.DECODE,
                epoch=epoch,
                pool="default",
                labels={},
                last_notice_seq=0,
            )
        )
        assert (await call.read()).WhichOneof("body") == "welcome"
        await call.write(
            lease_request(Lease(node_id=NODE, epoch=epoch, version=version, ttl_ms=300))
        )
        while True:
            msg = await call.read()
            if msg.WhichOneof("body") == "lease_ack":
                call.cancel()
                ack: lease_pb2.LeaseAck = msg.lease_ack
                return ack


async def test_agent_processes_against_brokers_on_redis(procs, redis_url, redis_namespace) -> None:
    broker = (
        "crossflow_ctl.broker",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--redis-url",
        redis_url,
        "--redis-namespace",
        redis_namespace,
    )
    b1, addr1 = await procs.spawn("broker1", "listening on", *broker)
    _, addr2 = await procs.spawn("broker2", "listening on", *broker)
    engine, metrics_url = await procs.spawn(
        "engine", "fake engine serving", "crossflow_agent", "fake-engine", "--port", "0"
    )
    async with httpx.AsyncClient(trust_env=False) as http:
        r = await http.post(
            metrics_url.replace("/metrics", "/requests"),
            json={"prompt_tokens": 2000, "output_tokens": 100_000, "count": 4},
        )
        assert r.status_code == 200
    agent_args = (
        "crossflow_agent",
        "run",
        "--node-id",
        NODE,
        "--source",
        "sglang",
        "--metrics-url",
        metrics_url,
        "--broker",
        addr1,
        "--broker",
        addr2,
        "--period-ms",
        str(PERIOD_MS),
        "--log-text",
    )
    fast = {"CROSSFLOW_AGENT_BACKOFF_MAX_MS": "300"}
    agent1, _ = await procs.spawn("agent1", "", *agent_args, **fast)

    async with AdminClient(addr2) as admin:

        async def credit() -> Lease | None:
            lease = await stored(admin)
            return lease if lease and not lease.credits.is_zero() else None

        first = await eventually(credit, "a lease with credit from the agent process")
        epoch1 = first.epoch

        # kill the broker the agent streams to: it reconnects to the second, lease current again
        await procs.stop(b1, signal.SIGKILL)
        at_kill = await stored_version(admin)

        async def current_again() -> bool:
            view = await admin.get_node(NODE)
            lease = view.node.state.lease
            return bool(
                lease
                and lease.lease.version > at_kill + 2
                and not view.node.lease_expired
                and not lease.lease.credits.is_zero()
            )

        await eventually(current_again, "the lease current again through the second broker")

        # restart the agent: graceful stop leaves a SHUTTING_DOWN lease, the new epoch is taken
        assert await procs.stop(agent1) == 0
        last = await stored(admin)
        assert last is not None and last.zero_reason is ZeroReason.SHUTTING_DOWN
        await procs.spawn("agent2", "", *agent_args, **fast)

        async def new_epoch() -> Lease | None:
            lease = await credit()
            return lease if lease and lease.epoch > epoch1 else None

        second = await eventually(new_epoch, "a lease in the new epoch")
        ack = await stale_ack_for(addr2, epoch1, last.version + 1000)
        assert ack.result == lease_pb2.LEASE_RESULT_STALE
        assert ack.stored_epoch == second.epoch

        # kill the engine's metrics server: a zero lease within two periods (versions)
        await procs.stop(engine, signal.SIGKILL)
        at_kill = await stored_version(admin)

        async def missing() -> Lease | None:
            lease = await stored(admin)
            ok = lease and lease.zero_reason is ZeroReason.TELEMETRY_MISSING
            return lease if ok else None

        zero = await eventually(missing, "a TELEMETRY_MISSING zero lease")
        assert zero.version <= at_kill + 2
        assert zero.epoch == second.epoch
