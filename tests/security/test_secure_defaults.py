"""Secure by default (issue 29): the broker listens on loopback unless told otherwise; beyond
loopback it must authenticate callers, and refuses bearer tokens over plaintext, unless
``--insecure`` (``auth.insecure``) says something else guards the port, which it then says
loudly: in its log at start and with every ``crossflowctl get nodes``."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest
import structlog

from crossflow_ctl.client import AdminClient
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.security import AuthSettings
from crossflow_ctl.service.config import BrokerSettings
from tests.security.conftest import Brokers, target

pytestmark = pytest.mark.timeout(60)


def test_the_broker_listens_on_loopback_by_default() -> None:
    assert BrokerSettings().listen == "127.0.0.1:50051"
    assert AuthSettings().insecure is False


async def test_anonymous_callers_beyond_loopback_are_refused_at_start(brokers: Brokers) -> None:
    with pytest.raises(ConfigError) as refused:
        await brokers.start(AuthSettings(), listen="0.0.0.0:0")
    assert refused.value.field == "auth.insecure"
    assert "--insecure" in str(refused.value) and "auth.tls.client_ca_file" in str(refused.value)
    # server TLS alone authenticates no one
    tls_only = brokers.tokens({"t": "admin/ops"}, tls=True).model_copy(update={"token_file": None})
    with pytest.raises(ConfigError):
        await brokers.start(tls_only, listen="0.0.0.0:0")
    brokers.servers.clear()


async def test_bearer_tokens_over_plaintext_beyond_loopback_are_refused(brokers: Brokers) -> None:
    with pytest.raises(ConfigError) as refused:
        await brokers.start(brokers.tokens({"t": "admin/ops"}), listen="0.0.0.0:0")
    assert refused.value.field == "auth.token_file" and "plaintext" in str(refused.value)
    brokers.servers.clear()
    # over TLS, or on loopback (a sidecar in the pod), they are fine and nothing is said
    for auth, listen in (
        (brokers.tokens({"t": "admin/ops"}, tls=True), "0.0.0.0:0"),
        (brokers.tokens({"t": "admin/ops"}), "127.0.0.1:0"),
    ):
        server = await brokers.start(auth, listen=listen)
        assert server.broker.warnings == ()


async def test_insecure_is_loud_in_the_log_and_in_list_nodes(brokers: Brokers) -> None:
    with structlog.testing.capture_logs() as logs:
        exposed = await brokers.start(AuthSettings(insecure=True), listen="0.0.0.0:0")
        plaintext_tokens = await brokers.start(
            brokers.tokens({"t": "admin/ops"}).model_copy(update={"insecure": True}),
            listen="0.0.0.0:0",
        )
        loopback = await brokers.start(AuthSettings(insecure=True))  # not needed: nothing said
    warned = [e for e in logs if e["event"] == "auth.insecure"]
    assert [e["log_level"] for e in warned] == ["warning", "warning"]
    assert "without authenticating callers" in warned[0]["message"]
    assert "bearer tokens cross plaintext" in warned[1]["message"]
    started = [e for e in logs if e["event"] == "broker.started"]
    assert [e["insecure"] for e in started] == [True, True, False]

    async with AdminClient(target(exposed), timeout_s=5) as admin:
        assert await admin.list_nodes() == []
        [warning] = admin.broker_warnings
        assert warning.startswith("INSECURE: ") and "0.0.0.0:0" in warning
    assert plaintext_tokens.broker.warnings and not loopback.broker.warnings
    async with AdminClient(target(loopback), timeout_s=5) as admin:
        await admin.list_nodes()
        assert admin.broker_warnings == ()


def _binary(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).exists():
        pytest.skip(f"{name} is not installed (pip install -e .)")
    return found


async def test_broker_process_needs_insecure_and_crossflowctl_shows_it(tmp_path: Path) -> None:
    broker = _binary("crossflow-broker")
    serve = [broker, "serve", "--listen", "0.0.0.0:0", "--embedded-store"]
    refused = await asyncio.create_subprocess_exec(
        *serve, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, said = await asyncio.wait_for(refused.communicate(), timeout=30)
    assert refused.returncode == 2, said
    assert b"auth.insecure" in said and b"--insecure" in said

    proc = await asyncio.create_subprocess_exec(
        *serve,
        "--insecure",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
        assert line.startswith("listening on "), line
        port = line.rsplit(":", 1)[1].strip()
        ctl = await asyncio.create_subprocess_exec(
            _binary("crossflowctl"),
            "--server",
            f"127.0.0.1:{port}",
            "get",
            "nodes",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"CROSSFLOWCTL_CONFIG": str(tmp_path / "ctl.yaml"), "PATH": ""},
        )
        out, err = await asyncio.wait_for(ctl.communicate(), timeout=30)
        assert ctl.returncode == 0, err
        assert err.decode().startswith("warning: INSECURE: the broker serves 0.0.0.0:0")
        assert out.decode() == "No resources found.\n"  # stdout is the listing alone
    finally:
        proc.terminate()
        _, logged = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert b'"auth.insecure"' in logged
