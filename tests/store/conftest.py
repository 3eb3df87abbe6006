"""Store fixtures: every contract test runs on the MemoryStore, a RedisStore on real Redis and a
RedisStore on a real Redis Cluster."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from crossflow_ctl.store.base import Store
from crossflow_ctl.store.memory import MemoryStore
from tests.conftest import delete_cluster_namespace, patient_redis_store


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """The contract suite runs on each: the embedded store, one Redis, and a real 3-master
    Redis Cluster (``redis_cluster_url``) through ``redis.asyncio.RedisCluster``."""
    cleanup = None
    if request.param == "memory":
        s: Store = MemoryStore(seed=1)
    elif request.param == "redis":
        url = request.getfixturevalue("redis_url")
        s = patient_redis_store(url, request.getfixturevalue("redis_namespace"))
    else:
        url = request.getfixturevalue("redis_cluster_url")
        namespace = f"cft-{uuid.uuid4().hex[:12]}"
        s = patient_redis_store(url, namespace, cluster=True)
        cleanup = (url, namespace)
    try:
        yield s
    finally:
        await s.close()
        if cleanup is not None:
            delete_cluster_namespace(*cleanup)
