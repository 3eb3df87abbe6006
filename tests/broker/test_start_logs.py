"""What a broker says at start: which store it uses (never its password), and what an
unreachable one means."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from crossflow_ctl.broker.__main__ import cli
from crossflow_ctl.broker.server import BrokerServer, describe_store, make_store
from crossflow_ctl.service.config import BrokerSettings


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (None, "embedded (in-process; one replica only, lost on exit)"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0, key prefix 'crossflow'"),
        ("redis://:pw@h:1/2", "redis://:***@h:1/2, key prefix 'crossflow'"),
        ("rediss://u:pw@r.svc:6380/0", "rediss://u:***@r.svc:6380/0, key prefix 'crossflow'"),
        ("redis://u@r:6379", "redis://u@r:6379, key prefix 'crossflow'"),
    ],
)
def test_the_store_is_described_without_its_password(url: str | None, said: str) -> None:
    assert describe_store(BrokerSettings(redis_url=url)) == said


async def test_an_unreachable_store_at_start_is_named_with_what_it_means() -> None:
    """It said only "redis ping failed: network:ConnectionError": not which Redis, nor that
    the broker serves on, failing closed; and broker.started did not say which store it used."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = BrokerSettings(
        listen="127.0.0.1:0", redis_url=f"redis://:secret@127.0.0.1:{port}/0", metrics_listen=None
    )
    server = BrokerServer(settings, make_store(settings))
    with capture_logs() as logs:
        await server.start()
        await server.stop(grace_s=0.1)
    events = {e["event"]: e for e in logs}
    where = f"redis://:***@127.0.0.1:{port}/0, key prefix 'crossflow'"
    unreachable = events["store.unreachable_at_start"]
    assert unreachable["store"] == where and "Admit answers NORMAL" in unreachable["effect"]
    assert events["broker.started"]["store"] == where
    assert "secret" not in repr(logs)


def test_serve_help_says_the_defaults_and_the_store_without_flags() -> None:
    """--help named no default, nor which store a broker with neither --redis-url nor
    --embedded-store uses."""
    out = " ".join(CliRunner().invoke(cli, ["serve", "--help"]).output.split())
    assert "default 127.0.0.1:50051" in out and "uses the embedded store" in out
