"""vLLM-style P/D between two fake engines over real HTTP, as vLLM's disaggregated proxy drives
it, and the vLLM reader reading the fakes' metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.prom import parse
from crossflow_agent.sources.synthetic import EngineScript
from crossflow_agent.sources.vllm import VLLMReader
from crossflow_ctl.domain.telemetry import EngineSnapshot
from tests.agent.fake_engine.conftest import (
    chunks,
    client,
    eventually,
    serving,
    sse_events,
    state,
)

PROMPT = " ".join(f"p{i}" for i in range(300))  # 300 tokens
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's proxy sends the prefill engine."""
    out = {**body, "stream": False, "max_tokens": 1}
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


async def by_source(http: httpx.AsyncClient) -> dict[str, float | None]:
    expo = parse((await http.get("/metrics")).text)
    return {
        s: expo.total(BY_SOURCE, source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


async def test_two_hops_prefill_then_decode_with_the_returned_params() -> None:
    async with (
        serving(protocol="vllm", pd_role="prefill", engine_id="pre-1") as pre,
        serving(protocol="vllm", pd_role="decode") as dec,
        client(pre) as p_http,
        client(dec) as d_http,
    ):
        body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 8, "stream": True}
        body["stream_options"] = {"include_usage": True}
        r = await p_http.post("/v1/completions", json=prefill_body(body))
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["choices"][0]["text"] == "w0"
        assert answer["usage"]["completion_tokens"] == 1
        kv = answer["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == "pre-1" and kv["tp_size"] == 1
        assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == pre.port
        assert len(kv["remote_block_ids"]) == 19  # ceil(300 / 16)
        held = await state(pre)
        assert held["exported_kv"] == 1 and held["held_requests"] == 1
        assert held["kv_used_tokens"] == 301

        async with d_http.stream(
            "POST", "/v1/completions", json={**body, "kv_transfer_params": kv}
        ) as resp:
            assert resp.status_code == 200
            got = chunks(await sse_events(resp))
        assert "".join(c["choices"][0]["text"] for c in got if c["choices"]) == " ".join(
            f"w{i}" for i in range(8)
        )
        assert got[-1]["usage"]["completion_tokens"] == 8

        freed = await state(pre)  # the pull freed the prefill engine's copy
        assert freed["exported_kv"] == 0 and freed["held_requests"] == 0
        assert freed["kv_used_tokens"] == 0 and freed["kv_reserved_tokens"] == 0
        decoded = await state(dec)
        assert decoded["counters"]["prefill_compute"] == 0
        assert decoded["counters"]["prefill_transfer"] == 300

        assert await by_source(d_http) == {
            "local_compute": 0,
            "local_cache_hit": 0,
            "external_kv_transfer": 300,
        }
        assert await by_source(p_http) == {
            "local_compute": 300,
            "local_cache_hit": 0,
            "external_kv_transfer": 0,
        }

        # the same export cannot be pulled twice
        r = await d_http.post(
            "/v1/completions", json={**body, "stream": False, "kv_transfer_params": kv}
        )
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["param"] == "kv_transfer_params" and "KV transfer failed" in error["message"]


async def test_a_decode_for_kv_never_exported_fails_cleanly() -> None:
    async with (
        serving(protocol="vllm", pd_role="prefill") as pre,
        serving(protocol="vllm", pd_role="decode") as dec,
        client(dec) as http,
    ):
        kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": pre.engine_id,
            "remote_block_ids": [1, 2],
            "remote_host": "127.0.0.1",
            "remote_port": pre.port,
            "remote_request_id": "never-made",
            "tp_size": 1,
        }
        for stream in (False, True):
            r = await http.post(
                "/v1/completions",
                json={
                    "prompt": PROMPT,
                    "max_tokens": 4,
                    "stream": stream,
                    "kv_transfer_params": kv,
                },
            )
            assert r.status_code == 500
            error = r.json()["error"]
            assert error["type"] == "InternalServerError" and "never-made" in error["message"]
        missing = {k: v for k, v in kv.items() if k != "remote_request_id"}
        r = await http.post(
            "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": missing}
        )
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_transfer_params.remote_request_id"
        s = await state(dec)
        assert s["counters"]["prompt"] == 0 and s["kv_reserved_tokens"] == 0


async def test_decode_engine_prefills_a_plain_request_locally() -> None:
    async with serving(protocol="vllm", pd_role="decode") as dec, client(dec) as http:
        for _ in range(2):  # the second finds the first's blocks cached
            r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200 and "kv_transfer_params" not in r.json()
        assert await by_source(http) == {
            "local_compute": 300 + 300 - 288,
            "local_cache_hit": 288,
            "external_kv_transfer": 0,
        }
        r = await http.post(
            "/v1/completions",
            json={"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}},
        )
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_transfer_params.do_remote_decode"


async def test_exported_kv_is_freed_when_nobody_pulls_it() -> None:
    async with serving(protocol="vllm", pd_role="prefill", kv_ttl_s=0.05) as pre:
        async with client(pre) as http:
            body = prefill_body({"prompt": PROMPT})
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200

        async def expired() -> bool:
            return (await state(pre))["exported_kv"] == 0

        await eventually(expired, "the export expired")
        s = await state(pre)
        assert s["held_requests"] == 0 and s["kv_reserved_tokens"] == 0


async def test_the_vllm_reader_reads_the_fake_over_http() -> None:
    script = EngineScript(kv_total_tokens=160_000)
    async with serving(script, protocol="vllm") as server, client(server) as http:
        tasks = [
            asyncio.create_task(
                http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5_000})
            )
            for _ in range(3)
        ]
        source = PrometheusSource(f"{server.url}/metrics", VLLMReader(), client=http)
        try:

            async def all_running() -> bool:
                return (await state(server))["running_requests"] == 3

            await eventually(all_running, "three requests decoding")
            await source.scrape()

            async def decoded() -> EngineSnapshot | None:  # a window with decode steps in it
                snap = await source.scrape()
                return snap if snap.generation_rate_tps > 0 and snap.itl_p50_ms else None

            snap = await eventually(decoded, "a scrape window with decode steps")
            assert snap.source == "vllm" and snap.running_requests == 3
            assert snap.kv_total_tokens == 160_000 and snap.kv_used_tokens > 900
            assert snap.queued_requests == 0 and snap.kv_waiting_requests == 0
            expo = parse((await http.get("/metrics")).text)
            assert expo.total("vllm:time_to_first_token_seconds_count") == 3
            assert expo.total("vllm:request_prefill_time_seconds_count") == 3
            assert (expo.total("vllm:iteration_tokens_total_count") or 0) > 0
            for labels in expo.labels_of("vllm:num_requests_running"):
                assert labels["model_name"] == "synthetic"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
