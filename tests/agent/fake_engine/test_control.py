"""Fault controls, health, and a quiet shutdown of the fake engine."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.agent.fake_engine.conftest import client, eventually, serving, state

BODY = {"prompt": "a b c", "max_tokens": 2}


async def test_down_answers_503_on_health_and_every_api_call() -> None:
    async with serving(protocol="vllm") as server, client(server) as http:
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/control", json={"down": True})
        assert r.status_code == 200 and r.json()["down"] is True
        assert (await http.get("/health")).status_code == 503
        for method, path in (
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("POST", "/tokenize"),
        ):
            r = await http.request(method, path, json=BODY)
            assert r.status_code == 503, path
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert (await http.get("/metrics")).status_code == 200  # the fake's own routes stay
        assert (await http.get("/healthz")).text == "ok\n"
        assert (await state(server))["counters"]["prompt"] == 0
        await http.post("/control", json={"down": False})
        assert (await http.get("/health")).status_code == 200
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200


async def test_fail_next_fails_that_many_api_requests() -> None:
    async with serving() as server, client(server) as http:
        r = await http.post("/control", json={"fail_next": 2})
        assert r.json()["fail_next"] == 2
        statuses = [(await http.post("/v1/completions", json=BODY)).status_code for _ in range(3)]
        assert statuses == [500, 500, 200]
        s = await state(server)
        assert s["fail_next"] == 0 and s["counters"]["requests"] == 1


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"down": "yes"}, "down"),
        ({"fail_next": -1}, "fail_next"),
        ({"fail_next": True}, "fail_next"),
        ({"down": True, "slowdown": 0}, "slowdown"),
        ({"down": True, "colour": 1}, "colour"),
    ],
)
async def test_bad_controls_name_the_field_and_change_nothing(body: object, needle: str) -> None:
    async with serving() as server, client(server) as http:
        r = await http.post("/control", json=body)
        assert r.status_code == 400 and r.json()["error"].startswith(needle)
        s = await state(server)
        assert s["down"] is False and s["fail_next"] == 0 and s["slowdown"] == 1.0


async def test_close_with_streams_in_flight_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with serving() as server:
        http = client(server)
        body = {"prompt": "x y", "max_tokens": 20_000, "stream": True}
        lines: list[str] = []

        async def stream() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    lines.append(line)

        task = asyncio.create_task(stream())

        async def streaming() -> bool:
            return any(line.startswith("data: {") for line in lines)

        await eventually(streaming, "a stream under way")
        await server.close()
        await asyncio.wait_for(task, 30)
        await http.aclose()
    assert lines[-2:] == ["data: [DONE]", ""]
    assert '"ServiceUnavailableError"' in lines[-4]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_client_disconnects_log_no_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with serving() as server:
        for stream in (True, False):
            async with client(server) as http:
                body = {"prompt": "x y", "max_tokens": 20_000, "stream": stream}
                task = asyncio.create_task(http.post("/v1/completions", json=body))

                async def running() -> bool:
                    return (await state(server))["running_requests"] == 1

                await eventually(running, "the request running")
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

            async def idle() -> bool:
                return (await state(server))["kv_reserved_tokens"] == 0

            await eventually(idle, "the request aborted")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
