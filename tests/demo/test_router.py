"""The demo's client against a stand-in gateway over real HTTP: what it sends, what it measures,
and what it counts as lost."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from crossflow_ctl.demo.router import Router
from crossflow_ctl.demo.trace import Session, Trace, Turn

FIRST_TOKEN_S = 0.15


class StandIn:
    """Answers /v1/completions as the gateway does (SSE, X-Crossflow-* headers); a prompt whose
    first word is ``fail``/``cut`` gets a 503 / a stream cut before [DONE]."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.arrived = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append(time.monotonic())
        self.arrived.set()
        words = body["prompt"].split()
        if len(self.bodies) == 2:  # the second request: a 503 (lost)
            return web.json_response({"error": {"message": "no engine"}}, status=503)
        path = "borrowed" if len(words) > 100 else "normal"
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "X-Crossflow-Path": path,
                "X-Crossflow-Node": "decode-7",
            }
        )
        await response.prepare(request)
        await asyncio.sleep(FIRST_TOKEN_S)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[StandIn, str]]:
    app = web.Application()
    served = StandIn()
    app.router.add_post("/v1/completions", served.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield served, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_turns_are_streamed_completions_timed_and_closed_loop(
    stand_in: tuple[StandIn, str],
) -> None:
    served, url = stand_in
    session = Session("s", (Turn(100, 20, 300), Turn(30, 420, 3, think_s=0.2)), start_s=0.0)
    other = Session("o", (Turn(50, 0, 4),), start_s=0.05)
    router = Router(Trace("t", (session, other)), url, salt="a", max_output_tokens=5)
    await router.run(asyncio.Event())
    stats = router.stats
    assert (stats.released, stats.finished, stats.lost) == (3, 2, 1)
    assert "gateway answered 503" in stats.errors[0]
    # prompts: one word a token, the turn's whole prompt; max_tokens capped at 5
    assert [len(b["prompt"].split()) for b in served.bodies] == [120, 50, 450]
    assert [b["max_tokens"] for b in served.bodies] == [5, 4, 3]
    assert all(b["stream"] for b in served.bodies)
    assert served.bodies[2]["prompt"].startswith(served.bodies[0]["prompt"])
    # the second turn came after the first finished plus its think time
    assert served.arrivals[2] - served.arrivals[0] >= FIRST_TOKEN_S + 0.2
    assert set(stats.ttft_by_request) == {("s", 0), ("s", 1)}
    assert all(t >= FIRST_TOKEN_S * 1000 for t in stats.ttft_ms)
    assert stats.path_by_request == {("s", 0): "borrowed", ("s", 1): "borrowed"}
    assert stats.borrowed_by_node() == {"decode-7": 2}
    assert stats.output_tokens == 5 + 3
    assert (stats.uncached_tokens, stats.borrowed_uncached_tokens) == (130, 130)


async def test_stopping_cancels_what_is_in_flight_without_counting_it_lost(
    stand_in: tuple[StandIn, str],
) -> None:
    served, url = stand_in
    session = Session("s", (Turn(10, 0, 3),), start_s=0.0)
    router = Router(Trace("t", (session,)), url, salt="a")
    stop = asyncio.Event()
    replay = asyncio.create_task(router.run(stop))
    await served.arrived.wait()
    stop.set()
    await replay
    assert (router.stats.released, router.stats.finished, router.stats.lost) == (1, 0, 0)
