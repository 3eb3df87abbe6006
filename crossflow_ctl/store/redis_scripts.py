"""The Lua scripts of the Redis store: loaded from the package, registered once per client.

Each ``lua/<name>.lua`` starts with a header naming its KEYS, ARGV and return value. Per-node
scripts are prefixed with ``lua/_lib.lua`` (shared helpers) when loaded. Calls go out as EVALSHA;
on NOSCRIPT (a restarted or flushed Redis) the script is loaded and the call retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import structlog
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from crossflow_ctl.aio import shielded, wait_settled
from crossflow_ctl.store.redis_pipeline import send_all

log = structlog.get_logger()

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
    "put_step_model",
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


class LostReply:
    """The reply of a call whose late read failed (:meth:`DedicatedLine._finish`)."""


LOST_REPLY = LostReply()


class DedicatedLine:
    """One pooled connection held for one hot script (the admission debit, standalone Redis).

    Admission's group commit sends one debit round at a time, so the connection is taken from
    the pool once (it counts against the pool's size) and kept, instead of a checkout per call
    (a condition, a timeout, a readiness probe of the socket, the release: more Python than
    the call itself). Calls are serialised; a round's script calls go out together (one write,
    one round trip) and are read back in order, each within the socket timeout, in the
    CALLER's task: no task of its own, no hand-off of the replies.

    A caller cancelled while it waits (the admission deadline, or its own caller gone) leaves
    the script calls to land, as they may: when it gave ``late``, the replies still due are read
    in the background and handed to ``late`` (the connection stays in step and is kept);
    without, the connection is dropped. On any other error the connection is disconnected and
    handed back, and the next call takes one again."""

    def __init__(self, client: Redis, scripts: Scripts, name: str) -> None:
        self._client = client
        self._script = scripts.by_name[name]
        self._conn: AbstractConnection | None = None
        self._lock = asyncio.Lock()
        self._finishing: set[asyncio.Task[None]] = set()

    async def run(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The script's reply (one round trip; two, once, after NOSCRIPT); raises its error."""
        reply = (await self.run_each([(keys, args)]))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def run_each(
        self,
        calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
        late: Callable[[list[Any]], None] | None = None,
    ) -> list[Any]:
        """Each (keys, args) call of the script, in ONE round trip (two, once, for the calls
        that met NOSCRIPT: nothing ran for those); each call's reply or its own error (a
        ResponseError object) in order. Cancelled while waiting: with ``late``, the replies are
        read in the background and handed to it (the calls may have run); see the class."""
        await self._lock.acquire()
        handed_over = False
        try:
            conn = self._conn or await self._connection()
            self._conn = None
            script = self._script
            slots: list[int] = []
            """Which call each command written is, in order (a resent call twice)."""
            wire: list[Any] = []
            """The replies read so far, in order."""
            try:
                first = range(len(calls))
                await self._write(conn, [_evalsha(script.sha, calls[i]) for i in first])
                slots.extend(first)
                await self._read(conn, len(slots), wire)
                todo = [i for i, reply in enumerate(wire) if isinstance(reply, NoScriptError)]
                if todo:  # nothing ran for those: load the script and send them again
                    script.sha = await self._client.script_load(script.script)
                    await self._write(conn, [_evalsha(script.sha, calls[i]) for i in todo])
                    slots.extend(todo)
                    await self._read(conn, len(slots), wire)
            except asyncio.CancelledError:
                if late is None:
                    await self._hand_back(conn)
                    raise
                handed_over = True  # the lock goes with it: the connection is not in step yet
                finish = self._finish(conn, len(calls), slots, wire, late)
                task = asyncio.get_running_loop().create_task(
                    finish, name="crossflow-late-debit", context=contextvars.Context()
                )
                self._finishing.add(task)
                task.add_done_callback(self._finishing.discard)
                raise
            except BaseException:
                await self._hand_back(conn)
                raise
            self._conn = conn
            return _by_call(len(calls), slots, wire)
        finally:
            if not handed_over:
                self._lock.release()

    @staticmethod
    async def _write(conn: AbstractConnection, commands: Sequence[tuple[Any, ...]]) -> None:
        """Write ``commands`` in one go. On the store's own connections a write waits only when
        the socket's buffer is full (:func:`~.redis_connect.send_in_task`); a cancellation
        that cuts it short drops the connection (a debit that still went out expires)."""
        await conn.send_packed_command(conn.pack_commands(commands))

    @staticmethod
    async def _read(conn: AbstractConnection, due: int, wire: list[Any]) -> None:
        """Read replies onto ``wire`` until it holds ``due``, each within the socket timeout;
        an error reply takes its slot. A read cancelled while it waits leaves the connection in
        step (nothing of the reply consumed) and ``wire`` holding those read."""
        while len(wire) < due:
            try:
                reply = await conn.read_response(disconnect_on_error=False)
            except ResponseError as exc:
                wire.append(exc)
            else:
                wire.append(reply)

    async def _finish(
        self,
        conn: AbstractConnection,
        count: int,
        slots: list[int],
        wire: list[Any],
        late: Callable[[list[Any]], None],
    ) -> None:
        """Read the replies a cancelled caller left (a NOSCRIPT one stays an error: nothing
        ran), keep the connection and hand each call's reply to ``late``; on a read error, drop
        the connection and hand over the replies read, ``LOST_REPLY`` for the others (whether
        they ran is unknown: a HELD debit expires by itself)."""
        try:
            try:
                await self._read(conn, len(slots), wire)
            except BaseException as exc:
                await self._hand_back(conn)
                lost = len(slots) - len(wire)
                log.warning("late_debit.read_failed", error=repr(exc), replies_lost=lost)
                wire.extend([LOST_REPLY] * lost)
            else:
                self._conn = conn
        finally:
            self._lock.release()
        try:
            late(_by_call(count, slots, wire))
        except Exception:  # a bug in the hand-over must not vanish in a task nobody awaits
            log.exception("late_debit.hand_over_failed")

    async def _connection(self) -> AbstractConnection:
        """A connection taken from the pool (waiting for one, within the pool's timeout)."""
        conn: AbstractConnection = await self._client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        return conn

    async def _hand_back(self, conn: AbstractConnection) -> None:
        with contextlib.suppress(RedisError, OSError):
            await conn.disconnect(nowait=True)
        # Shielded: this runs in the caller's task, and a cancel while the pool's lock is
        # awaited would keep the connection checked out for good (a pool slot lost).
        await shielded(self._client.connection_pool.release(conn))

    async def settle(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the replies cancelled callers left to be read and
        handed to their ``late`` (those a cancel leaves meanwhile included)."""
        await wait_settled(lambda: self._finishing, timeout_s)

    async def close(self) -> None:
        await self.settle(1.0)  # late replies still being read: let them land and be handed over
        # One still waiting (a client without a socket timeout, a Redis gone silent) would hold
        # the line for good: stop it; its replies are handed over as lost (:meth:`_finish`).
        for task in self._finishing:
            task.cancel()
        if self._finishing:
            await asyncio.wait(set(self._finishing), timeout=1.0)
        try:
            async with asyncio.timeout(1.0):
                await self._lock.acquire()
        except TimeoutError:  # still held: the pool's own close drops the connection
            log.warning("debit_line.close_timed_out")
            return
        try:
            conn, self._conn = self._conn, None
            if conn is not None:
                await self._hand_back(conn)
        finally:
            self._lock.release()


def _evalsha(sha: str, call: tuple[Sequence[str], Sequence[Any]]) -> tuple[Any, ...]:
    keys, args = call
    return ("EVALSHA", sha, len(keys), *keys, *args)


def _by_call(count: int, slots: Sequence[int], wire: Sequence[Any]) -> list[Any]:
    """Each call's reply: its last one read (a call resent after NOSCRIPT: the resent one's);
    None for a call whose command was never written."""
    out: list[Any] = [None] * count
    for i, reply in zip(slots, wire, strict=True):
        out[i] = reply
    return out
