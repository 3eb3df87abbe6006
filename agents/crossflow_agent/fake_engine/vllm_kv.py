"""vLLM-style P/D: a prefill engine exports a request's KV, a decode engine pulls it.

As vLLM's disaggregated proxy drives NIXL-style connectors: the proxy sends the request to a
prefill engine with ``kv_transfer_params: {"do_remote_decode": true}`` (and ``max_tokens: 1``,
``stream: false``); the answer carries top-level ``kv_transfer_params`` (``do_remote_prefill:
true``, ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``,
``remote_request_id``, ``tp_size``) which the proxy puts into the same request sent to a decode
engine. Here the "transfer" is a fake-only HTTP call from the decode engine to
``remote_host:remote_port`` (the prefill engine's own API port)::

    POST /fake/kv/pull {"remote_request_id": str, "remote_engine_id"?: str}
      200 {"remote_request_id", "prompt_tokens": n, "remote_block_ids": [...]}  (KV freed)
      404 OpenAI-style error: no such export (never made, already pulled, or expired)

An export not pulled within its TTL is freed.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError
from yarl import URL

from crossflow_agent.fake_engine.driver import EngineDriver, Run
from crossflow_agent.fake_engine.errors import ApiError, bad_request
from crossflow_agent.fake_engine.prefix_cache import BLOCK_TOKENS
from crossflow_agent.fake_engine.schemas import KvTransferParams, Lenient

PULL_PATH = "/fake/kv/pull"
PARAM = "kv_transfer_params"


class PullRequest(Lenient):
    remote_request_id: str
    remote_engine_id: str | None = None


@dataclass
class Export:
    request_id: str
    run: Run
    prompt_tokens: int
    block_ids: list[int]
    timer: asyncio.TimerHandle


class KvExports:
    """The prefill side: KV held for decode engines to pull, each for ``ttl_s`` at most."""

    def __init__(self, driver: EngineDriver, engine_id: str, ttl_s: float) -> None:
        self.driver, self.engine_id, self.ttl_s = driver, engine_id, ttl_s
        self._exports: dict[str, Export] = {}
        self._blocks = itertools.count()

    def __len__(self) -> int:
        return len(self._exports)

    def export(self, run: Run, prompt_tokens: int, host: str, port: int) -> dict[str, Any]:
        """Hold ``run``'s KV; the ``kv_transfer_params`` a decode engine needs to pull it."""
        request_id = uuid.uuid4().hex
        blocks = -(-prompt_tokens // BLOCK_TOKENS)
        block_ids = [next(self._blocks) for _ in range(blocks)]
        timer = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, request_id)
        self._exports[request_id] = Export(request_id, run, prompt_tokens, block_ids, timer)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": block_ids,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": request_id,
            "tp_size": 1,
        }

    def _expire(self, request_id: str) -> None:
        export = self._exports.pop(request_id, None)
        if export is not None:
            self.driver.release(export.run)

    def pull(self, request_id: str, engine_id: str | None) -> Export | None:
        if engine_id is not None and engine_id != self.engine_id:
            return None
        export = self._exports.pop(request_id, None)
        if export is not None:
            export.timer.cancel()
            self.driver.release(export.run)
        return export

    def close(self) -> None:
        for request_id in list(self._exports):
            self._exports[request_id].timer.cancel()
            self._expire(request_id)

    async def handle_pull(self, request: web.Request) -> web.Response:
        try:
            body = PullRequest.model_validate(await request.json())
        except ValueError as exc:
            if isinstance(exc, ValidationError):
                raise bad_request(exc) from None
            raise ApiError(400, "body: not a JSON object", "body") from None
        export = self.pull(body.remote_request_id, body.remote_engine_id)
        if export is None:
            raise ApiError(
                404,
                f"no KV exported as {body.remote_request_id} on engine {self.engine_id} "
                "(never made, already pulled, or expired)",
                "remote_request_id",
            )
        return web.json_response(
            {
                "remote_request_id": export.request_id,
                "prompt_tokens": export.prompt_tokens,
                "remote_block_ids": export.block_ids,
            }
        )


async def pull_remote_kv(
    session: aiohttp.ClientSession, params: KvTransferParams, timeout_s: float
) -> int:
    """The decode side: pull the KV ``params`` name from its prefill engine; its prompt tokens.
    Missing fields are 400; a failed pull (unknown export, engine unreachable) is 500."""
    for name in ("remote_host", "remote_port", "remote_request_id"):
        if getattr(params, name) is None:
            raise ApiError(
                400, f"{PARAM}.{name}: required with do_remote_prefill", f"{PARAM}.{name}"
            )
    assert params.remote_host is not None and params.remote_port is not None
    url = URL.build(scheme="http", host=params.remote_host, port=params.remote_port, path=PULL_PATH)
    where = f"{params.remote_host}:{params.remote_port}"
    payload = {
        "remote_request_id": params.remote_request_id,
        "remote_engine_id": params.remote_engine_id,
    }
    try:
        async with session.post(
            url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            data = await resp.json(content_type=None)
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ApiError(500, f"KV transfer failed: prefill engine {where}: {exc!r}", PARAM) from None
    if status != 200 or not isinstance(data, dict) or "prompt_tokens" not in data:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        raise ApiError(
            500, f"KV transfer failed: prefill engine {where} answered {status}: {message}", PARAM
        )
    return int(data["prompt_tokens"])
