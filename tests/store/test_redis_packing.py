"""The store's Redis connections pack commands with hiredis (C) instead of redis-py's asyncio
Python packer: the bytes on the wire must be the same, odd argument types must still go
through redis-py's own packer (and its errors), and a real client must work through it."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis._parsers.encoders import Encoder
from redis.asyncio.connection import AbstractConnection, Connection, UnixDomainSocketConnection
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

from crossflow_ctl.store.redis_connect import (
    PROTOCOL,
    PackedConnection,
    PackedSSLConnection,
    RedisConnection,
    connect,
    hiredis_packed,
)

ARG = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
)
HEAD = st.sampled_from([b"EVALSHA", "HSET", "CLIENT SETNAME", b"CONFIG GET", b"X"])


_PYTHON_PACKER = SimpleNamespace(_buffer_cutoff=6000, encoder=Encoder("utf-8", "strict", False))


_PYTHON_PACK = getattr(AbstractConnection, "_pack_command_python", AbstractConnection.pack_command)
"""redis-py's Python packer (8.2 named it apart when it began packing with hiredis itself)."""


def python_packed(*args: Any) -> bytes:
    """What redis-py's asyncio connection sends for ``args`` (its own Python packer)."""
    return b"".join(_PYTHON_PACK(_PYTHON_PACKER, *args))


@given(HEAD, st.lists(ARG, max_size=150))
def test_hiredis_packs_every_command_as_redis_py_does(head: Any, args: list[Any]) -> None:
    packed = hiredis_packed((head, *args))
    assert packed is not None
    assert b"".join(packed) == python_packed(head, *args)


@pytest.mark.parametrize("cls", [PackedConnection, PackedSSLConnection])
def test_other_argument_types_go_through_redis_py_own_packer(cls: type[Connection]) -> None:
    conn = cls()
    assert hiredis_packed((b"SET", bytearray(b"k"), memoryview(b"v"))) is None
    assert b"".join(conn.pack_command(b"SET", bytearray(b"k"), memoryview(b"v"))) == (
        python_packed(b"SET", b"k", b"v")
    )
    with pytest.raises(DataError):
        conn.pack_command(b"SET", "k", True)  # type: ignore[arg-type]


async def test_a_store_client_talks_to_redis_through_the_hiredis_packer(
    redis_url: str, redis_namespace: str
) -> None:
    client = connect(redis_url, RedisConnection(), 5.0)
    key = f"{redis_namespace}:packed"
    value = "ünïcode \x1f\r\n" * 2000  # past redis-py's 6,000-byte chunking
    try:
        assert client.connection_pool.connection_class is PackedConnection  # type: ignore[union-attr]
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("SET", key, value)
        pipe.execute_command("APPEND", key, 1.5)
        pipe.execute_command("GET", key)
        replies = await pipe.execute()
    finally:
        await client.aclose(close_connection_pool=True)
    assert replies[2] == (value + "1.5").encode()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:1/0", PackedConnection),
        ("rediss://127.0.0.1:1/0", PackedSSLConnection),
        ("unix:///tmp/crossflow-none.sock", UnixDomainSocketConnection),
    ],
)
async def test_each_url_scheme_gets_its_connection_class(url: str, expected: type) -> None:
    """A rediss:// URL's own class would win over the one passed: TLS must get the packer too;
    a unix socket keeps redis-py's (no connection is opened here)."""
    client = connect(url, RedisConnection(), 1.0)
    try:
        assert client.connection_pool.connection_class is expected  # type: ignore[union-attr]
    finally:
        await client.aclose(close_connection_pool=True)


@pytest.mark.parametrize(("query", "resp"), [("", "2"), ("?protocol=3", "3")])
async def test_a_store_client_speaks_resp2_unless_its_url_names_a_protocol(
    redis_url: str, query: str, resp: str
) -> None:
    """The store reads RESP2's reply shapes; redis-py 8.2 made RESP3 its default."""
    client = connect(redis_url + query, RedisConnection(), 5.0)
    try:
        info = (await client.execute_command("CLIENT", "INFO")).decode()
    finally:
        await client.aclose(close_connection_pool=True)
    assert f"resp={resp}" in info.split()


async def test_a_write_goes_out_in_the_calling_task(redis_url: str) -> None:
    """redis-py bounds each write with asyncio.wait_for: on Python 3.11 a task of its own per
    command. The store's connections write in the caller's task."""
    client = connect(redis_url, RedisConnection(), 5.0)
    loop = asyncio.get_running_loop()
    made: list[str] = []

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    try:
        assert await client.ping()  # connected
        loop.set_task_factory(counting)
        try:
            assert await client.execute_command("ECHO", "in this task") == b"in this task"
        finally:
            loop.set_task_factory(None)
    finally:
        await client.aclose(close_connection_pool=True)
    assert made == []


async def test_a_write_the_server_does_not_take_times_out_and_drops_the_connection() -> None:
    """A peer that stops reading: the write waits for buffer room no longer than the socket
    timeout, then fails as redis-py's own would (its TimeoutError), and the connection is
    closed rather than left with half a command on it."""
    reading = asyncio.Event()
    reading.set()
    held: list[asyncio.StreamWriter] = []

    async def stops_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while reading.is_set():  # answers the connection's handshake, if any, then stops
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    if await reader.read(65536):
                        writer.write(b"+OK\r\n")

    server = await asyncio.start_server(stops_reading, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn = PackedConnection(
        host="127.0.0.1", port=port, socket_timeout=0.3, driver_info=None, protocol=PROTOCOL
    )
    try:
        await conn.connect()
        reading.clear()
        await asyncio.sleep(0.1)
        with pytest.raises(RedisTimeoutError, match="Timeout writing"):
            for _ in range(1000):  # until the socket buffers are full
                await conn.send_command("SET", "k", b"x" * 1_000_000)
        assert not conn.is_connected
    finally:
        await conn.disconnect()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
