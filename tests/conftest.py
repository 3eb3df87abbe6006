"""Shared fixtures: a real Redis (started here when none answers) and per-test key namespaces.

Tests never flush a database: each test gets its own key prefix, so suites can share one Redis
(this machine's, CI's, or one started for the session) and run next to each other.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pytest
import redis
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

if TYPE_CHECKING:
    from redis.asyncio import Redis as AsyncRedis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    from crossflow_ctl.store.redis_store import RedisStore

pytest_plugins = ["tests.skip_guard"]

# No per-example deadline and no too-slow health check: on a loaded machine an example (a Redis
# round trip, a gRPC call) overran hypothesis' 200 ms default, or generation looked slow, and a
# sound property failed as DeadlineExceeded, Flaky or FailedHealthCheck. Tests never assert
# wall-clock times; pytest-timeout still bounds every test.
hypothesis_settings.register_profile(
    "crossflow", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
hypothesis_settings.load_profile("crossflow")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REPO_ROOT = Path(__file__).resolve().parent.parent
TRACE_SAMPLES = Path(__file__).resolve().parent / "data" / "traces"
"""Heads of public traces cut by scripts/cut_trace_samples.py (see the README there)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


T = TypeVar("T")

PATIENCE_S = 30.0
"""How long a test waits for background work to show: a hang guard, never a latency bound (a
loaded 2-core machine took over 2 s where a quiet one takes 20 ms)."""


async def eventually(
    check: Callable[[], Awaitable[T] | T],
    what: str,
    limit_s: float = PATIENCE_S,
    every_s: float = 0.01,
) -> T:
    """``check()`` (awaited if it gives an awaitable) until it gives something truthy, and return
    that; fail saying ``what`` (and the last value) after ``limit_s``. For work a test waits on
    in the background, in place of a fixed number of short sleeps, whose sum was a real-time
    deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return cast(T, value)
        if loop.time() > deadline:
            pytest.fail(f"{what}: not within {limit_s:g} s (last: {value!r})")
        await asyncio.sleep(every_s)


PATIENT_SOCKET_TIMEOUT_S = 30.0
PATIENT_OP_TIMEOUT_S = 60.0
"""Redis deadlines for tests that are not about them: a loaded machine (or a Redis busy with
another suite's work) can hold one reply past the store's production 1 s socket timeout, and a
test then failed with StoreUnavailable (Timeout reading from ...) for no fault of the code."""


def patient_redis_store(
    client: str | AsyncRedis | AsyncRedisCluster, namespace: str, **settings: Any
) -> RedisStore:
    """A RedisStore with generous socket and per-operation deadlines (overridable in
    ``settings``), for every test that is not about those deadlines. A client given as an
    object keeps its own socket timeout."""
    from crossflow_ctl.store.redis_store import RedisStore

    settings.setdefault("socket_timeout_s", PATIENT_SOCKET_TIMEOUT_S)
    settings.setdefault("op_timeout_s", PATIENT_OP_TIMEOUT_S)
    return RedisStore(client, namespace, **settings)


def _answers(url: str) -> bool:
    try:  # generous: a Redis slow to answer on a loaded machine is still there
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis that answers: $CROSSFLOW_TEST_REDIS_URL, 127.0.0.1:6379, or one started here."""
    url = os.environ.get("CROSSFLOW_TEST_REDIS_URL", DEFAULT_REDIS_URL)
    if _answers(url):
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(f"no Redis answers on {url} and redis-server is not installed")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            cwd=workdir,
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
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def redis_namespace(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    namespace = f"cft-{uuid.uuid4().hex[:12]}"
    yield namespace
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def _cluster_ok(port: int) -> bool:
    try:
        client = redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.cluster("info").get("cluster_state") == "ok")
        finally:
            client.close()
    except redis.RedisError:
        return False


def _distinct_free_ports(n: int) -> list[int]:
    """``n`` different free ports (two calls to :func:`free_port` may return the same one)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _start_cluster(server: str, cli: str, workdir: Path, procs: list[Any]) -> str:
    """Start 3 masters in ``workdir`` (appended to ``procs``) and join them; the URL of one, or
    RuntimeError saying which step failed (with the nodes' logs)."""
    ports = _distinct_free_ports(6)
    for port, bus in zip(ports[:3], ports[3:], strict=True):
        node_dir = workdir / str(port)
        node_dir.mkdir(parents=True)
        with (node_dir / "log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--cluster-enabled", "yes",
                     "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus)],
                    cwd=node_dir, stdout=log, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip

    def logs() -> str:
        return "\n".join(
            f"--- {p}: " + (workdir / str(p) / "log").read_text(errors="replace")[-600:]
            for p in ports[:3]
        )

    for port in ports[:3]:
        deadline = time.monotonic() + 10
        while not _answers(f"redis://127.0.0.1:{port}/0"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster node on port {port} did not start\n{logs()}")
            time.sleep(0.05)
    joined = subprocess.run(
        [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports[:3]),
         "--cluster-replicas", "0", "--cluster-yes"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60, check=False,
    )  # fmt: skip
    if joined.returncode != 0:
        out = joined.stdout.decode(errors="replace")[-800:]
        raise RuntimeError(f"redis-cli --cluster create failed: {out}\n{logs()}")
    deadline = time.monotonic() + 30
    while not all(_cluster_ok(p) for p in ports[:3]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Redis Cluster did not reach cluster_state:ok\n{logs()}")
        time.sleep(0.1)
    return f"redis://127.0.0.1:{ports[0]}/0"


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=10)
    procs.clear()


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A real 3-master Redis Cluster on loopback, started for the session and torn down after
    (``redis-server --cluster-enabled yes`` on free ports, each with its bus on its own free
    ``--cluster-port``, joined with ``redis-cli --cluster create``); the URL names one master
    (the client discovers the others). A start that fails (a free port taken in the meantime by
    another test's server) is retried on fresh ports, twice; the last failure fails the tests
    with the nodes' logs."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.skip("redis-server and redis-cli are needed to start a Redis Cluster")
    procs: list[Any] = []
    with tempfile.TemporaryDirectory() as workdir:
        try:
            failures: list[str] = []
            for attempt in range(3):
                try:
                    url = _start_cluster(server, cli, Path(workdir) / str(attempt), procs)
                    break
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    failures.append(str(exc))
                    _stop(procs)
            else:
                pytest.fail("could not start a Redis Cluster:\n" + "\n".join(failures))
            yield url
        finally:
            _stop(procs)


def delete_cluster_namespace(url: str, namespace: str) -> None:
    """Delete one namespace's keys from every master of the cluster at ``url``."""
    client = redis.RedisCluster.from_url(url)
    try:
        for node in client.get_primaries():
            keys = list(client.scan_iter(match=f"{namespace}*", count=1000, target_nodes=node))
            for key in keys:
                client.delete(key)
    finally:
        client.close()


@pytest.fixture(scope="session")
def mooncake_sample() -> Path:
    """The first 600 requests of the Mooncake conversation trace (jsonl with ``hash_ids``)."""
    return TRACE_SAMPLES / "mooncake_conversation_trace_head600.jsonl"


@pytest.fixture(scope="session")
def azure_conv_sample() -> Path:
    """The first 100 rows of the Azure 2023 chat trace (CSV, no prefix data)."""
    return TRACE_SAMPLES / "AzureLLMInferenceTrace_conv_head100.csv"


@pytest.fixture(scope="session")
def sessions_sample() -> Path:
    """The first 483 requests of the agentic session trace: 3 sessions and 2 sub-agents."""
    return TRACE_SAMPLES / "agent_sessions_sample_head483.jsonl"


@pytest.fixture(scope="session")
def full_traces_dir() -> Path:
    """$CROSSFLOW_TRACES_DIR, the folder of the full traces; tests that need it skip without it
    (mark them ``may_skip``: CI has no full traces). tests/data/traces/README.md says where to
    get them."""
    folder = os.environ.get("CROSSFLOW_TRACES_DIR", "")
    if not folder:
        pytest.skip("CROSSFLOW_TRACES_DIR is not set (see tests/data/traces/README.md)")
    if not Path(folder).is_dir():
        pytest.fail(f"CROSSFLOW_TRACES_DIR={folder} is not a folder")
    return Path(folder)
