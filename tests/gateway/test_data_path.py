"""The data path end to end: real HTTP to the gateway, real gRPC to a broker, fake engines that
speak vLLM's and SGLang's P/D protocols. Where a prompt was prefilled is read from the engines'
own ``vllm:prompt_tokens_by_source_total`` counters, never from the gateway's word."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.gateway.conftest import MODEL, Cluster, StartCluster, eventually, lend, metric

pytestmark = pytest.mark.slow
SOURCE = "vllm:prompt_tokens_by_source_total"


def prompt(words: int, salt: str = "") -> str:
    return " ".join(f"{salt}w{i}" for i in range(words))


async def by_source(session: aiohttp.ClientSession, url: str, source: str) -> float:
    return await metric(session, url, SOURCE, source=source)


async def test_a_borrowed_prompt_is_prefilled_on_the_granted_decode_engine(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(broker="demand")
    body = {"model": MODEL, "prompt": prompt(200), "max_tokens": 8}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{cluster.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
            # the answer says how it went: borrowed, on the decode engine that prefilled it
            assert resp.headers["X-Crossflow-Path"] == "borrowed"
            node = resp.headers["X-Crossflow-Node"]
        assert answer["usage"]["completion_tokens"] == 8
        (granted,) = [d for d in cluster.decode if d.node_id == node]
        assert await by_source(s, granted.url, "local_compute") >= 200
        assert answer["choices"][0]["text"]
        local = [await by_source(s, d.url, "local_compute") for d in cluster.decode]
        assert sum(local) >= 200  # prefilled on a decode engine
        assert await by_source(s, cluster.prefill[0].url, "local_compute") == 0
        assert (
            await metric(s, cluster.url, "crossflow_gateway_requests_total", path="borrowed") == 1
        )
    await _no_reservation_left(cluster)


async def test_without_demand_the_normal_path_runs_vllms_two_hops(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(broker="idle")
    body = {"model": MODEL, "prompt": prompt(120), "max_tokens": 5}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{cluster.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
            assert resp.headers["X-Crossflow-Path"] == "normal"
            assert resp.headers["X-Crossflow-Node"] in {d.node_id for d in cluster.decode}
        assert answer["usage"]["completion_tokens"] == 5
        assert await by_source(s, cluster.prefill[0].url, "local_compute") >= 120
        moved = [await by_source(s, d.url, "external_kv_transfer") for d in cluster.decode]
        assert sum(moved) >= 120
        local = [await by_source(s, d.url, "local_compute") for d in cluster.decode]
        assert sum(local) == 0
        assert (
            await metric(s, cluster.url, "crossflow_gateway_admissions_total", reason="no_demand")
            == 1
        )


@pytest.mark.parametrize("broker", ["demand", "idle"])
async def test_the_openai_sdk_streams_and_unstreams_on_both_paths(
    start_cluster: StartCluster, broker: str
) -> None:
    cluster = await start_cluster(broker=broker)
    client = AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0)
    try:
        done = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt(50)}], max_tokens=6
        )
        assert done.choices[0].message.content
        assert done.usage is not None and done.usage.completion_tokens == 6
        stream = await client.completions.create(
            model=MODEL, prompt=prompt(60, "s"), max_tokens=7, stream=True
        )
        texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert len([t for t in texts if t]) == 7
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt(40, "c")}],
            max_tokens=4, stream=True,
        )  # fmt: skip
        deltas = [c.choices[0].delta.content async for c in chat if c.choices]
        assert len([d for d in deltas if d]) == 4
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        await client.close()
    await _no_reservation_left(cluster)


async def test_without_a_broker_every_request_still_completes(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(broker="unreachable")
    async with aiohttp.ClientSession() as s:
        bodies = [{"model": MODEL, "prompt": prompt(30, str(i)), "max_tokens": 3} for i in range(6)]
        answers = await asyncio.gather(*(_complete(s, cluster.url, b) for b in bodies))
        assert all(a["usage"]["completion_tokens"] == 3 for a in answers)
        assert await metric(s, cluster.url, "crossflow_gateway_broker_unavailable_total") == 6
        assert await metric(s, cluster.url, "crossflow_gateway_requests_total", path="normal") == 6


async def test_a_static_gateway_asks_no_broker(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(broker="none")
    async with aiohttp.ClientSession() as s:
        answer = await _complete(s, cluster.url, {"prompt": prompt(10), "max_tokens": 2})
        assert answer["model"] == MODEL
        assert await metric(s, cluster.url, "crossflow_gateway_admissions_total") == 0


async def test_bad_input_is_refused_and_changes_nothing(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(broker="demand")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{cluster.url}/v1/completions", data=b"{nope") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "body"
        wrong = {"model": "other", "prompt": "x"}
        async with s.post(f"{cluster.url}/v1/completions", json=wrong) as resp:
            assert resp.status == 404
            assert "model" in (await resp.json())["error"]["message"]
        bad = {"model": MODEL, "prompt": "x y z", "max_tokens": -3}
        async with s.post(f"{cluster.url}/v1/completions", json=bad) as resp:
            assert resp.status == 400  # the engine's own refusal, relayed
        for e in (*cluster.prefill, *cluster.decode):
            assert await by_source(s, e.url, "local_compute") == 0
    await _no_reservation_left(cluster)


async def test_a_dead_decode_engine_costs_no_request(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(broker="demand", decode=2)
    async with aiohttp.ClientSession() as s:
        await _control(s, cluster.decode[0].url, {"down": True})
        bodies = [{"prompt": prompt(40, str(i)), "max_tokens": 2} for i in range(8)]
        answers = await asyncio.gather(*(_complete(s, cluster.url, b) for b in bodies))
        assert len(answers) == 8
        assert all(a["usage"]["completion_tokens"] == 2 for a in answers)
        assert await by_source(s, cluster.decode[0].url, "local_compute") == 0
    await _no_reservation_left(cluster)


async def test_a_failing_prefill_engine_fails_over(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(broker="idle", prefill=2)
    async with aiohttp.ClientSession() as s:
        # prefill-1 is tried first: its /tokenize fails, then its completion
        await _control(s, cluster.prefill[0].url, {"fail_next": 2})
        answers = [await _complete(s, cluster.url, {"prompt": prompt(20, str(i)), "max_tokens": 2})
                   for i in range(3)]  # fmt: skip
        assert len(answers) == 3
        assert (
            await metric(s, cluster.url, "crossflow_gateway_failovers_total", role="prefill") >= 1
        )


async def test_a_client_that_goes_away_releases_its_reservation(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(broker="demand")
    async with aiohttp.ClientSession() as s:
        await _control(s, cluster.decode[0].url, {"slowdown": 200})
        await _control(s, cluster.decode[1].url, {"slowdown": 200})
        body = {"model": MODEL, "prompt": prompt(500), "max_tokens": 50, "stream": True}
        task = asyncio.create_task(s.post(f"{cluster.url}/v1/completions", json=body))
        await eventually(cluster.open_reservations, "the borrowed prompt holds a reservation")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(
            lambda: metric(s, cluster.url, "crossflow_gateway_releases_total", outcome="cancelled"),
            "a release marked cancelled",
        )
    await _no_reservation_left(cluster)


async def test_a_burst_borrows_no_more_than_the_leases_allow(start_cluster: StartCluster) -> None:
    """Prefill-heavy burst, 2 slots per decode node: some prompts borrow, the rest take the
    normal path, every one completes, and no reservation is left open."""
    cluster = await start_cluster(broker="demand", decode=2, slots=2)
    async with aiohttp.ClientSession() as s:
        bodies = [{"prompt": prompt(300, str(i)), "max_tokens": 4} for i in range(16)]
        answers = await asyncio.gather(*(_complete(s, cluster.url, b) for b in bodies))
        assert all(a["usage"]["completion_tokens"] == 4 for a in answers)
        borrowed = await metric(s, cluster.url, "crossflow_gateway_requests_total", path="borrowed")
        normal = await metric(s, cluster.url, "crossflow_gateway_requests_total", path="normal")
        assert borrowed >= 1 and normal >= 1 and borrowed + normal == 16
        local = sum([await by_source(s, d.url, "local_compute") for d in cluster.decode])
        assert local == borrowed * 300  # every borrowed prompt, and only those, prefilled there
    await _no_reservation_left(cluster)


async def test_a_new_lease_with_room_lets_prompts_borrow_again(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(broker="demand", decode=1, slots=0)
    assert cluster.broker is not None
    async with aiohttp.ClientSession() as s:
        await _complete(s, cluster.url, {"prompt": prompt(50), "max_tokens": 1})
        assert (
            await metric(s, cluster.url, "crossflow_gateway_requests_total", path="borrowed") == 0
        )
        await lend(cluster.broker, "decode-1", slots=4, version=2)
        await _complete(s, cluster.url, {"prompt": prompt(50, "x"), "max_tokens": 1})
        assert (
            await metric(s, cluster.url, "crossflow_gateway_requests_total", path="borrowed") == 1
        )


async def test_sglang_bootstrap_on_the_normal_path(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(protocol="sglang", broker="idle")
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": prompt(80), "max_tokens": 3, "stream": True}
        async with s.post(f"{cluster.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = [line for line in (await resp.text()).splitlines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[5:]) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


async def test_health_and_metrics_routes(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(broker="idle", decode=1)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{cluster.url}/health") as resp:
            assert resp.status == 200
        await _control(s, cluster.decode[0].url, {"down": True})

        async def unhealthy() -> bool:
            async with s.get(f"{cluster.url}/health") as resp:
                return resp.status == 503

        await eventually(unhealthy, "the gateway's health says 503 with its decode engine down")
        assert await metric(s, cluster.url, "crossflow_gateway_engine_up", node="decode-1") == 0
        await _control(s, cluster.decode[0].url, {"down": False})
        await eventually(
            lambda: metric(s, cluster.url, "crossflow_gateway_engine_up", node="decode-1"),
            "the engine back in rotation",
        )


async def _complete(s: aiohttp.ClientSession, url: str, body: dict[str, object]) -> dict:
    async with s.post(f"{url}/v1/completions", json={"model": MODEL, **body}) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def _control(s: aiohttp.ClientSession, url: str, body: dict[str, object]) -> None:
    async with s.post(f"{url}/control", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def _no_reservation_left(cluster: Cluster) -> None:
    async def none_open() -> bool:
        return await cluster.open_reservations() == 0

    await eventually(none_open, "every reservation released")


async def test_with_the_whole_prefill_pool_down_a_decode_engine_prefills(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(broker="idle", prefill=1, decode=1)
    async with aiohttp.ClientSession() as s:
        await _control(s, cluster.prefill[0].url, {"down": True})
        answer = await _complete(s, cluster.url, {"prompt": prompt(30), "max_tokens": 2})
        assert answer["usage"]["completion_tokens"] == 2
        assert await by_source(s, cluster.decode[0].url, "local_compute") >= 30
        assert (
            await metric(s, cluster.url, "crossflow_gateway_requests_total", path="fallback") == 1
        )
