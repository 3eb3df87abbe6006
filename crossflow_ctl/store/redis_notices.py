"""Reading a node's notice stream for the Redis store (its agent stream's relay waits on it).

A waiting read checks the node and starts XREAD BLOCK in one round trip (XREAD BLOCK answers at
once when entries are there); a replica that has already seen the node skips the check (nodes
are never deleted). Long waits go in chunks under the socket timeout, so they are not errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from redis.asyncio import Redis

from crossflow_ctl.domain.errors import NotFound
from crossflow_ctl.domain.models import Notice
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.keys import Keys

KNOWN_NODES_CAP = 100_000

Backend = Callable[[str, float], AbstractAsyncContextManager[None]]
"""``RedisStore._backend``: bounds a call in time and maps backend errors to StoreUnavailable."""


class NoticeReader:
    def __init__(self, client: Redis, keys: Keys, backend: Backend, block_chunk_ms: int) -> None:
        self._r = client
        self._k = keys
        self._backend = backend
        self._block_chunk_ms = block_chunk_ms
        self._known: set[str] = set()
        """Nodes this replica has seen registered."""

    def remember(self, node_id: str) -> None:
        if len(self._known) >= KNOWN_NODES_CAP:
            self._known.clear()
        self._known.add(node_id)

    async def read(self, node_id: str, after_seq: int, limit: int, block_ms: int) -> list[Notice]:
        """Notices after ``after_seq`` (a checked node id, ``limit`` > 0), waiting ``block_ms``."""
        key = self._k.node(node_id).notices
        loop = asyncio.get_running_loop()
        deadline = loop.time() + block_ms / 1000.0
        first = min(block_ms, self._block_chunk_ms)
        async with self._backend("read_notices", first / 1000.0):
            if first > 0 and node_id in self._known:
                got: Any = await self._r.xread({key: f"{after_seq}-0"}, count=limit, block=first)
                exists = 1
            else:
                pipe = self._r.pipeline(transaction=False)
                pipe.exists(self._k.node(node_id).info)
                if first > 0:
                    pipe.xread({key: f"{after_seq}-0"}, count=limit, block=first)
                else:
                    pipe.xrange(key, min=f"{after_seq + 1}-0", max="+", count=limit)
                out: list[Any] = await pipe.execute()
                exists, got = out[0], out[1]
        if not exists:  # (an unknown node is refused after the first wait, at most a chunk)
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        self.remember(node_id)
        entries = (got[0][1] if got else []) if first > 0 else got
        while not entries and (left_ms := int((deadline - loop.time()) * 1000)) > 0:
            chunk = min(left_ms, self._block_chunk_ms)
            async with self._backend("read_notices", chunk / 1000.0):
                more: Any = await self._r.xread({key: f"{after_seq}-0"}, count=limit, block=chunk)
            entries = more[0][1] if more else []
        return [codec.notice_from(node_id, eid, fields) for eid, fields in entries]
