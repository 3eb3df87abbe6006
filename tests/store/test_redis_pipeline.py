"""``send_all``: plain commands in one round trip without redis-py's Pipeline object. Its replies,
errors and connection handling must be those of ``pipeline(transaction=False).execute``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from crossflow_ctl.store.redis_connect import RedisConnection, connect
from crossflow_ctl.store.redis_pipeline import send_all

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    r = connect(redis_url, RedisConnection(), socket_timeout_s=0.3)
    assert isinstance(r, Redis)
    yield r
    await r.aclose()
    await r.connection_pool.disconnect()  # a pool passed in is not the client's to close


async def _pipelined(r: Redis, commands: list[tuple[Any, ...]], raise_on_error: bool) -> Any:
    pipe = r.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return await pipe.execute(raise_on_error=raise_on_error)


def _comparable(replies: list[Any]) -> list[Any]:
    return [(type(r), r.args) if isinstance(r, Exception) else r for r in replies]


async def _reads(r: Redis, ns: str) -> list[tuple[Any, ...]]:
    await r.hset(f"{ns}:h", mapping={"a": "1", "b": "2"})
    await r.set(f"{ns}:s", "x")
    for i in range(3):
        await r.xadd(f"{ns}:x", {"k": f"v{i}", "n": i})
    return [
        ("HGETALL", f"{ns}:h"),
        ("XRANGE", f"{ns}:x", "0-0", "+", "COUNT", 2),
        ("EXISTS", f"{ns}:h"),
        ("EXISTS", f"{ns}:missing"),
        ("EVALSHA", "0" * 40, 0),  # NOSCRIPT
        ("HGETALL", f"{ns}:s"),  # WRONGTYPE
        ("EVAL", "return {KEYS[1], ARGV[1], 7}", 1, f"{ns}:k", "arg"),
        ("GET", f"{ns}:s"),
    ]


async def test_replies_and_errors_in_their_slots_as_a_pipeline_gives_them(
    client: Redis, redis_namespace: str
) -> None:
    commands = await _reads(client, redis_namespace)
    expected = await _pipelined(client, commands, raise_on_error=False)
    got = await send_all(client, commands, raise_on_error=False)
    assert _comparable(got) == _comparable(expected)
    assert isinstance(got[4], NoScriptError)
    assert got[1][0][1] == {b"k": b"v0", b"n": b"0"}  # XRANGE's entries parsed as redis-py does


async def test_the_first_error_is_raised_as_a_pipeline_raises_it_and_the_connection_stays_usable(
    client: Redis, redis_namespace: str
) -> None:
    commands = await _reads(client, redis_namespace)
    with pytest.raises(ResponseError) as expected:
        await _pipelined(client, commands, raise_on_error=True)
    with pytest.raises(ResponseError) as got:
        await send_all(client, commands)
    assert type(got.value) is type(expected.value) is NoScriptError
    assert got.value.args == expected.value.args  # annotated with the command, as redis-py does
    # Every reply was read before raising: the pooled connection is in step for the next call.
    assert await send_all(client, [("GET", f"{redis_namespace}:s"), ("PING",)]) == [b"x", True]


async def test_a_reply_later_than_the_socket_timeout_is_a_timeout_and_drops_the_connection(
    client: Redis, redis_namespace: str
) -> None:
    with pytest.raises(RedisTimeoutError):
        await send_all(client, [("PING",), ("BLPOP", f"{redis_namespace}:empty", 1)])
    # The connection whose reply was still due was dropped, not handed out again in mid-reply.
    pool: Any = client.connection_pool
    assert all(not c.is_connected for c in pool._available_connections)
    assert await send_all(client, [("SET", f"{redis_namespace}:after", "1"), ("PING",)]) == [
        True,
        True,
    ]


async def test_a_cancel_while_releasing_does_not_keep_the_connection(redis_url: str) -> None:
    """A caller cancelled while ``release`` waits on the pool's lock (callers queue for a
    connection) must still give the connection back: else the slot is gone for good."""
    r = connect(redis_url, RedisConnection(), socket_timeout_s=2.0, max_connections=2)
    pool = r.connection_pool
    try:
        call = asyncio.ensure_future(send_all(r, [("BLPOP", "cf:test:pipeline:empty", "0.1")]))
        await asyncio.sleep(0.03)  # the BLPOP is in flight

        async def hold_the_lock() -> None:
            async with pool._condition:  # type: ignore[attr-defined]
                await asyncio.sleep(0.3)

        holder = asyncio.ensure_future(hold_the_lock())
        await asyncio.sleep(0.2)  # the reply came; release now waits for the lock
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await holder
        await asyncio.sleep(0.05)
        assert not pool._in_use_connections  # type: ignore[attr-defined]
        assert await send_all(r, [("PING",)]) == [True]
    finally:
        await r.aclose()
        await pool.disconnect()


async def test_a_failing_reply_callback_does_not_leave_the_connection_out_of_step(
    redis_url: str,
) -> None:
    r = connect(redis_url, RedisConnection(), socket_timeout_s=2.0, max_connections=1)
    try:

        def broken(reply: Any) -> Any:
            raise ValueError("callback failed")

        r.response_callbacks["ECHO"] = broken
        with pytest.raises(ValueError, match="callback failed"):
            await send_all(r, [("ECHO", "first"), ("PING",), ("ECHO", "third")])
        del r.response_callbacks["ECHO"]
        # the one connection of the pool: the replies of the failed call must not be read here
        assert await send_all(r, [("ECHO", "next")]) == [b"next"]
    finally:
        await r.aclose()
        await r.connection_pool.disconnect()
