"""The server's lifecycle: health and reflection, staged shutdown that ends agent streams and
leaks no task, and a real ``crossflow-broker serve`` process on Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.domain.admission import Decision
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.broker.agents import FakeAgent
from tests.broker.conftest import TEST_POLICY, target


async def test_health_reflection_and_staged_shutdown_leak_nothing() -> None:
    before = set(asyncio.all_tasks())
    settings = BrokerSettings(listen="127.0.0.1:0", policy=TEST_POLICY, stream_grace_s=2.0)
    server = BrokerServer(settings, MemoryStore())
    await server.start()
    assert server.supervisor.tasks, "the policy refresher runs under the supervisor"
    agent = FakeAgent(target(server), "d1")
    async with grpc.aio.insecure_channel(target(server)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "crossflow.v1.AdmissionService", "crossflow.v1.LeaseService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        listed = await call.read()
        await call.done_writing()
        names = {s.name for s in listed.list_services_response.service}
        assert {"crossflow.v1.AdminService", "grpc.health.v1.Health"} <= names

        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await agent.connect()
        assert (await agent.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
        assert len(server.streams) == 1

        stopping = asyncio.create_task(server.stop())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        await stopping
    await agent.close()
    assert agent.ended == grpc.StatusCode.OK, "shutdown ends agent streams cleanly"
    assert len(server.streams) == 0 and not server.supervisor.tasks
    leaked = await _outliving(before)
    assert not leaked, leaked


async def _outliving(before: set[asyncio.Task[Any]], patience_s: float = 5.0) -> list[Any]:
    """Tasks started since ``before`` that are still alive after ``patience_s``.

    A cancelled call's task (a Watch, the agent's reader) ends a few loop turns after its
    cancel, and on a loaded machine those turns can come late: only a task that never ends
    is a leak."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    while True:
        alive = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()]
        if not alive or loop.time() >= deadline:
            return alive
        await asyncio.sleep(0.01)


async def test_streams_that_half_close_then_cancel_leave_the_registry() -> None:
    """An agent closing its stream half-closes and then cancels. The handler's clean-up can be
    cancelled again by gRPC while it waits for the stream's tasks: it must still leave the
    registry (else shutdown waits out the whole grace and the open-streams gauge drifts)."""
    settings = BrokerSettings(listen="127.0.0.1:0", policy=TEST_POLICY, stream_grace_s=3.0)
    server = BrokerServer(settings, MemoryStore())
    await server.start()
    agents = [FakeAgent(target(server), f"d{i}") for i in range(16)]
    for agent in agents:
        await agent.connect()
        await agent.send_lease()
    assert len(server.streams) == len(agents)
    await asyncio.gather(*(agent.close() for agent in agents))
    await server.stop()
    assert len(server.streams) == 0, "every closed stream left the registry"


def _spawn(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "crossflow_ctl.broker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


async def _listening(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=30)
    assert line.startswith("listening on "), (line, proc.stderr.read() if proc.stderr else "")
    return line.split()[-1]


@pytest.mark.slow
async def test_real_broker_process_on_redis(redis_url, redis_namespace, tmp_path: Path) -> None:
    config = tmp_path / "broker.yaml"
    config.write_text("policy:\n  borrow_share: 1.0\nlog_json: true\n")
    proc = _spawn(
        [
            "serve",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:0",
            "--redis-url",
            redis_url,
            "--redis-namespace",
            redis_namespace,
        ],
        {"CROSSFLOW_POLICY__HOLD_TTL_MS": "5000"},
    )
    try:
        addr = await _listening(proc)
        agent = FakeAgent(addr, "d1")
        prefill = FakeAgent(addr, "p1", role=common_pb2.NODE_ROLE_PREFILL)
        await agent.connect()
        await prefill.connect()
        try:
            await prefill.send_pool_load()
            await prefill.sync()
            assert (await agent.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
            async with AdmissionClient(addr, timeout_s=5) as client, AdminClient(addr) as admin:
                policy = (await admin.get_policy()).policy
                assert policy.borrow_share == 1.0 and policy.hold_ttl_ms == 5000
                adm = await client.admit(uncached_prompt_tokens=500)
                assert adm.decision is Decision.BORROW, adm.message
                await client.commit(adm.reservation_id)
                await agent.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_COMMIT)
                await client.release(adm.reservation_id)
                await agent.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_RELEASE)
        finally:
            await agent.close()
            await prefill.close()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        assert code == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


async def test_bad_config_exits_2_naming_the_field() -> None:
    proc = _spawn(["serve", "--listen", "127.0.0.1:0"], {"CROSSFLOW_POLICY__BORROW_SHARE": "7"})
    _out, err = await asyncio.to_thread(proc.communicate, None, 30)
    assert proc.returncode == 2
    assert "policy.borrow_share" in err
