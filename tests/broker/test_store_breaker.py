"""Admission's circuit breaker on a real Redis that hangs (SIGSTOP) and comes back (SIGCONT).

A redis-server of this test's own, a broker over gRPC on it, a decode lease and a prefill pool
load so that Admit borrows. While Redis is stopped, Admits answer NORMAL: TIMEOUT for the first
few (each waits ``admit_timeout_ms``), then STORE_UNAVAILABLE from the open breaker, which makes
no admission store call at all and pings the store at most once per probe interval. Once Redis
answers again, a probe closes the breaker and Admit borrows again. Decisions and store calls are
asserted, never latencies.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision, Reason
from crossflow_ctl.domain.breaker import BreakerState
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.observability import BrokerMetrics, setup_metrics
from crossflow_ctl.service.config import BrokerSettings, StoreBreakerSettings
from crossflow_ctl.service.store_breaker import StoreBreaker
from crossflow_ctl.store.memory import MemoryStore
from crossflow_ctl.store.redis_store import RedisStore
from tests.broker.agents import FakeAgent
from tests.broker.conftest import TEST_POLICY, target
from tests.conftest import _answers, free_port
from tests.observability.test_metrics import scrape, value

ADMISSION_CALLS = ("admission_view", "try_debits_settled", "read_request", "record_request")
PROBE_INTERVAL_MS = 100


class CountingStore(RedisStore):
    """A RedisStore that counts admission's store calls and pings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()

    async def admission_view(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["admission_view"] += 1
        return await super().admission_view(*args, **kwargs)

    async def try_debits_settled(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["try_debits_settled"] += 1
        return await super().try_debits_settled(*args, **kwargs)

    async def read_request(self, key: str) -> str | None:
        self.calls["read_request"] += 1
        return await super().read_request(key)

    async def record_request(self, key: str, outcome: str, ttl_ms: int) -> str | None:
        self.calls["record_request"] += 1
        return await super().record_request(key, outcome, ttl_ms)

    async def ping(self) -> None:
        self.calls["ping"] += 1
        await super().ping()

    def admission_calls(self) -> int:
        return sum(self.calls[name] for name in ADMISSION_CALLS)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server of this test's own on a free port (the test stops and continues it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not _answers(url):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"redis-server did not start on port {port}")
        time.sleep(0.05)
    try:
        yield url, proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # a stopped process does not act on SIGTERM
        proc.terminate()
        proc.wait(timeout=10)


async def _lending(server: BrokerServer) -> list[FakeAgent]:
    decode = FakeAgent(target(server), "d1")
    prefill = FakeAgent(target(server), "p1", role=common_pb2.NODE_ROLE_PREFILL)
    for agent in (decode, prefill):
        await agent.connect()
    await prefill.send_pool_load(outstanding=10**6, ttl_ms=60_000)
    await prefill.sync()
    ack = await decode.send_lease(
        ttl_ms=60_000, credits={"compute_tokens": 10**6, "slots": 1_000, "output_tokens": 10**6}
    )
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED, ack
    return [decode, prefill]


@pytest.mark.redis
async def test_hung_redis_opens_the_breaker_and_its_return_closes_it(own_redis) -> None:
    url, redis_proc = own_redis
    settings = BrokerSettings(
        listen="127.0.0.1:0",
        redis_url=url,
        policy=TEST_POLICY.updated({"admit_timeout_ms": 50, "max_lease_ttl_ms": 60_000}),
        admin_timeout_ms=300,
        stream_grace_s=0.5,
        store_breaker=StoreBreakerSettings(
            failures_to_open=3, probe_interval_ms=PROBE_INTERVAL_MS, probe_timeout_ms=50
        ),
    )
    store = CountingStore(url, namespace="cft-breaker", socket_timeout_s=0.5, op_timeout_s=0.5)
    server = BrokerServer(settings, store)
    await server.start()
    agents: list[FakeAgent] = []
    breaker = server.broker.breaker
    try:
        agents = await _lending(server)
        async with AdmissionClient(target(server), timeout_s=5) as client:
            first = await client.admit(uncached_prompt_tokens=1_000, expected_output_tokens=10)
            assert first.decision is Decision.BORROW, first.message

            os.kill(redis_proc.pid, signal.SIGSTOP)
            hung = [await client.admit(uncached_prompt_tokens=1_000) for _ in range(3)]
            assert [a.reason for a in hung] == [Reason.TIMEOUT] * 3, hung
            assert breaker.state.state is not BreakerState.CLOSED

            # open: every Admit answers at once, no admission call reaches the store
            calls_before, started = store.admission_calls(), time.monotonic()
            pings_before = store.calls["ping"]
            while_open = []
            for _ in range(20):
                while_open.append(await client.admit(uncached_prompt_tokens=1_000))
                await asyncio.sleep(0.02)
            open_s = time.monotonic() - started
            for adm in while_open:
                assert adm.decision is Decision.NORMAL
                assert adm.reason is Reason.STORE_UNAVAILABLE, adm
                assert "circuit breaker is open" in adm.message
            assert store.admission_calls() == calls_before
            pings = store.calls["ping"] - pings_before
            assert 1 <= pings <= open_s * 1000 / PROBE_INTERVAL_MS + 2, (pings, open_s)
            assert breaker.answered >= len(while_open)

            # Redis answers again: a probe closes the breaker and Admit borrows
            os.kill(redis_proc.pid, signal.SIGCONT)
            after = None
            for _ in range(200):
                after = await client.admit(uncached_prompt_tokens=1_000, expected_output_tokens=10)
                if after.decision is Decision.BORROW:
                    break
                assert after.decision is Decision.NORMAL
                await asyncio.sleep(0.02)
            assert after is not None and after.decision is Decision.BORROW, after
            assert breaker.state.state is BreakerState.CLOSED
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)
        for agent in agents:
            await agent.close()
        await server.stop(grace_s=0.5)
    assert breaker._probe is None  # the probe ended with the outage: no task left behind


@pytest.mark.redis
async def test_disabled_breaker_waits_for_the_store_every_time(own_redis) -> None:
    url, redis_proc = own_redis
    settings = BrokerSettings(
        listen="127.0.0.1:0",
        redis_url=url,
        policy=TEST_POLICY.updated({"admit_timeout_ms": 50, "max_lease_ttl_ms": 60_000}),
        admin_timeout_ms=300,
        stream_grace_s=0.5,
        store_breaker=StoreBreakerSettings(enabled=False),
    )
    store = CountingStore(url, namespace="cft-breaker-off", socket_timeout_s=0.5)
    server = BrokerServer(settings, store)
    await server.start()
    agents: list[FakeAgent] = []
    try:
        agents = await _lending(server)
        async with AdmissionClient(target(server), timeout_s=5) as client:
            os.kill(redis_proc.pid, signal.SIGSTOP)
            answers = [await client.admit(uncached_prompt_tokens=1_000) for _ in range(6)]
            assert [a.reason for a in answers] == [Reason.TIMEOUT] * 6
            assert server.broker.breaker.allows
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)
        for agent in agents:
            await agent.close()
        await server.stop(grace_s=0.5)


async def _until(condition: Callable[[], bool], limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class FlakyStore(MemoryStore):
    """Pings fail until ``up`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.up = asyncio.Event()
        self.pings = 0

    async def ping(self) -> None:
        self.pings += 1
        if not self.up.is_set():
            raise StoreUnavailable("ping: connection refused")


async def test_breaker_state_is_a_metric_and_the_probe_closes_it() -> None:
    endpoint = await setup_metrics("127.0.0.1", 0, set_global=False)
    store = FlakyStore()
    breaker = StoreBreaker(
        store,
        SystemClock(),
        StoreBreakerSettings(failures_to_open=2, probe_interval_ms=10),
        BrokerMetrics(endpoint.meter_provider),
    )
    state = "crossflow_broker_store_breaker_state"
    try:
        assert value(await scrape(endpoint), state) == 0
        breaker.failed("store slower than 50 ms")
        assert breaker.allows
        breaker.failed("store slower than 50 ms")
        assert not breaker.allows
        assert breaker.refused(2) == [breaker.answer] * 2
        assert breaker.answer.reason is Reason.STORE_UNAVAILABLE
        samples = await scrape(endpoint)
        assert value(samples, state) in (1, 2)  # open, or probing
        assert value(samples, "crossflow_broker_store_breaker_opens_total") == 1
        await _until(lambda: store.pings >= 3)
        assert not breaker.allows
        store.up.set()
        await _until(lambda: breaker.allows)
        assert value(await scrape(endpoint), state) == 0
        await _until(lambda: breaker._probe is None)  # the probe ends once the breaker closes
    finally:
        await breaker.close()
        await endpoint.close()
