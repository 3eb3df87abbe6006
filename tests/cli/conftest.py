"""CLI fixtures: a real broker process on a loopback port 0, fake agents on its lease streams,
and a runner for the real ``crossflowctl`` binary with its own contexts file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from crossflow_ctl.api.v1 import common_pb2
from tests.broker.agents import FakeAgent


def _binary(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).exists():
        pytest.skip(f"{name} is not installed (pip install -e .)")
    return found


@pytest.fixture
def broker_address() -> Iterator[str]:
    """``crossflow-broker serve`` on 127.0.0.1:0 with the embedded store; its bound address."""
    proc = subprocess.Popen(
        [_binary("crossflow-broker"), "serve", "--listen", "127.0.0.1:0", "--embedded-store"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), f"broker said {line!r}"
        yield line.removeprefix("listening on ").strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass
class Result:
    rc: int
    out: str
    err: str


class Ctl:
    """Runs the real crossflowctl binary; its config file lives in the test's tmp dir."""

    def __init__(self, server: str, config: Path) -> None:
        self.server = server
        self.binary = _binary("crossflowctl")
        self.env = {**os.environ, "CROSSFLOWCTL_CONFIG": str(config)}
        self.env.pop("CROSSFLOWCTL_SERVER", None)

    async def start(
        self, *args: str, server: bool = True, env: dict[str, str] | None = None
    ) -> asyncio.subprocess.Process:
        argv = [self.binary, *(["--server", self.server] if server else []), *args]
        return await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**self.env, **(env or {})},
        )

    async def __call__(
        self,
        *args: str,
        server: bool = True,
        timeout_s: float = 30,
        env: dict[str, str] | None = None,
    ) -> Result:
        proc = await self.start(*args, server=server, env=env)
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        return Result(proc.returncode, out.decode(), err.decode())


@pytest.fixture
def ctl(broker_address: str, tmp_path: Path) -> Ctl:
    return Ctl(broker_address, tmp_path / "crossflow" / "config.yaml")


@dataclass
class Fleet:
    decode: list[FakeAgent]
    prefill: FakeAgent


@pytest.fixture
async def fleet(broker_address: str) -> AsyncIterator[Fleet]:
    """Two decode agents (zone=a, zone=b) refreshing leases and one busy prefill agent."""
    decode = [
        FakeAgent(broker_address, "decode-1", labels={"zone": "a"}),
        FakeAgent(broker_address, "decode-2", labels={"zone": "b"}),
    ]
    prefill = FakeAgent(broker_address, "prefill-1", role=common_pb2.NODE_ROLE_PREFILL)
    for agent in [*decode, prefill]:
        await agent.connect()

    async def refresh() -> None:
        while True:
            for agent in decode:
                await agent.send_lease()
            await prefill.send_pool_load(outstanding=200_000, rate_tps=20_000.0)
            await prefill.sync()
            await asyncio.sleep(0.3)

    for agent in decode:
        await agent.send_lease()
    await prefill.send_pool_load(outstanding=200_000, rate_tps=20_000.0)
    await prefill.sync()
    task = asyncio.create_task(refresh())
    try:
        yield Fleet(decode, prefill)
    finally:
        task.cancel()
        # Cleanup only: a refresher that died (e.g. a stream the broker ended) already made
        # the test see stale leases; teardown must still close every stream.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        for agent in [*decode, prefill]:
            await agent.close()
