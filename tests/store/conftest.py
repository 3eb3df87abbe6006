"""Store fixtures: every contract test runs on the MemoryStore and on a RedisStore (real Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from crossflow_ctl.store.base import Store
from crossflow_ctl.store.memory import MemoryStore
from crossflow_ctl.store.redis_store import RedisStore


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        s: Store = MemoryStore(seed=1)
    else:
        url = request.getfixturevalue("redis_url")
        s = RedisStore(url, namespace=request.getfixturevalue("redis_namespace"))
    try:
        yield s
    finally:
        await s.close()
