"""Records written by a newer replica during a rolling upgrade, with fields this version lacks.

A policy: this replica applies what it knows, keeps refreshing, and refuses to write it back
without the new setting; a policy that cannot be read at all never stops the refresh loop. A
prefill pool's load report: read from the fields this version knows."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import FailedPrecondition, InvalidArgument
from crossflow_ctl.domain.models import PoolLoad, StoredPoolLoad
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.service.policy_keeper import PolicyKeeper, refresh_forever
from crossflow_ctl.store.keys import Keys
from crossflow_ctl.store.redis_codec import live_pool_loads
from tests.conftest import patient_redis_store

pytestmark = pytest.mark.redis


async def test_a_newer_replicas_setting_is_set_aside_and_writes_are_refused(
    redis_url: str, redis_namespace: str
) -> None:
    store = patient_redis_store(redis_url, redis_namespace)
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

        await store._r.delete(key)  # the store lost it: restoring it would drop future_knob
        assert (await keeper.load()).unknown_fields == ("future_knob",)
        assert await store._r.exists(key) == 0  # left to a replica that knows every setting

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


def test_a_pool_report_with_fields_this_version_lacks_is_read_from_the_rest() -> None:
    load = PoolLoad(
        node_id="p1", outstanding_uncached_tokens=900, processing_rate_tps=300.0, ttl_ms=1_000
    )
    stored = StoredPoolLoad(load=load, received_at_ms=1, expires_at_ms=5_000, seq=4)
    newer = json.loads(stored.model_dump_json())
    newer["load"]["a_future_figure"] = 12.5
    newer["a_future_stamp"] = 1
    (read,) = live_pool_loads({b"p1": json.dumps(newer).encode()}, now_ms=2)
    assert read == stored
    newer["load"]["outstanding_uncached_tokens"] = -1  # a bad value of a known field
    with pytest.raises(ValidationError):
        live_pool_loads({b"p1": json.dumps(newer).encode()}, now_ms=2)


async def test_a_policy_stored_before_the_kv_share_keeps_its_one_share_on_kv(
    redis_url: str, redis_namespace: str
) -> None:
    """An upgrade must not loosen an operator's limit: a policy stored with one borrow_share
    (0.3, for every credit then) keeps 0.3 on the KV credits until someone sets them apart."""
    store = patient_redis_store(redis_url, redis_namespace)
    try:
        old = PolicySettings(borrow_share=0.3).model_dump(mode="json")
        del old["borrow_kv_share"]
        await store._r.hset(
            Keys(redis_namespace).policy, mapping={"version": 3, "json": json.dumps(old)}
        )
        keeper = PolicyKeeper(store, PolicySettings(), ManualClock(1_000), refresh_ms=1_000)
        loaded = await keeper.load()
        assert loaded.policy.borrow_kv_share == 0.3 and loaded.unknown_fields == ()
        changed = await keeper.update({"borrow_kv_share": 1.0})
        assert changed.policy.borrow_kv_share == 1.0 and changed.policy.borrow_share == 0.3
        assert (await store.get_policy()) == changed  # written with the key: no longer legacy
    finally:
        await store.close()
