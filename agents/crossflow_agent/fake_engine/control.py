"""The fake engine's own routes: metrics, state, health, bulk synthetic load and fault controls.

    GET  /metrics    Prometheus text: vLLM format with --protocol vllm, else SGLang format
    GET  /state      the engine's state as JSON (plus the fake's: exports, rooms, faults, ...)
    GET  /healthz    "ok" (the fake process is alive; not affected by "down")
    GET  /health     200, or 503 while "down" (as an engine's health route)
    POST /requests   {"prompt_tokens", "output_tokens", "cached_tokens"?, "borrowed"?, "count"?}
                     -> 200 {"accepted": n, "queued_requests": q}: load with no client behind it
    POST /control    {"slowdown"?: x (0.01..1000), "down"?: bool, "fail_next"?: n (0..1e6)}
                     -> 200 state; all fields are checked before any is applied

These answer errors as ``{"error": "field: message"}`` (400 names the field and changes nothing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from crossflow_agent.fake_engine.errors import ControlError, first_error
from crossflow_agent.sources.synthetic import EngineRequest, SyntheticEngine

MAX_COUNT = 10_000
MAX_FAIL_NEXT = 1_000_000
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Faults:
    down: bool = False
    """Health answers 503 and every API call 503."""
    fail_next: int = 0
    """The next this many API requests answer 500."""


class Controls:
    def __init__(
        self,
        engine: SyntheticEngine,
        faults: Faults,
        metrics_format: str,
        extra_state: Callable[[], dict[str, Any]],
    ) -> None:
        self.engine, self.faults = engine, faults
        self.metrics_format = "vllm" if metrics_format == "vllm" else "sglang"
        self.extra_state = extra_state

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/state", self.state, allow_head=False)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/health", self.health)
        app.router.add_post("/requests", self.requests)
        app.router.add_post("/control", self.control)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.engine.render("vllm" if self.metrics_format == "vllm" else "sglang")
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(self._state())

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def health(self, request: web.Request) -> web.Response:
        if self.faults.down:
            return web.json_response({"error": "engine is down (/control down)"}, status=503)
        return web.Response()

    async def requests(self, request: web.Request) -> web.Response:
        data = await _json_object(request)
        count = data.pop("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
            raise ControlError(400, f"count: must be an integer in 1..{MAX_COUNT}")
        try:
            spec = EngineRequest.model_validate(data)
        except ValidationError as exc:
            field, msg = first_error(exc)
            raise ControlError(400, f"{field}: {msg}") from None
        accepted = 0
        try:
            for _ in range(count):
                self.engine.submit(spec)
                accepted += 1
        except OverflowError as exc:
            if accepted == 0:
                raise ControlError(503, str(exc)) from None
        return web.json_response(
            {"accepted": accepted, "queued_requests": len(self.engine.waiting)}
        )

    async def control(self, request: web.Request) -> web.Response:
        data = await _json_object(request)
        unknown = set(data) - {"slowdown", "down", "fail_next"}
        if unknown:
            raise ControlError(400, f"{sorted(unknown)[0]}: unknown control")
        slowdown = data.get("slowdown")
        if "slowdown" in data:
            if isinstance(slowdown, bool) or not isinstance(slowdown, int | float):
                raise ControlError(400, "slowdown: must be a number")
            if not 0.01 <= float(slowdown) <= 1000.0:
                raise ControlError(400, "slowdown: must be within 0.01..1000")
        if "down" in data and not isinstance(data["down"], bool):
            raise ControlError(400, "down: must be true or false")
        fail_next = data.get("fail_next", 0)
        if (
            not isinstance(fail_next, int)
            or isinstance(fail_next, bool)
            or not 0 <= fail_next <= MAX_FAIL_NEXT
        ):
            raise ControlError(400, f"fail_next: must be an integer in 0..{MAX_FAIL_NEXT}")
        if isinstance(slowdown, int | float):
            self.engine.advance()  # time so far ran at the old speed
            self.engine.slowdown = float(slowdown)
        if "down" in data:
            self.faults.down = data["down"]
        if "fail_next" in data:
            self.faults.fail_next = fail_next
        return web.json_response(self._state())

    def _state(self) -> dict[str, Any]:
        return {
            **self.engine.state(),
            "down": self.faults.down,
            "fail_next": self.faults.fail_next,
            **self.extra_state(),
        }


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ControlError(400, f"body: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ControlError(400, "body: must be a JSON object")
    return data
