"""A policy written by a newer replica (a setting this version lacks) during a rolling upgrade:
this replica applies what it knows, keeps refreshing, and refuses to write it back without the
new setting. A policy that cannot be read at all never stops the refresh loop."""

from __future__ import annotations

import asyncio
import json

import pytest

from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import FailedPrecondition, InvalidArgument
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.service.policy_keeper import PolicyKeeper, refresh_forever
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_store import RedisStore

pytestmark = pytest.mark.redis


async def test_a_newer_replicas_setting_is_set_aside_and_writes_are_refused(
    redis_url: str, redis_namespace: str
) -> None:
    store = RedisStore(redis_url, namespace=redis_namespace)
    try:
        keeper = PolicyKeeper(store, PolicySettings(), ManualClock(1_000), refresh_ms=1_000)
        await keeper.load()
        newer = {**PolicySettings(borrow_share=0.25).model_dump(mode="json"), "future_knob": 3}
        key = Keys(redis_namespace).policy
        await store._r.hset(key, mapping={"version": 7, "json": json.dumps(newer)})

        loaded = await keeper.load()
        assert loaded.version == 7 and loaded.policy.borrow_share == 0.25  # the rest applies
        assert loaded.unknown_fields == ("future_knob",)
        with pytest.raises(FailedPrecondition, match="future_knob"):
            await keeper.update({"borrow_share": 0.4})
        raw = await store._r.hget(key, "json")
        assert json.loads(raw)["future_knob"] == 3  # nothing written over it

        await store._r.hset(key, mapping={"version": 8, "json": '{"borrow_share": 7}'})
        with pytest.raises(InvalidArgument, match="borrow_share"):
            await store.get_policy()  # a bad value of a known setting is still refused
    finally:
        await store.close()


async def test_the_refresh_loop_outlives_a_read_that_fails_unexpectedly() -> None:
    calls = 0
    stop = asyncio.Event()

    async def load() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            stop.set()
        raise RuntimeError("not a CrossflowError")

    await asyncio.wait_for(refresh_forever(load, stop, interval_s=0.001), timeout=10)
    assert calls == 3
