"""The synthetic engine in-process, and behind the fake-engine HTTP server on loopback."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from crossflow_agent.fake_engine import FakeEngineServer
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_agent.sources.synthetic import (
    EngineRequest,
    EngineScript,
    SyntheticEngine,
    SyntheticSource,
)
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS

MODEL, NODE = MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"]


class Mono:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine(script: EngineScript | None = None) -> tuple[SyntheticEngine, Mono]:
    mono = Mono()
    return SyntheticEngine(MODEL, NODE, script, monotonic=mono), mono


def test_state_evolves_with_time_and_requests() -> None:
    e, mono = engine()
    e.submit(EngineRequest(prompt_tokens=3000, cached_tokens=1000, output_tokens=500))
    assert e.state()["prefilling_requests"] + e.state()["running_requests"] == 1
    mono.now = 0.5  # prefill (2000 uncached tokens, one chunk) and ~100 decode steps of ~5 ms
    s = e.state()
    assert s["running_requests"] == 1
    assert s["counters"]["prefill_compute"] == 2000 and s["counters"]["prefill_cache"] == 1000
    assert 0 < s["counters"]["generation"] < 500
    mono.now = 30.0  # long enough to finish
    s = e.state()
    assert s["running_requests"] == 0 and s["counters"]["requests"] == 1
    assert s["counters"]["generation"] == 500
    assert s["kv_used_tokens"] == 0 and s["kv_reserved_tokens"] == 0


def test_a_fully_cached_request_goes_straight_to_decode() -> None:
    e, mono = engine()
    e.submit(EngineRequest(prompt_tokens=4000, cached_tokens=4000, output_tokens=20))
    assert e.state()["running_requests"] == 1 and e.state()["prefilling_requests"] == 0
    mono.now = 5.0
    s = e.state()
    assert s["counters"]["requests"] == 1 and s["counters"]["prefill_compute"] == 0


def test_kv_use_never_exceeds_total_and_the_queue_waits() -> None:
    e, mono = engine(EngineScript(kv_total_tokens=10_000, max_running=64))
    for _ in range(10):
        e.submit(EngineRequest(prompt_tokens=2000, output_tokens=500))
    for step in range(1, 40):
        mono.now = step * 0.05
        s = e.state()
        assert s["kv_used_tokens"] <= s["kv_reserved_tokens"] <= 10_000
    assert e.state()["queued_requests"] > 0  # 4 fit (2500 reserved each); the rest wait


def test_slowdown_stretches_itl() -> None:
    e, mono = engine()
    source = SyntheticSource(e)
    for _ in range(8):
        e.submit(EngineRequest(prompt_tokens=500, output_tokens=10_000))

    def scrape_at(t: float):
        mono.now = t
        return asyncio.run(source.scrape())

    scrape_at(1.0)
    fast = scrape_at(2.0)
    e.slowdown = 4.0
    scrape_at(3.0)
    slow = scrape_at(4.0)
    assert fast.itl_p50_ms is not None and slow.itl_p50_ms is not None
    assert slow.itl_p50_ms > 3 * fast.itl_p50_ms
    assert slow.generation_rate_tps < fast.generation_rate_tps / 3
    assert fast.running_requests == 8 and fast.source == "synthetic"


def test_background_arrivals_give_steady_load() -> None:
    script = EngineScript(
        background_rps=10.0, background=EngineRequest(prompt_tokens=1000, output_tokens=100)
    )
    e, mono = engine(script)
    mono.now = 5.0
    s = e.state()
    total = s["queued_requests"] + s["prefilling_requests"] + s["running_requests"]
    assert total + s["counters"]["requests"] == pytest.approx(50, abs=1)


@pytest.fixture
async def fake_engine():
    server = FakeEngineServer(SyntheticEngine(MODEL, NODE))
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def test_fake_engine_http_round_trip(fake_engine: FakeEngineServer) -> None:
    async with httpx.AsyncClient(base_url=fake_engine.url, trust_env=False) as http:
        r = await http.post(
            "/requests",
            json={"prompt_tokens": 1000, "output_tokens": 10_000, "borrowed": True, "count": 3},
        )
        assert r.status_code == 200 and r.json()["accepted"] == 3
        state = (await http.get("/state")).json()
        assert state["borrowed_requests"] == 3
        # the same keep-alive connection serves the scrape, parsed by the real SGLang reader
        source = PrometheusSource(f"{fake_engine.url}/metrics", SGLangReader(), client=http)
        await source.scrape()
        await asyncio.sleep(0.2)
        snap = await source.scrape()
        assert snap.running_requests + snap.queued_requests == 3
        assert snap.kv_total_tokens == 400_000 and snap.kv_used_tokens > 0
        assert snap.generation_rate_tps > 0
        r = await http.post("/control", json={"slowdown": 2.5})
        assert r.status_code == 200 and r.json()["slowdown"] == 2.5
        assert (await http.get("/healthz")).text == "ok\n"


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/requests", {"prompt_tokens": 0, "output_tokens": 5}, 400, "prompt_tokens"),
        ("/requests", {"prompt_tokens": 5, "output_tokens": 5, "cached_tokens": 9}, 400, "cached"),
        ("/requests", {"prompt_tokens": 5, "output_tokens": 5, "count": 0}, 400, "count"),
        ("/requests", {"prompt_tokens": 5, "output_tokens": 5, "colour": "red"}, 400, "colour"),
        ("/requests", [1, 2], 400, "object"),
        ("/control", {"slowdown": -1}, 400, "slowdown"),
        ("/control", {"speed": 2}, 400, "speed"),
        ("/nowhere", {}, 404, "no route"),
    ],
)
async def test_fake_engine_refuses_bad_input(
    fake_engine: FakeEngineServer, path: str, body: object, status: int, needle: str
) -> None:
    async with httpx.AsyncClient(base_url=fake_engine.url, trust_env=False) as http:
        r = await http.post(path, json=body)
        assert r.status_code == status and needle in r.json()["error"]
        assert (await http.get("/state")).json()["queued_requests"] == 0  # nothing changed
        r = await http.post("/requests", content=b"{not json", headers={"x": "y"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]
        assert (await http.get("/metrics")).status_code == 200  # the connection survived


async def test_fake_engine_wrong_method_and_oversized_body(fake_engine: FakeEngineServer) -> None:
    async with httpx.AsyncClient(base_url=fake_engine.url, trust_env=False) as http:
        assert (await http.post("/metrics")).status_code == 405
        r = await http.post("/requests", content=b"x" * (1024 * 1024 + 1))
        assert r.status_code == 413
        assert (await http.get("/healthz")).status_code == 200  # a new connection is fine
