"""Building the Redis client from a URL and credentials (AUTH, TLS).

``redis://[user:password@]host:port/db`` or ``rediss://`` (TLS). ``RedisConnection`` adds what
should not sit in a URL: a password read from a secret file, a username, a CA bundle that the
server's certificate must chain to (``rediss://`` only). Credentials Redis refuses raise
:class:`~crossflow_ctl.domain.errors.StoreAuthFailed`, so a broker refuses to start on them
instead of failing every call (see ``RedisStore._backend``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from crossflow_ctl.aio import within
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.store.redis_cluster import BoundedCluster


def hiredis_packed(args: tuple[EncodableT, ...]) -> list[bytes] | None:
    """One command in the Redis protocol packed by hiredis (C), byte for byte what redis-py's
    Python packer makes (a command name with a space, such as 'CLIENT SETNAME', is split);
    None when an argument is of a type hiredis does not pack (bytearray, memoryview, bool...):
    the caller's own packer takes those (and raises DataError where redis-py does).

    redis-py's sync client packs with hiredis when it is installed; its asyncio client always
    packs in Python, joining each argument onto a growing buffer: a 16-lease ``upsert_leases``
    call took 190 us to pack there, about a tenth of lease ingest's CPU (hiredis: 38 us)."""
    head = args[0]
    if isinstance(head, str):
        args = (*head.encode().split(), *args[1:])
    elif isinstance(head, bytes) and b" " in head:
        args = (*head.split(), *args[1:])
    try:
        return [hiredis.pack_command(args)]  # type: ignore[arg-type]  # its stub: 1-tuples
    except TypeError:
        return None


_HAS_RAW_WRITE = callable(getattr(AbstractConnection, "_send_packed_command", None))
"""redis-py's unbounded write (private): a release without it keeps redis-py's own path."""


async def send_in_task(conn: AbstractConnection, command: list[bytes]) -> bool:
    """Write ``command`` on an open ``conn`` bounded by its socket timeout, in the calling task;
    False (nothing written) when redis-py's own path must send it: not connected, a health
    check may be due, or no socket timeout.

    redis-py bounds each write with ``asyncio.wait_for``, which on Python 3.11 runs the write as
    a task of its own: a task, a future and a timer per command, and two more event-loop turns
    before the caller goes on. Here a write that does not wait (the buffer has room: nearly
    always) arms no timer (:func:`~crossflow_ctl.aio.within`). Failures end as redis-py's do:
    the connection is dropped, and a timeout or socket error is raised as its TimeoutError or
    ConnectionError."""
    timeout_s = conn.socket_timeout
    if not _HAS_RAW_WRITE or not conn.is_connected or conn.health_check_interval or not timeout_s:
        return False
    try:
        await within(conn._send_packed_command(command), timeout_s)
    except TimeoutError:
        await conn.disconnect(nowait=True)
        raise RedisTimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while writing to socket: {exc!r}") from exc
    except BaseException:
        await conn.disconnect(nowait=True)  # a write cut short: the stream is out of step
        raise
    return True


class _HiredisWrites(AbstractConnection):
    """Packs commands with hiredis (:func:`hiredis_packed`) and writes them in the calling task
    (:func:`send_in_task`); mixed in before redis-py's plain or TLS connection."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        return hiredis_packed(args) or super().pack_command(*args)

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        if not isinstance(command, list) or not await send_in_task(self, command):
            await super().send_packed_command(command, check_health)


class PackedConnection(_HiredisWrites, Connection):
    """A plain TCP (or unix socket) connection with hiredis packing and in-task writes."""


class PackedSSLConnection(_HiredisWrites, SSLConnection):
    """A TLS connection with hiredis packing and in-task writes."""


def error_text(exc: BaseException) -> str:
    """A Redis client error as ``Type: message``. redis-py 8's ``repr`` of its errors is only a
    category and the type (``server:ResponseError``), which left the operator without Redis's
    own words ("ERR DB index is out of range", "Connection refused")."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


PROTOCOL = 2
"""The RESP version the store speaks unless its URL names one."""

_PACKED_CLASSES: dict[str, type[AbstractConnection]] = {
    "redis": PackedConnection,
    "rediss": PackedSSLConnection,
}


def connection_class_for(url: str) -> dict[str, type[AbstractConnection]]:
    """``connection_class`` for the pool: the packing class of the URL's scheme (TLS for
    ``rediss://``), none for a unix socket (redis-py's own class). Passed for the scheme, not
    swapped after: redis-py 8.2's ``from_url`` lets a passed class win over the scheme's, so a
    plain class passed for ``rediss://`` connected without TLS (before 8.2 the scheme won)."""
    scheme = url.partition("://")[0].lower()
    cls = _PACKED_CLASSES.get(scheme)
    return {} if cls is None else {"connection_class": cls}


@dataclass(frozen=True)
class RedisConnection:
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    """PEM CA bundle for ``rediss://`` URLs (the server's certificate is verified)."""


def connect(
    url: str,
    connection: RedisConnection,
    socket_timeout_s: float,
    *,
    client_name: str | None = None,
    cluster: bool = False,
    max_connections: int = 128,
    pool_timeout_s: float = 3.0,
) -> Redis | RedisCluster:
    """A client for ``url``: at most ``max_connections`` connections (per node of a Cluster);
    a caller waits up to ``pool_timeout_s`` for a free one (on a Cluster, for one of
    ``max_connections - 1`` calls at once: :mod:`.redis_cluster`; the last connection is the
    wake subscription's)."""
    extra: dict[str, Any] = {}
    if connection.username is not None:
        extra["username"] = connection.username
    if connection.password is not None:
        extra["password"] = connection.password
    if connection.ca_file is not None:
        if not url.startswith("rediss://"):
            raise ConfigError("a CA file needs a rediss:// URL", field="redis_ca_file")
        extra["ssl_ca_certs"] = connection.ca_file
        extra["ssl_cert_reqs"] = "required"
    if client_name is not None:
        extra["client_name"] = client_name
    # No client-side retry: a debit script retried after a lost reply would grant
    # twice. One failure is StoreUnavailable and admission fails closed (§5.6).
    retry = Retry(NoBackoff(), retries=0)
    timeouts = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
    # RESP2 unless the URL asks otherwise (``?protocol=3``: its query wins): redis-py 8.2 made
    # RESP3 its default, which changes reply shapes; the store reads RESP2's.
    extra.setdefault("protocol", PROTOCOL)
    if cluster:
        if max_connections < 2:
            raise ConfigError(
                "a Redis Cluster client needs 2 connections per node or more (one for the wake"
                " subscription)",
                field="redis_max_connections",
            )
        return BoundedCluster.from_url(
            url, max_connections=max_connections, retry=retry, **timeouts, **extra,
            permits=max_connections - 1, wait_s=pool_timeout_s,
        )  # fmt: skip
    # (A Cluster client builds its connections itself: it keeps redis-py's Python packer.)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, retry=retry,
        **connection_class_for(url), **timeouts, **extra,
    )  # fmt: skip
    return Redis(connection_pool=pool, retry=retry)
