"""Redis AUTH and TLS through the broker's settings, against redis-server processes started here
(``requirepass``; and ``--tls-port`` with certificates made by the test, when redis-server was
built with TLS). Refused credentials stop the broker's start with an error naming redis_url."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from crossflow_ctl.broker.server import BrokerServer, make_store
from crossflow_ctl.client import AdminClient
from crossflow_ctl.domain.errors import ConfigError, StoreUnavailable
from crossflow_ctl.service.config import BrokerSettings
from tests.broker.agents import FakeAgent
from tests.conftest import free_port
from tests.security.pki import TestCA

pytestmark = pytest.mark.timeout(60)
PASSWORD = "s3cret-for-this-test"


def _wait_ready(client: redis.Redis, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {log.read_text(errors='replace')}")
        try:
            client.ping()
            return
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not answer")


def _start(args: list[str], client: redis.Redis, workdir: Path) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    log = workdir / f"redis-{len(list(workdir.glob('redis-*.log')))}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, "--save", "", "--appendonly", "no", "--dir", str(workdir), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_ready(client, proc, log)
    except RuntimeError:
        proc.kill()
        raise
    return proc


@pytest.fixture
def auth_redis(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    client = redis.Redis(port=port, password=PASSWORD, socket_timeout=0.5)
    proc = _start(["--port", str(port), "--requirepass", PASSWORD], client, tmp_path)
    try:
        yield port
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def _tls_supported() -> bool:
    binary = shutil.which("redis-server")
    if binary is None:
        return False
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, check=False)
    return "tls" in (out.stdout + out.stderr).lower() or _probe_tls(binary)


def _probe_tls(binary: str) -> bool:
    out = subprocess.run(
        [binary, "--tls-port", "0", "--port", "0", "--test-memory", "1"],
        capture_output=True,
        text=True,
        check=False,
    )
    return "not supported" not in (out.stdout + out.stderr).lower()


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, TestCA]]:
    ca = TestCA(tmp_path / "redis-pki")
    pair = ca.server()
    port = free_port()
    client = redis.Redis(
        port=port,
        password=PASSWORD,
        ssl=True,
        ssl_ca_certs=str(ca.cert),
        ssl_cert_reqs="required",
        socket_timeout=0.5,
    )
    args = ["--port", "0", "--tls-port", str(port), "--requirepass", PASSWORD]
    args += ["--tls-cert-file", str(pair.cert), "--tls-key-file", str(pair.key)]
    args += ["--tls-ca-cert-file", str(ca.cert), "--tls-auth-clients", "no"]
    try:
        proc = _start(args, client, tmp_path)
    except RuntimeError as exc:
        if "tls" in str(exc).lower() or not _tls_supported():
            pytest.skip(f"redis-server was built without TLS: {exc}")
        raise
    try:
        yield port, ca
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


async def _broker(**settings: Any) -> BrokerServer:
    cfg = BrokerSettings(listen="127.0.0.1:0", redis_namespace="h12a-auth", **settings)
    server = BrokerServer(cfg, make_store(cfg))
    await server.start()
    return server


async def _works(server: BrokerServer) -> None:
    """A node registers through the broker and an admin reads it back from Redis."""
    agent = FakeAgent(f"127.0.0.1:{server.port}", "d1")
    try:
        await agent.connect()
        await agent.send_lease()
        async with AdminClient(f"127.0.0.1:{server.port}") as admin:
            assert [n.state.info.node_id for n in await admin.list_nodes()] == ["d1"]
    finally:
        await agent.close()
        await server.stop(grace_s=0.5)


async def test_password_file_and_url_password_work(auth_redis: int, tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    await _works(
        await _broker(redis_url=f"redis://127.0.0.1:{auth_redis}/0", redis_password_file=secret)
    )
    await _works(await _broker(redis_url=f"redis://:{PASSWORD}@127.0.0.1:{auth_redis}/1"))


@pytest.mark.parametrize("password", ["wrong", None], ids=["wrong-password", "no-password"])
async def test_refused_credentials_fail_closed_at_start(
    auth_redis: int, tmp_path: Path, password: str | None
) -> None:
    extra: dict[str, Any] = {}
    if password is not None:
        secret = tmp_path / "redis-password"
        secret.write_text(password)
        extra["redis_password_file"] = secret
    with pytest.raises(ConfigError) as refused:
        await _broker(redis_url=f"redis://127.0.0.1:{auth_redis}/0", **extra)
    assert refused.value.field == "redis_url"
    assert "redis refused the credentials" in str(refused.value)


async def test_broker_process_exits_2_on_a_wrong_password(auth_redis: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        "python3",
        "-m",
        "crossflow_ctl.broker",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--redis-url",
        f"redis://:wrong@127.0.0.1:{auth_redis}/0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    assert proc.returncode == 2, (out, err)
    assert b"redis_url: redis refused the credentials" in err
    assert b"listening on" not in out


async def test_rediss_with_a_ca_file(tls_redis: tuple[int, TestCA], tmp_path: Path) -> None:
    port, ca = tls_redis
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD)
    url = f"rediss://localhost:{port}/0"
    await _works(await _broker(redis_url=url, redis_password_file=secret, redis_ca_file=ca.cert))
    # Another CA's bundle: the server's certificate is refused; admission would fail closed.
    other = TestCA(tmp_path / "other", name="other-ca")
    cfg = BrokerSettings(redis_url=url, redis_password_file=secret, redis_ca_file=other.cert)
    store = make_store(cfg)
    with pytest.raises(StoreUnavailable, match="redis ping failed"):
        await store.ping()
    await store.close()


def test_a_ca_file_needs_rediss() -> None:
    with pytest.raises(ValueError, match="redis_ca_file needs a rediss://"):
        BrokerSettings(redis_url="redis://127.0.0.1:6379/0", redis_ca_file=Path("/ca.pem"))
