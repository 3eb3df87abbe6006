"""The Redis store's operator paths: listings over the indexes, deleting and expiring nodes.

Called by :class:`~crossflow_ctl.store.redis_store.RedisStore` inside its backend guard (time
bound, errors mapped to StoreUnavailable). A node's deletion is one ``delete_node`` script over
its own keys (one slot: the open-reservation and last-heard checks and the delete are atomic),
then the index entries go; a crash between the two leaves an index entry whose node is gone,
which listings skip and the next sweep removes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis, RedisCluster

from crossflow_ctl.domain.errors import FailedPrecondition, NotFound
from crossflow_ctl.domain.models import PoolSnapshot, Reservation, is_node_id
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_index import NodeIndex
from crossflow_ctl.store.redis_scripts import Scripts


def _unknown(node_id: str) -> NotFound:
    return NotFound(f"unknown node {node_id!r}", field="node_id")


class RedisAdmin:
    def __init__(
        self,
        client: Redis | RedisCluster,
        keys: Keys,
        scripts: Scripts,
        index: NodeIndex,
        forget: Callable[[str], None],
    ) -> None:
        self._r = client
        self._k = keys
        self._scripts = scripts
        self._index = index
        self._forget = forget
        """Drops a deleted node from the replica's caches."""

    async def _unindex(self, node_id: str) -> None:
        pipe = self._r.pipeline(transaction=False)
        self._index.queue_remove(pipe, node_id)
        await pipe.execute()
        self._forget(node_id)

    async def _delete(self, node_id: str, force: bool, now_ms: int, cutoff: str) -> Any:
        """The ``delete_node`` script, then (once deleted, or found gone) the index entries."""
        k = self._k.node(node_id)
        keys = [k.info, k.lease, k.reservations, k.notices, k.history, k.events, k.expiries]
        args = [now_ms, "1" if force else "0", cutoff]
        out = await self._scripts.run("delete_node", keys, args)
        if codec.text(out[0]) in ("ok", "not_found"):
            await self._unindex(node_id)
        return out

    async def delete_node(self, node_id: str, force: bool, now_ms: int) -> int:
        if not is_node_id(node_id):
            raise _unknown(node_id)
        out = await self._delete(node_id, force, now_ms, "")
        status = codec.text(out[0])
        if status == "not_found":
            raise _unknown(node_id)
        if status == "open":
            raise FailedPrecondition(
                f"node {node_id!r} has {int(out[1])} open reservation(s)",
                field="force",
            )
        return int(out[1])

    async def expire_nodes(self, idle_ms: int, now_ms: int) -> list[str]:
        cutoff = now_ms - idle_ms
        ids = await self._index.node_ids()
        pipe = self._r.pipeline(transaction=False)
        for node_id in ids:
            pipe.hget(self._k.node(node_id).info, "seen")
        seen = await pipe.execute()
        gone: list[str] = []
        for node_id, at in zip(ids, seen, strict=True):
            if at is not None and int(codec.text(at)) >= cutoff:
                continue
            # The script checks again, atomically: a lease since the read keeps the node.
            out = await self._delete(node_id, False, now_ms, str(cutoff))
            if codec.text(out[0]) in ("ok", "not_found"):
                gone.append(node_id)
        return gone

    async def list_reservations(self, node_id: str | None, now_ms: int) -> list[Reservation]:
        if node_id is not None and not is_node_id(node_id):
            raise _unknown(node_id)
        ids = [node_id] if node_id is not None else await self._index.node_ids()
        pipe = self._r.pipeline(transaction=False)
        for n in ids:
            pipe.exists(self._k.node(n).info)
            pipe.hgetall(self._k.node(n).reservations)
        out = await pipe.execute()
        if node_id is not None and not out[0]:
            raise _unknown(node_id)
        found = [
            codec.reservation_from(codec.text(rid), n, rec)
            for n, raw in zip(ids, out[1::2], strict=True)
            for rid, rec in raw.items()
        ]
        return sorted(
            (r for r in found if r.expires_at_ms > now_ms),
            key=lambda r: (r.created_at_ms, r.node_id, r.grant_seq),
        )

    async def list_pools(self, now_ms: int) -> list[PoolSnapshot]:
        pools = sorted(codec.text(p) for p in await self._r.smembers(self._k.pools))
        pipe = self._r.pipeline(transaction=False)
        for p in pools:
            pipe.hgetall(self._k.pool(p))
        out = await pipe.execute()
        return [
            PoolSnapshot.of_stored(p, codec.live_pool_loads(raw, now_ms))
            for p, raw in zip(pools, out, strict=True)
        ]

    async def node_field(self, node_id: str, field: str) -> Any:
        """One field of the node's info hash (None when unset); NotFound for an unknown node."""
        if not is_node_id(node_id):
            raise _unknown(node_id)
        info = self._k.node(node_id).info
        pipe = self._r.pipeline(transaction=False)
        pipe.exists(info)
        pipe.hget(info, field)
        exists, value = await pipe.execute()
        if not exists:
            raise _unknown(node_id)
        return value

    async def node_list(self, node_id: str, key: str, limit: int) -> list[Any]:
        """The node's ``history`` or ``events`` list, newest first."""
        if not is_node_id(node_id):
            raise _unknown(node_id)
        k = self._k.node(node_id)
        pipe = self._r.pipeline(transaction=False)
        pipe.exists(k.info)
        pipe.lrange(getattr(k, key), 0, max(0, limit) - 1)
        exists, items = await pipe.execute()
        if not exists:
            raise _unknown(node_id)
        return list(items) if limit > 0 else []
