"""``crossflow-broker serve --workers N``: worker processes sharing one port, supervised, with
one merged /metrics; and how many workers a setting (or the pod's CPUs) asks for."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
from prometheus_client.parser import text_string_to_metric_families

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.broker.workers import available_cpus, cgroup_cpus, worker_count
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.service.config import BrokerSettings
from tests.broker.agents import FakeAgent
from tests.conftest import free_port


def _children(pid: int) -> set[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(p) for p in text.split()}


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait for ``check()`` to be true (polled), failing with ``what`` after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not check():  # noqa: ASYNC110 - polling other processes
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(what) from None


def _spawn(args: list[str], env: dict[str, str], log: IO[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "crossflow_ctl.broker", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )


def _worker_pids(log_file: Path) -> dict[int, int]:
    """Each worker's latest pid, from the supervisor's ``broker.worker_started`` lines."""
    out: dict[int, int] = {}
    for line in log_file.read_text().splitlines():
        if '"broker.worker_started"' in line:
            event = json.loads(line)
            out[event["worker"]] = event["pid"]
    return out


def _by_worker(port: int, sample: str) -> dict[str, float]:
    """``sample``'s values on the supervisor's /metrics, summed per ``worker`` label."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample:
                out[s.labels["worker"]] = out.get(s.labels["worker"], 0.0) + s.value
    return out


@pytest.mark.slow
async def test_two_workers_share_the_port_and_a_killed_one_is_restarted(
    redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    metrics_port = free_port()
    log_file = tmp_path / "broker.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CROSSFLOW_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
        "CROSSFLOW_POLICY__BORROW_SHARE": "1.0",
    }
    args = ["serve", "--listen", "127.0.0.1:0", "--redis-url", redis_url]
    args += ["--redis-namespace", redis_namespace, "--workers", "2"]
    with log_file.open("w") as log:
        proc = _spawn(args, env, log)
    agents: list[FakeAgent] = []
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=60)
        assert line.startswith("listening on "), (line, log_file.read_text())
        addr = line.split()[-1]
        workers = _children(proc.pid)
        assert len(workers) == 2

        # New connections land on either worker (the kernel spreads them): open streams until
        # both workers have answered one (each names itself in its Welcome).
        seen: set[str] = set()
        while len(seen) < 2:
            assert len(agents) < 64, f"every stream reached one worker: {seen}"
            agent = FakeAgent(addr, f"d{len(agents)}", own_connection=True)
            agents.append(agent)
            welcome = await agent.connect()
            seen.add(welcome.broker_id)
            assert (await agent.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
        leased = len(agents)  # one lease each
        prefill = FakeAgent(addr, "p1", role=common_pb2.NODE_ROLE_PREFILL)
        agents.append(prefill)
        await prefill.connect()
        await prefill.send_pool_load()
        await prefill.sync()
        async with AdmissionClient(addr, timeout_s=10) as client:
            adm = await client.admit(uncached_prompt_tokens=500)
            assert adm.decision is Decision.BORROW, adm.message
            await client.release(adm.reservation_id)

        # one /metrics for the pod: each worker's series, labelled with the worker
        leases = _by_worker(metrics_port, "crossflow_broker_leases_received_total")
        assert set(leases) == {"0", "1"} and sum(leases.values()) == leased
        assert _by_worker(metrics_port, "crossflow_broker_worker_restarts_total") == {
            "0": 0.0,
            "1": 0.0,
        }

        pids = _worker_pids(log_file)
        assert set(pids.values()) == workers
        os.kill(pids[0], signal.SIGKILL)
        victim = pids[0]
        await _until(
            "the killed worker is replaced",
            lambda: victim not in _children(proc.pid) and len(_children(proc.pid)) == 2,
        )
        assert '"broker.worker_exited"' in log_file.read_text()
        assert _worker_pids(log_file)[0] != victim
        # Admits go on through the shared port (a fresh connection: the old one may have
        # been the killed worker's).
        async with AdmissionClient(addr, timeout_s=10) as client:
            for _ in range(4):
                adm = await client.admit(uncached_prompt_tokens=500)
                assert adm.decision is Decision.BORROW, adm.message
                await client.release(adm.reservation_id)
        restarts = {"0": 1.0, "1": 0.0}
        await _until(
            "the restart is counted",
            lambda: _by_worker(metrics_port, "crossflow_broker_worker_restarts_total") == restarts,
        )
    finally:
        for agent in agents:
            await agent.close()
        if proc.poll() is None:
            survivors = _children(proc.pid)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 60)
            assert code == 0, log_file.read_text()[-2000:]
            await _until(
                "the workers exit with it",
                lambda: not any(Path(f"/proc/{pid}").exists() for pid in survivors),
            )
        if proc.stdout:
            proc.stdout.close()


def test_worker_count_follows_the_setting_or_the_cpus() -> None:
    redis = "redis://127.0.0.1:1/0"
    assert worker_count(BrokerSettings(redis_url=redis, workers=3)) == 3
    assert worker_count(BrokerSettings(redis_url=redis)) == available_cpus()
    assert worker_count(BrokerSettings()) == 1  # the embedded store: one process
    with pytest.raises(ConfigError) as refused:
        worker_count(BrokerSettings(workers=2))
    assert refused.value.field == "workers"


def test_cgroup_quota_caps_the_cpus(tmp_path: Path) -> None:
    assert cgroup_cpus(tmp_path) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpus(tmp_path) == 2  # 1.5 CPUs round up
    assert available_cpus(tmp_path) == min(2, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpus(tmp_path) == 3


async def test_a_port_the_workers_cannot_bind_stops_the_broker_with_a_usage_error(
    tmp_path: Path,
) -> None:
    """A worker that fails on a setting before it serves is not restarted forever: the broker
    exits 2 naming the setting, as a lone broker does."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--listen", f"127.0.0.1:{port}", "--redis-url", "redis://127.0.0.1:1/0"]
        with (tmp_path / "broker.log").open("w") as log:
            proc = _spawn([*args, "--workers", "2"], {**os.environ}, log)
        code = await asyncio.to_thread(proc.wait, 120)
    if proc.stdout:
        proc.stdout.close()
    text = (tmp_path / "broker.log").read_text()
    assert code == 2, text[-2000:]
    assert "listen: cannot listen on" in text
    assert '"stopping the broker"' in text
