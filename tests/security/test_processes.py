"""The real processes with mutual TLS: a broker that requires it (settings from the
environment), agent processes with their node certificates (flags), crossflowctl with an admin's
and a router's certificate (global flags). Certificates are made by the test."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.test_e2e import Procs, eventually
from tests.security.pki import Pair, TestCA

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        await p.close()


def _ctl_binary() -> str:
    found = shutil.which("crossflowctl") or str(Path(sys.executable).with_name("crossflowctl"))
    if not Path(found).exists():
        pytest.skip("crossflowctl is not installed (pip install -e .)")
    return found


async def ctl(ca: TestCA, pair: Pair | None, address: str, *args: str) -> tuple[int, str, str]:
    tls = ["--ca-file", str(ca.cert), "--server-name", "localhost"]
    if pair is not None:
        tls += ["--cert-file", str(pair.cert), "--key-file", str(pair.key)]
    env = {**os.environ, "CROSSFLOWCTL_CONFIG": str(ca.dir / "ctl.yaml")}
    env.pop("CROSSFLOWCTL_SERVER", None)
    proc = await asyncio.create_subprocess_exec(
        _ctl_binary(),
        "--server",
        address,
        *tls,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    return int(proc.returncode or 0), out.decode(), err.decode()


def agent_args(node_id: str, address: str, ca: TestCA, pair: Pair) -> tuple[str, ...]:
    return (
        "crossflow_agent",
        "run",
        "--node-id",
        node_id,
        "--source",
        "synthetic",
        "--broker",
        address,
        "--ca-file",
        str(ca.cert),
        "--cert-file",
        str(pair.cert),
        "--key-file",
        str(pair.key),
        "--server-name",
        "localhost",
        "--period-ms",
        "100",
        "--log-text",
    )


async def test_mtls_broker_agents_and_crossflowctl_processes(procs: Procs, tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "pki")
    server = ca.server()
    env = {
        "CROSSFLOW_AUTH__REQUIRED": "true",
        "CROSSFLOW_AUTH__TLS__CERT_FILE": str(server.cert),
        "CROSSFLOW_AUTH__TLS__KEY_FILE": str(server.key),
        "CROSSFLOW_AUTH__TLS__CLIENT_CA_FILE": str(ca.cert),
    }
    _, address = await procs.spawn(
        "broker",
        "listening on",
        "crossflow_ctl.broker",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--embedded-store",
        **env,
    )
    d1 = ca.client("node", "d1")
    fast: dict[str, Any] = {"CROSSFLOW_AGENT_BACKOFF_MAX_MS": "300"}
    await procs.spawn("agent-d1", "", *agent_args("d1", address, ca, d1), **fast)
    # d1's certificate used by an agent claiming to be d2: refused at Hello, every retry.
    await procs.spawn("agent-d2", "", *agent_args("d2", address, ca, d1), **fast)
    admin = ca.client("admin", "ops")

    async def nodes() -> list[dict[str, Any]]:
        rc, out, err = await ctl(ca, admin, address, "get", "nodes", "-o", "json")
        assert rc == 0, err
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items

    async def d1_leasing() -> bool:
        return any(n["name"] == "d1" and n["compute_tokens"] > 0 for n in await nodes())

    await eventually(d1_leasing, "d1's lease over mTLS", limit_s=60)
    assert [n["name"] for n in await nodes()] == ["d1"]

    router = ca.client("router", "r1")
    rc, _, err = await ctl(ca, router, address, "cordon", "d1")
    assert rc == 6, err
    assert "PERMISSION_DENIED" in err or "may not call" in err
    rc, _, err = await ctl(ca, None, address, "get", "nodes")  # no client certificate
    assert rc == 4, err
    # it asked "is a broker serving there?" of a broker that was, and refused the handshake;
    # it says what the broker wants, in one line (gRPC's C core logged the handshake too)
    assert "needs --cert-file and --key-file" in err and "is a broker serving" not in err, err
    assert len(err.splitlines()) == 1, err
    other = TestCA(tmp_path / "other-pki", name="other-ca")
    rc, _, err = await ctl(other, admin, address, "get", "nodes")  # a CA that is not the broker's
    assert rc == 4 and "the TLS handshake failed" in err and len(err.splitlines()) == 1, err
    assert [n["cordoned"] for n in await nodes()] == [False]
    assert "PERMISSION_DENIED" in (tmp_path / "agent-d2.log").read_text()


async def _ctl_plain(config: Path, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "CROSSFLOWCTL_CONFIG": str(config)}
    env.pop("CROSSFLOWCTL_SERVER", None)
    proc = await asyncio.create_subprocess_exec(
        _ctl_binary(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    return int(proc.returncode or 0), out.decode(), err.decode()


async def test_crossflowctl_context_keeps_a_token_and_tls_settings(
    brokers: Any, tmp_path: Path
) -> None:
    """A context made with set-context carries the token (and TLS files) to every command."""
    from tests.security.conftest import target

    server = await brokers.start(brokers.tokens({"admin-token": "admin/ops"}, tls=True))
    address = target(server)
    config = tmp_path / "ctl.yaml"
    token = tmp_path / "admin.token"
    token.write_text("admin-token\n")
    rc, _, err = await _ctl_plain(
        config,
        "config",
        "set-context",
        "prod",
        "--server",
        address,
        "--ca-file",
        str(brokers.ca.cert),
        "--server-name",
        "localhost",
        "--token-file",
        str(token),
        "--use",
    )
    assert rc == 0, err
    rc, out, err = await _ctl_plain(config, "get", "nodes", "-o", "json")
    assert rc == 0, err
    assert json.loads(out)["items"] == []
    wrong = tmp_path / "wrong.token"
    wrong.write_text("guessed\n")
    rc, _, err = await _ctl_plain(config, "--token-file", str(wrong), "get", "nodes")
    assert rc == 6, err  # the flag overrides the context's token; the broker refuses it
    assert "unknown bearer token" in err
    # it said only the broker's words, then "give --token-file FILE" of a token given: it now
    # says the identity given was refused, naming it
    assert f"refused the identity given (--token-file {wrong})" in err, err
