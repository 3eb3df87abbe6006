"""Engines from Kubernetes: ready pods by label, through a stand-in API server over real HTTP
that checks the bearer token and the selector as the Kubernetes API does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from crossflow_ctl.gateway.discovery import (
    DiscoveryError,
    KubernetesEngines,
    discover,
    ready_engines,
)
from crossflow_ctl.gateway.engines import EnginePool
from crossflow_ctl.gateway.settings import EngineEndpoint


def pod(name: str, node: str, ip: str, *, ready: bool = True, phase: str = "Running") -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"nodeName": node},
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_only_running_ready_pods_count_and_the_node_is_the_id() -> None:
    pods = {
        "items": [
            pod("d-a", "gpu-1", "10.0.0.1"),
            pod("d-b", "gpu-2", "10.0.0.2", ready=False),
            pod("d-c", "gpu-3", "10.0.0.3", phase="Pending"),
            pod("d-d", "gpu-4", "fd00::4"),
            pod("d-e", "gpu-1", "10.0.0.9"),  # a second engine on gpu-1: refused
            {"metadata": {"name": "bare"}},
        ]
    }
    assert ready_engines(pods, 8000, "decode") == [
        {"node_id": "gpu-1", "url": "http://10.0.0.1:8000"},
        {"node_id": "gpu-4", "url": "http://[fd00::4]:8000"},
    ]


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[KubernetesEngines, dict[str, Any]]]:
    state: dict[str, Any] = {"pods": {"role=prefill": [], "role=decode": []}, "fail": False}

    async def pods(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer s3cret":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if state["fail"]:
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        assert request.match_info["ns"] == "serving"
        items = state["pods"].get(request.query.get("labelSelector", ""), [])
        return web.json_response({"kind": "PodList", "items": items})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/pods", pods)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    source = KubernetesEngines(
        namespace="serving", prefill_selector="role=prefill", decode_selector="role=decode",
        port=8100, bootstrap_port=8998, api_url=f"http://127.0.0.1:{port}", token_file=token,
        ca_file=None,
    )  # fmt: skip
    try:
        yield source, state
    finally:
        await runner.cleanup()


async def test_discover_lists_both_roles(api: tuple[KubernetesEngines, dict[str, Any]]) -> None:
    source, state = api
    state["pods"]["role=prefill"] = [pod("p", "cpu-1", "10.1.0.1")]
    state["pods"]["role=decode"] = [pod("d1", "gpu-1", "10.2.0.1"), pod("d2", "gpu-2", "10.2.0.2")]
    async with aiohttp.ClientSession() as session:
        prefill, decode = await discover(session, source)
    assert prefill == [{"node_id": "cpu-1", "url": "http://10.1.0.1:8100", "bootstrap_port": 8998}]
    assert [e["node_id"] for e in decode] == ["gpu-1", "gpu-2"]


async def test_a_failing_api_or_a_bad_token_raises_and_says_why(
    api: tuple[KubernetesEngines, dict[str, Any]], tmp_path: Path
) -> None:
    source, state = api
    async with aiohttp.ClientSession() as session:
        state["fail"] = True
        with pytest.raises(DiscoveryError, match="answered 500"):
            await discover(session, source)
        state["fail"] = False
        (tmp_path / "other").write_text("wrong")
        bad = source.model_copy(update={"token_file": tmp_path / "other"})
        with pytest.raises(DiscoveryError, match="answered 401"):
            await discover(session, bad)
        gone = source.model_copy(update={"token_file": tmp_path / "missing"})
        with pytest.raises(DiscoveryError, match="token"):
            await discover(session, gone)


def test_the_pool_takes_joins_and_leaves_and_keeps_the_rest() -> None:
    a = EngineEndpoint(node_id="gpu-1", url="http://10.0.0.1:8000")
    b = EngineEndpoint(node_id="gpu-2", url="http://10.0.0.2:8000")
    p = EngineEndpoint(node_id="cpu-1", url="http://10.1.0.1:8000")
    pool = EnginePool([p], [a])
    kept = pool.get("gpu-1")
    assert kept is not None
    kept.inflight = 3
    joined, left = pool.replace([p], [a, b])
    assert [e.node_id for e in joined] == ["gpu-2"] and left == []
    assert pool.get("gpu-1") is kept and kept.inflight == 3
    moved = EngineEndpoint(node_id="gpu-1", url="http://10.0.0.9:8000")
    joined, left = pool.replace([p], [moved])
    assert [e.node_id for e in left] == ["gpu-1", "gpu-2"]
    assert [e.url for e in joined] == ["http://10.0.0.9:8000"]
    assert [e.node_id for e in pool.decode] == ["gpu-1"]


async def test_one_missed_health_check_is_not_enough_to_take_an_engine_out() -> None:
    """A busy engine that is slow to answer once stays in; a second miss in a row takes it
    out, and one answer brings it back (a failed request would take it out at once)."""
    engine = EngineEndpoint(node_id="gpu-1", url="http://127.0.0.1:9")  # nothing listens
    pool = EnginePool([EngineEndpoint(node_id="cpu-1", url="http://127.0.0.1:9")], [engine])
    async with aiohttp.ClientSession() as session:
        await pool.check_health(session, timeout_s=5.0)
        assert all(e.healthy for e in pool.all())
        await pool.check_health(session, timeout_s=5.0)
        assert not any(e.healthy for e in pool.all())
