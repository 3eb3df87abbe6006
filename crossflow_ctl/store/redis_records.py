"""The Redis store's global, non-node state: the versioned policy and request records.

Each is one key with its own hash tag (``Keys.policy``, ``Keys.request``), written by a one-key
script (compare-and-set) or a plain command, so it never shares a Cluster slot constraint with
the per-node scripts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from redis.asyncio import Redis

from crossflow_ctl.domain.errors import Aborted
from crossflow_ctl.domain.policy import PolicySettings, VersionedPolicy
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.base import PENDING
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_scripts import Scripts

Backend = Callable[[str], AbstractAsyncContextManager[None]]


class RedisRecords:
    def __init__(self, client: Redis, keys: Keys, scripts: Scripts, backend: Backend) -> None:
        self._r = client
        self._k = keys
        self._scripts = scripts
        self._backend = backend

    async def get_policy(self) -> VersionedPolicy | None:
        async with self._backend("get_policy"):
            version, raw = await self._r.hmget(self._k.policy, ["version", "json"])
        if not raw:
            return None
        policy = PolicySettings.model_validate_json(raw)
        return VersionedPolicy(policy=policy, version=int(codec.text(version or b"0")))

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

    async def claim_request(self, key: str, ttl_ms: int) -> str | None:
        name = self._k.request(key)
        async with self._backend("claim_request"):
            pipe = self._r.pipeline(transaction=False)
            pipe.set(name, PENDING, nx=True, px=ttl_ms)
            pipe.get(name)
            claimed, stored = await pipe.execute()
        return None if claimed else codec.text(stored) if stored is not None else PENDING

    async def settle_request(self, key: str, outcome: str, ttl_ms: int) -> str | None:
        async with self._backend("settle_request"):
            out = await self._scripts.run(
                "settle_request", [self._k.request(key)], [PENDING, outcome, ttl_ms]
            )
        return None if int(out[0]) else codec.text(out[1])

    async def forget_request(self, key: str) -> None:
        async with self._backend("forget_request"):
            await self._r.delete(self._k.request(key))
