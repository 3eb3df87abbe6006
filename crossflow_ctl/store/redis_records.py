"""The Redis store's global, non-node state: the versioned policy and request records.

Each is one key with its own hash tag (``Keys.policy``, ``Keys.request``), written by a one-key
script (the policy's compare-and-set) or one command (``SET NX GET`` for a request record, Redis
7 or later), so neither touches a node's slot.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from redis.asyncio import Redis, RedisCluster

from crossflow_ctl.domain.errors import Aborted, InvalidArgument
from crossflow_ctl.domain.policy import VersionedPolicy, stored_policy
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.base import grant_member
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_scripts import Scripts

Backend = Callable[[str], AbstractAsyncContextManager[None]]


class RedisRecords:
    def __init__(
        self, client: Redis | RedisCluster, keys: Keys, scripts: Scripts, backend: Backend
    ) -> None:
        self._r = client
        self._k = keys
        self._scripts = scripts
        self._backend = backend

    async def get_policy(self) -> VersionedPolicy | None:
        async with self._backend("get_policy"):
            version, raw = await self._r.hmget(self._k.policy, ["version", "json"])
        if not raw:
            return None
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"the stored policy is not JSON: {exc}", field="policy") from None
        policy, unknown = stored_policy(data)
        return VersionedPolicy(
            policy=policy, version=int(codec.text(version or b"0")), unknown_fields=unknown
        )

    async def set_policy(self, policy: VersionedPolicy, expected_version: int) -> None:
        args = [expected_version, policy.version, policy.policy.model_dump_json()]
        async with self._backend("set_policy"):
            written, stored = await self._scripts.run("set_policy", [self._k.policy], args)
        if not int(written):
            current = int(codec.text(stored))
            raise Aborted(
                f"policy is at version {current}, not {expected_version}",
                current_version=current,
                field="expected_version",
            )

    async def read_request(self, key: str) -> str | None:
        async with self._backend("read_request"):
            stored = await self._r.get(self._k.request(key))
        return None if stored is None else codec.text(stored)

    async def record_request(self, key: str, outcome: str, ttl_ms: int) -> str | None:
        async with self._backend("record_request"):  # SET NX GET: one atomic round trip
            stored = await self._r.set(self._k.request(key), outcome, nx=True, px=ttl_ms, get=True)
        return None if stored is None else codec.text(stored)

    async def forget_request(self, key: str, reservation_id: str) -> None:
        member = grant_member(reservation_id)
        async with self._backend("forget_request"):
            await self._scripts.run("forget_request", [self._k.request(key)], [member])
