"""A Redis Cluster client whose callers wait for a connection instead of failing.

redis-py's asyncio ``RedisCluster`` gives each node at most ``max_connections`` connections but
does not wait for one: when all are busy, ``ClusterNode.acquire_connection`` raises
``MaxConnectionsError`` at once (the standalone client's ``BlockingConnectionPool`` waits). A
burst of calls (a storm of Hellos or reports) then failed some of them outright.

:class:`BoundedCluster` lets at most ``permits`` commands or pipelines run at once per client;
the rest wait, up to ``wait_s``, for one to finish. A command takes one connection on one node
at a time (a command sent to several nodes, and a pipeline, one on each of its nodes, never two
on the same one), so no node ever sees more than ``permits`` of them in use, and ``permits`` one
below the node's bound leaves room for the wake subscription (``ClusterPubSub`` holds a
connection of its node's pool, outside this gate, so it never waits behind commands). A call
made while its task already holds a permit (a pipeline resending a redirected command) passes
through instead of waiting for a second one.

This bounds the whole client, not each node: it runs as many calls at once as the standalone
client's pool (``permits``), whichever nodes they go to. A per-node gate would need the target
node, which redis-py only picks inside its pipeline execution (and changes on a redirect).
"""

from __future__ import annotations

import asyncio
import contextvars
from types import TracebackType
from typing import Any

from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterPipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from crossflow_ctl.aio import within

_HOLDS_PERMIT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "crossflow_cluster_permit", default=False
)
"""True in a task (and tasks it starts) while it runs a call under a permit."""


class _Gate:
    """At most ``permits`` holders; a holder waits up to ``wait_s`` to enter."""

    def __init__(self, permits: int, wait_s: float) -> None:
        self._slots = asyncio.Semaphore(permits)
        self._wait_s = wait_s

    def __call__(self) -> _Permit:
        return _Permit(self)

    async def acquire(self) -> None:
        try:
            await within(self._slots.acquire(), self._wait_s)
        except TimeoutError:
            # what BlockingConnectionPool raises when no connection frees up in time
            raise RedisConnectionError("No connection available.") from None

    def release(self) -> None:
        self._slots.release()


class _Permit:
    """One call's hold on the gate (none when its task holds one already)."""

    def __init__(self, gate: _Gate) -> None:
        self._gate = gate
        self._token: contextvars.Token[bool] | None = None

    async def __aenter__(self) -> None:
        if _HOLDS_PERMIT.get():
            return
        await self._gate.acquire()
        self._token = _HOLDS_PERMIT.set(True)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _HOLDS_PERMIT.reset(self._token)
            self._gate.release()


class BoundedCluster(RedisCluster):
    """``RedisCluster`` running at most ``permits`` calls at once; a call waits up to ``wait_s``
    for its turn (module docstring)."""

    def __init__(self, *args: Any, permits: int, wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate = _Gate(permits, wait_s)

    async def initialize(
        self,
        additional_startup_nodes_info: list[tuple[str, int]] | None = None,
        last_failed_node_name: str | None = None,
    ) -> BoundedCluster:
        """redis-py's, then closes the idle connection its topology probe left open: the URL's
        startup node stays a ClusterNode apart from the one built for the same master, and
        its connection would be one more on that master, outside the bound."""
        async with self._gate():
            await super().initialize(additional_startup_nodes_info, last_failed_node_name)
            manager = self.nodes_manager
            for node in list(manager.startup_nodes.values()):
                if manager.nodes_cache.get(node.name) is not node:
                    await node.disconnect_free_connections()
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self._gate():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:  # as RedisCluster.pipeline
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _BoundedPipeline(self, transaction)  # type: ignore[abstract]  # as redis-py does


class _BoundedPipeline(ClusterPipeline):
    """A pipeline that runs under its client's gate (one permit for all its nodes)."""

    cluster_client: BoundedCluster

    async def execute(
        self, raise_on_error: bool = True, allow_redirections: bool = True
    ) -> list[Any]:
        async with self.cluster_client._gate():
            return await super().execute(raise_on_error, allow_redirections)
