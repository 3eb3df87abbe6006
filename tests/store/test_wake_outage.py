"""A Redis outage seen by the notice-wake subscription: one warning when it starts, one line when
it ends, and no agent stream's log fields on either (the subscription serves every stream)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import pytest
import structlog
from redis.asyncio import Redis
from structlog.contextvars import bound_contextvars, merge_contextvars
from structlog.testing import capture_logs

from crossflow_ctl.store.redis_notices import WakeHub
from tests.conftest import free_port


def _start_redis(port: int, workdir: str) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is needed to end the outage")
    return subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def workdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as path:
        yield path


async def _until(condition: Callable[[], bool]) -> None:
    """Poll the hub's state (it has no event to wait on); 30 s is a hang guard, not a latency
    assertion."""
    async with asyncio.timeout(30):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_an_outage_warns_once_names_no_stream_and_says_when_it_ended(workdir: str) -> None:
    port = free_port()  # nothing listens here until the outage ends
    client = Redis(port=port, socket_connect_timeout=0.5, socket_timeout=2.0)
    hub = WakeHub(client, "cft-wakes")
    proc = None
    try:
        with capture_logs(processors=[merge_contextvars]) as logs:
            with bound_contextvars(node_id="d1"):  # as an agent stream's relay does
                hub.signal("d1")
            await _until(lambda: hub._failed_tries >= 1)
            broken = [e for e in logs if e["event"] == "notice_wakes.broken"]
            assert len(broken) == 1, broken  # the retries log at debug only
            assert "node_id" not in broken[0]
            assert broken[0]["log_level"] == "warning"

            proc = _start_redis(port, workdir)
            await _until(lambda: hub.live)
            restored = [e for e in logs if e["event"] == "notice_wakes.restored"]
            assert len(restored) == 1
            assert restored[0]["failed_retries"] >= 1
            assert "node_id" not in restored[0]
    finally:
        await hub.close()
        await client.aclose()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    structlog.contextvars.clear_contextvars()


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decode_responses"])
async def test_a_quiet_subscription_stays_up_on_pongs_and_wakes_its_node(
    redis_url: str,
    redis_namespace: str,
    decode: bool,
    protocol: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hub reads its subscription's replies itself: the confirmation, wakes for the nodes it
    fans out to, and the pongs of its pings, which keep a quiet subscription up (three quiet
    ping periods with no pong would break it and bump the generation)."""
    monkeypatch.setattr("crossflow_ctl.store.redis_notices.PING_EVERY_S", 1.0)
    client = Redis.from_url(redis_url, decode_responses=decode, protocol=protocol)
    hub = WakeHub(client, f"{redis_namespace}:notices")
    try:
        sig = hub.signal("n1")
        await _until(lambda: hub.live)
        generation, woken = hub.generation, sig.count
        await client.publish(hub.channel, "n1")
        await _until(lambda: sig.count > woken)
        await asyncio.sleep(3.5)  # past three quiet ping periods
        assert (hub.live, hub.generation) == (True, generation)
        await client.publish(hub.channel, "n1")
        await _until(lambda: hub.wakes == 2)
        assert hub.generation == generation
    finally:
        await hub.close()
        await client.aclose()


@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decode_responses"])
async def test_a_wake_that_is_not_utf8_leaves_the_hub_serving(
    redis_url: str, redis_namespace: str, decode: bool
) -> None:
    """Anyone who can reach Redis can publish on the wake channel. A payload that is not UTF-8
    names no node; the hub ignores it (or, where the client's decoder refuses the reply,
    subscribes again) and keeps waking its nodes: it never ends while streams wait on it."""
    client = Redis.from_url(redis_url, decode_responses=decode)
    raw = Redis.from_url(redis_url)  # publishes the bad bytes as they are
    hub = WakeHub(client, f"{redis_namespace}:notices")
    try:
        sig = hub.signal("n1")
        await _until(lambda: hub.live)
        await raw.publish(hub.channel, b"\xff\xfe")
        woken = sig.count
        await _until(lambda: hub.live and hub._task is not None and not hub._task.done())
        await raw.publish(hub.channel, "n1")
        await _until(lambda: sig.count > woken and hub.live)
        assert hub._task is not None and not hub._task.done()
    finally:
        await hub.close()
        await client.aclose()
        await raw.aclose()
