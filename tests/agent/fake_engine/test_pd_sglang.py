"""SGLang-style P/D between two fake engines over real HTTP, as SGLang's router drives it: the
same request, with bootstrap fields, to a prefill and a decode engine at once."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from crossflow_agent.sources.prom import parse
from tests.agent.fake_engine.conftest import chunks, client, serving, sse_events, state

PROMPT = " ".join(f"s{i}" for i in range(500))


def with_bootstrap(body: dict[str, Any], port: int | None, room: int) -> dict[str, Any]:
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


async def test_bootstrap_handshake_between_prefill_and_decode() -> None:
    async with (
        serving(pd_role="prefill") as pre,
        serving(pd_role="decode") as dec,
        client(pre) as p_http,
        client(dec) as d_http,
    ):
        assert pre.bootstrap_port is not None and dec.bootstrap_port is None
        async with httpx.AsyncClient(trust_env=False) as boot:
            r = await boot.get(f"http://127.0.0.1:{pre.bootstrap_port}/health")
            assert r.status_code == 200
        room = random.getrandbits(63)
        body = with_bootstrap(
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "stream": True},
            pre.bootstrap_port,
            room,
        )

        async def decode() -> list[dict[str, Any]]:
            async with d_http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                return chunks(await sse_events(r))

        # the decode request goes first: it waits for the room the prefill then makes ready
        decoding = asyncio.create_task(decode())
        prefill = await p_http.post("/v1/chat/completions", json={**body, "stream": False})
        assert prefill.status_code == 200, prefill.text
        assert prefill.json()["usage"]["completion_tokens"] == 1
        got = await decoding
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in got)
        assert text == "w0 w1 w2 w3 w4 w5"

        p_state, d_state = await state(pre), await state(dec)
        assert p_state["ready_rooms"] == 0 and p_state["kv_reserved_tokens"] == 0
        prompt_tokens = prefill.json()["usage"]["prompt_tokens"]
        assert p_state["counters"]["prefill_compute"] == prompt_tokens
        assert d_state["counters"]["prefill_compute"] == 0
        assert d_state["counters"]["prefill_transfer"] == prompt_tokens
        expo = parse((await d_http.get("/metrics")).text)
        assert expo.total("sglang:num_requests_total") == 1
        assert expo.total("sglang:generation_tokens_total") == 6


async def test_a_decode_waiting_on_a_room_that_never_comes_times_out() -> None:
    async with (
        serving(pd_role="prefill") as pre,
        serving(pd_role="decode", bootstrap_timeout_s=0.2) as dec,
        client(dec) as http,
    ):
        body = with_bootstrap({"prompt": PROMPT, "max_tokens": 4}, pre.bootstrap_port, 7)
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["param"] == "bootstrap_room" and "7 not ready" in error["message"]
        s = await state(dec)
        assert s["counters"]["prompt"] == 0 and s["kv_reserved_tokens"] == 0
        assert (await state(pre))["ready_rooms"] == 0


async def test_decode_without_bootstrap_prefills_locally_and_prefill_requires_a_room() -> None:
    async with (
        serving(pd_role="prefill") as pre,
        serving(pd_role="decode") as dec,
        client(pre) as p_http,
        client(dec) as d_http,
    ):
        r = await d_http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "w0 w1 w2"
        s = await state(dec)
        assert s["counters"]["prefill_compute"] == 500 and s["counters"]["prefill_transfer"] == 0
        r = await p_http.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
        body = with_bootstrap({"prompt": PROMPT}, pre.bootstrap_port, 11)
        del body["bootstrap_port"]
        r = await d_http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_port"
