"""Shared fixtures: a real Redis (started here when none answers) and per-test key namespaces.

Tests never flush a database: each test gets its own key prefix, so suites can share one Redis
(this machine's, CI's, or one started for the session) and run next to each other.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

pytest_plugins = ["tests.skip_guard"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = REPO_ROOT.parent / "shared" / "traces"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
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


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """../shared/traces next to the checkout; tests that need it skip when it is missing."""
    if not TRACES_DIR.is_dir():
        pytest.skip(f"trace folder {TRACES_DIR} is missing (see ../shared/traces/README.md)")
    return TRACES_DIR
