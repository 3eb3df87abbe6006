"""A client that hangs up right after ``[DONE]`` is still counted.

The engine below streams its answer and ``[DONE]`` but keeps its response open until the test
lets it go, so the gateway is still relaying (waiting for the engine's end of stream) when the
client, having read ``[DONE]``, closes its connection. aiohttp then cancels the gateway's
handler. The request was served in full: ``crossflow_gateway_requests_total`` must count it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from crossflow_ctl.gateway.app import GatewayServer
from crossflow_ctl.gateway.settings import GatewaySettings
from tests.gateway.conftest import eventually, metric

MODEL = "stub-model"


@dataclass
class StubEngine:
    """vLLM's two hops, just enough: a prefill answer with ``kv_transfer_params``, and a
    streamed decode answer held open after ``[DONE]`` until ``finish`` is set."""

    finish: asyncio.Event = field(default_factory=asyncio.Event)
    send_done: asyncio.Event = field(default_factory=asyncio.Event)
    """``[DONE]`` is written once this is set (set from the start unless a test clears it)."""
    decode_closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return web.json_response(
                {"choices": [{"index": 0, "text": "a"}], "kv_transfer_params": {"k": 1}}
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for text in ("a", "b"):
                chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await self.send_done.wait()
            await response.write(b"data: [DONE]\n\n")
            await self.finish.wait()
            await response.write_eof()
        finally:
            self.decode_closed.set()
        return response

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()


@pytest.fixture
async def stub() -> AsyncIterator[tuple[StubEngine, str]]:
    engine = StubEngine()
    engine.send_done.set()
    app = web.Application()
    app.router.add_post("/v1/completions", engine.completions)
    app.router.add_get("/health", engine.health)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        engine.finish.set()
        await runner.cleanup()


async def _gateway(url: str) -> GatewayServer:
    """A gateway without a broker in front of the stub (both pools)."""
    settings = GatewaySettings(
        listen="127.0.0.1:0",
        broker=None,
        model=MODEL,
        prefill=[{"node_id": "prefill-1", "url": url}],
        decode=[{"node_id": "decode-1", "url": url}],
        health_period_s=0.2,
    )
    gateway = GatewayServer(settings)
    await gateway.start()
    return gateway


async def test_a_client_hanging_up_after_done_is_counted(stub: tuple[StubEngine, str]) -> None:
    engine, url = stub
    gateway = await _gateway(url)
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{gateway.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                seen = b""
                while b"data: [DONE]" not in seen:
                    chunk = await resp.content.readany()
                    assert chunk, "the stream ended before [DONE]"
                    seen += chunk
                resp.close()  # hang up: the gateway has not seen the engine's end yet
            # The gateway closes its engine call when its handler is cancelled.
            await asyncio.wait_for(engine.decode_closed.wait(), timeout=30)
            count = await eventually(
                lambda: metric(
                    s, gateway.url, "crossflow_gateway_requests_total", path="normal", code="200"
                ),
                "the request counted in crossflow_gateway_requests_total",
            )
            assert count == 1
    finally:
        await gateway.close()


async def test_a_client_hanging_up_mid_answer_is_counted_as_499(
    stub: tuple[StubEngine, str],
) -> None:
    """Cut short before ``[DONE]``: not a served answer, whatever status its headers had."""
    engine, url = stub
    engine.send_done.clear()  # the engine streams its tokens and stalls before [DONE]
    gateway = await _gateway(url)
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{gateway.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert await resp.content.readany(), "a first chunk"
                resp.close()  # hang up before [DONE]
            await asyncio.wait_for(engine.decode_closed.wait(), timeout=30)
            count = await eventually(
                lambda: metric(
                    s, gateway.url, "crossflow_gateway_requests_total", path="normal", code="499"
                ),
                "the request counted as 499 in crossflow_gateway_requests_total",
            )
            assert count == 1
            served = await metric(
                s, gateway.url, "crossflow_gateway_requests_total", path="normal", code="200"
            )
            assert not served
    finally:
        await gateway.close()
