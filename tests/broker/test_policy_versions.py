"""Issue 12: a live policy change survives a Redis restart, and concurrent policy writes are
compare-and-set on a resource version (ABORTED on a lost race, nothing changed)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
import redis

from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdminClient
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.errors import Aborted
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_store import RedisStore
from tests.broker.conftest import TEST_POLICY, target
from tests.conftest import free_port


class RedisProcess:
    """A redis-server of this test's own, with no persistence: a restart loses everything."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            cwd=self._dir.name,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=0.5)
        for _ in range(200):
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self._proc.poll() is not None:
                pytest.fail("redis-server exited at start")
            time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    proc.start()
    try:
        yield proc
    finally:
        proc.close()


async def _policy_when(admin: AdminClient, check, timeout_s: float = 10.0):
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                current = await admin.get_policy()
                if check(current):
                    return current
            except Exception:  # the store is restarting: the broker answers UNAVAILABLE
                pass
            await asyncio.sleep(0.05)


async def test_a_live_policy_change_survives_a_redis_restart(own_redis: RedisProcess) -> None:
    settings = BrokerSettings(
        listen="127.0.0.1:0", policy=TEST_POLICY, policy_refresh_ms=50, stream_grace_s=0.5
    )
    store = RedisStore(own_redis.url, namespace="cfpol", socket_timeout_s=0.3)
    server = BrokerServer(settings, store, SystemClock())
    await server.start()
    try:
        async with AdminClient(target(server)) as admin:
            seeded = await admin.get_policy()
            assert seeded.version == 1 and seeded.policy == TEST_POLICY
            live = await admin.set_policy({"shadow_mode": True, "borrow_share": 0.1})
            assert live.version == 2
            own_redis.stop()
            own_redis.start()  # empty: the store lost the policy
            restored = await _policy_when(admin, lambda p: p.version >= 2)
            assert restored == live  # the live change, not the startup default
            raw = redis.Redis.from_url(own_redis.url).hgetall(Keys("cfpol").policy)
            assert int(raw[b"version"]) == 2 and b'"shadow_mode":true' in raw[b"json"]
            assert server.broker.policy.shadow_mode and server.broker.policy.borrow_share == 0.1
    finally:
        await server.stop(grace_s=0.5)


async def test_concurrent_policy_writes_are_compare_and_set(cluster) -> None:
    server = await cluster.start()
    async with AdminClient(target(server)) as one, AdminClient(target(server)) as two:
        base = await one.get_policy()
        assert (await two.get_policy()).version == base.version
        first = await one.set_policy({"borrow_share": 0.3}, expected_version=base.version)
        assert first.version == base.version + 1
        with pytest.raises(Aborted) as lost:
            await two.set_policy({"borrow_share": 0.9}, expected_version=base.version)
        assert "version" in str(lost.value)
        assert await one.get_policy() == first
        # Without an expected version a write applies on top of whatever is stored.
        last = await two.set_policy({"hold_ttl_ms": 1_500})
        assert last.version == first.version + 1
        assert (last.policy.borrow_share, last.policy.hold_ttl_ms) == (0.3, 1_500)


async def test_a_write_that_changes_nothing_keeps_the_version(cluster) -> None:
    server = await cluster.start()
    async with AdminClient(target(server)) as admin:
        base = await admin.set_policy({"borrow_share": 0.3})
        same = await admin.set_policy({"borrow_share": "0.3"}, expected_version=base.version)
        assert same == base  # no new version: agents are pushed nothing, watchers see no change
        assert await admin.get_policy() == base
        with pytest.raises(Aborted):  # a stale expected version is still refused
            await admin.set_policy({"borrow_share": 0.3}, expected_version=base.version - 1)
