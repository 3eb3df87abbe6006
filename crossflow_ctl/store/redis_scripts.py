"""The Lua scripts of the Redis store: loaded from the package, registered once per client.

Each ``lua/<name>.lua`` starts with a header naming its KEYS, ARGV and return value. Per-node
scripts are prefixed with ``lua/_lib.lua`` (shared helpers) when loaded. Calls go out as EVALSHA;
on NOSCRIPT (a restarted or flushed Redis) the script is loaded and the call retried.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from crossflow_ctl.store.redis_pipeline import send_all

PER_NODE = (
    "upsert_leases",
    "try_debit",
    "commit",
    "release",
    "set_cordon",
    "node_view",
    "register_node",
)
"""Scripts over one node's keys (one hash tag); they share ``_lib.lua``."""
STANDALONE = (
    "put_pool_load",
    "delete_node",
    "touch_node",
    "set_policy",
    "forget_request",
    "draw_lenders",
)
"""Scripts without the shared helpers: one pool's keys; deleting or touching one node; the
policy key; one request record; one lender index bucket."""


def load_script(name: str) -> str:
    """A script's source, with the shared helpers first for per-node scripts."""
    lua = resources.files("crossflow_ctl.store").joinpath("lua")
    body = lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name not in PER_NODE:
        return body
    return lua.joinpath("_lib.lua").read_text(encoding="utf-8") + "\n" + body


class Scripts:
    """Every script, registered on one client (``register_script``: EVALSHA, NOSCRIPT fallback)."""

    def __init__(self, client: Redis | RedisCluster) -> None:
        self._r = client
        self.by_name: dict[str, AsyncScript] = {
            name: client.register_script(load_script(name)) for name in (*PER_NODE, *STANDALONE)
        }

    async def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One EVALSHA round trip (two, once, after NOSCRIPT).

        Sent as a plain EVALSHA (``AsyncScript.__call__`` adds a pipeline check and argument
        copies to every call on the admission path). A NOSCRIPT reply means nothing ran, so
        loading the script and sending again is safe."""
        script = self.by_name[name]
        try:
            return await self._r.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            script.sha = await self._r.script_load(script.script)
            return await self._r.evalsha(script.sha, len(keys), *keys, *args)

    async def run_many(
        self, name: str, calls: Sequence[tuple[Sequence[str | bytes], Sequence[Any]]]
    ) -> list[Any]:
        """Each (keys, args) call of script ``name`` as EVALSHA, in ONE pipeline round trip
        (per Cluster master); the replies in order, raising the first error.

        A pipeline is not a transaction: each script is atomic on its own. On NOSCRIPT (nothing
        ran for that call) the script is loaded and the calls that met it are sent again."""
        out = await self.run_each(name, calls)
        for reply in out:
            if isinstance(reply, Exception):
                raise reply
        return out

    async def run_each(
        self, name: str, calls: Sequence[tuple[Sequence[str | bytes], Sequence[Any]]]
    ) -> list[Any]:
        """Like :meth:`run_many`, but each call's reply or its own error (an exception object)
        in order, so one refused call fails only its caller."""
        script = self.by_name[name]
        out: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            commands = []
            for i in todo:
                keys, args = calls[i]
                commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
            replies = await send_all(self._r, commands, raise_on_error=False)
            for i, reply in zip(todo, replies, strict=True):
                out[i] = reply
            todo = [i for i in todo if isinstance(out[i], NoScriptError)]
            if not todo or attempt:
                break
            script.sha = await self._r.script_load(script.script)
        return out

    async def run_with(
        self, name: str, keys: Sequence[str], args: Sequence[Any], *after: tuple[Any, ...]
    ) -> list[Any]:
        """The script, then plain commands ``after``, in ONE pipeline round trip (two, once,
        after NOSCRIPT: nothing ran then, and the commands are sent again with it)."""
        return await self.run_after((), name, [(keys, args)], after)

    async def views(
        self,
        before: Sequence[tuple[Any, ...]],
        node_keys: Sequence[Sequence[str]],
        now_ms: int,
    ) -> list[Any]:
        """Plain commands ``before``, then ``node_view`` per node, in ONE pipeline round trip."""
        if not before and len(node_keys) == 1:  # one node: a plain EVALSHA, no pipeline
            return [await self.run("node_view", node_keys[0], (now_ms,))]
        return await self.run_after(before, "node_view", [(keys, (now_ms,)) for keys in node_keys])

    async def run_after(
        self,
        before: Sequence[tuple[Any, ...]],
        name: str,
        calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
        after: Sequence[tuple[Any, ...]] = (),
    ) -> list[Any]:
        """Plain commands ``before`` (reads: they may be sent twice), then each (keys, args)
        call of script ``name``, then plain commands ``after``, in ONE pipeline round trip; the
        replies in order.

        EVALSHA goes straight into the pipeline (redis-py would add a SCRIPT EXISTS round trip
        for pipelined Script objects); on NOSCRIPT the script is loaded and all of it sent
        again (each call must be safe to repeat)."""
        script = self.by_name[name]
        for attempt in range(2):
            evalshas = [("EVALSHA", script.sha, len(keys), *keys, *args) for keys, args in calls]
            try:
                return await send_all(self._r, [*before, *evalshas, *after])
            except NoScriptError:
                if attempt:
                    raise
                script.sha = await self._r.script_load(script.script)
        raise AssertionError("unreachable")


class DedicatedLine:
    """One pooled connection held for one hot script (the admission debit, standalone Redis).

    Admission's group commit sends one debit call at a time, so the connection is taken from
    the pool once (it counts against the pool's size) and kept, instead of a checkout per call
    (a condition, a timeout, a readiness probe of the socket, the release: more Python than
    the call itself). Calls are serialised (a late, shielded debit may still be in flight when
    the next batch sends); on any error or cancellation (a reply might still be on its way)
    the connection is disconnected and handed back, and the next call takes one again. The
    socket timeout bounds each read, as on every pooled connection."""

    def __init__(self, client: Redis, scripts: Scripts, name: str) -> None:
        self._client = client
        self._script = scripts.by_name[name]
        self._conn: AbstractConnection | None = None
        self._lock = asyncio.Lock()

    async def run(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The script's reply (one round trip; two, once, after NOSCRIPT)."""
        script = self._script
        async with self._lock:
            conn = self._conn or await self._connection()
            self._conn = None
            try:
                try:
                    await conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                    reply = await conn.read_response()
                except NoScriptError:  # nothing ran: load it and send again
                    script.sha = await self._client.script_load(script.script)
                    await conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                    reply = await conn.read_response()
            except BaseException:
                await self._hand_back(conn)
                raise
            self._conn = conn
            return reply

    async def _connection(self) -> AbstractConnection:
        """A connection taken from the pool (waiting for one, within the pool's timeout)."""
        conn: AbstractConnection = await self._client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        return conn

    async def _hand_back(self, conn: AbstractConnection) -> None:
        with contextlib.suppress(RedisError, OSError):
            await conn.disconnect(nowait=True)
        await self._client.connection_pool.release(conn)

    async def close(self) -> None:
        async with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                await self._hand_back(conn)
