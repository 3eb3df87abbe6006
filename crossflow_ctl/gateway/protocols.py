"""The engines' own P/D protocols: how the normal path's two servers share one request.

* vLLM (``kv_transfer_params``, as its disaggregated proxy does): the prefill engine gets the
  request with ``kv_transfer_params: {do_remote_decode: true}``, ``max_tokens`` 1 and no
  streaming; its answer carries ``kv_transfer_params`` saying where the KV is; the decode
  engine gets the original request with those params and pulls the KV (its KV connector).
* SGLang (bootstrap, as its router does): both engines get the request with the prefill
  engine's ``bootstrap_host``/``bootstrap_port`` and a fresh ``bootstrap_room``, at once; the
  decode engine receives the KV through the room and answers the client.

A borrowed prompt needs neither: the decode engine gets the plain request and prefills it
itself (a vLLM decode engine must run a ``kv_both`` connector for that; SGLang's decode mode
prefills a request that names no bootstrap room).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp

from crossflow_ctl.gateway.engines import Engine
from crossflow_ctl.gateway.upstream import EngineFailed, call_json, open_call

VLLM_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

PrefillDone = Callable[[], None]


class ClientError(Exception):
    """The engine refused the request as the client's fault (4xx): relay it, do not retry."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body


class PDProtocol(Protocol):
    name: str

    async def normal(
        self,
        session: aiohttp.ClientSession,
        prefill: Engine,
        decode: Engine,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        prefill_done: PrefillDone,
    ) -> aiohttp.ClientResponse:
        """Run the prefill hop and open the decode hop; ``prefill_done`` once the prefill
        engine is through with the prompt. Raises EngineFailed naming the engine at fault,
        ClientError for a 4xx."""
        ...


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as vLLM's prefill engine gets it: one token, unstreamed, KV kept."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(VLLM_PREFILL_PARAMS))
    if "min_tokens" in out:
        out["min_tokens"] = 0
    return out


class VLLMProtocol:
    name = "vllm"

    async def normal(
        self,
        session: aiohttp.ClientSession,
        prefill: Engine,
        decode: Engine,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        prefill_done: PrefillDone,
    ) -> aiohttp.ClientResponse:
        try:
            status, answer = await call_json(session, prefill, path, prefill_body(body), headers)
        finally:
            prefill_done()
        if status >= 400:
            raise ClientError(status, answer)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise EngineFailed(
                prefill, "answer has no kv_transfer_params (is a KV connector configured?)"
            )
        return await open_call(
            session, decode, path, {**body, "kv_transfer_params": params}, headers
        )


class SGLangProtocol:
    name = "sglang"

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    async def normal(
        self,
        session: aiohttp.ClientSession,
        prefill: Engine,
        decode: Engine,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        prefill_done: PrefillDone,
    ) -> aiohttp.ClientResponse:
        room = secrets.randbits(63)
        joined = {
            **body,
            "bootstrap_host": prefill.endpoint.host,
            "bootstrap_port": prefill.endpoint.bootstrap_port,
            "bootstrap_room": room,
        }
        hop = asyncio.ensure_future(
            call_json(session, prefill, path, {**joined, "stream": False}, headers)
        )
        hop.add_done_callback(lambda _: prefill_done())
        try:
            return await open_call(session, decode, path, joined, headers)
        except BaseException:
            hop.cancel()
            with contextlib.suppress(BaseException):
                await hop
            raise
        finally:
            self._watch(hop, prefill)

    def _watch(self, hop: Awaitable[Any], prefill: Engine) -> None:
        """The prefill hop's answer is not the client's; it is awaited in the background so
        its connection is released (its failure shows on the decode hop, which times out)."""
        task = asyncio.ensure_future(hop)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task


def protocol_for(name: str) -> VLLMProtocol | SGLangProtocol:
    return SGLangProtocol() if name == "sglang" else VLLMProtocol()
