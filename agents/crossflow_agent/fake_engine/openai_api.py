"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions, /tokenize.

A request is tokenized (:mod:`.tokenizer`), placed by the P/D rules (:mod:`.pd`), looked up in
the prefix cache (local prefill only) and run as a job of the synthetic engine; its tokens are
answered (or streamed as SSE) as the engine makes them. A client that goes away aborts its job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from aiohttp_sse import EventSourceResponse, sse_response
from pydantic import BaseModel, ValidationError

from crossflow_agent.fake_engine.driver import EngineDriver, Run
from crossflow_agent.fake_engine.errors import ApiError, bad_request
from crossflow_agent.fake_engine.pd import PdContext, Placement
from crossflow_agent.fake_engine.prefix_cache import block_hashes
from crossflow_agent.fake_engine.responses import Reply, usage
from crossflow_agent.fake_engine.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerateParams,
    TokenizeRequest,
)
from crossflow_agent.fake_engine.tokenizer import (
    output_piece,
    output_text,
    render_chat,
    stop_index,
    tokenize,
)
from crossflow_agent.sources.synthetic import EngineRequest, JobState

M = TypeVar("M", bound=BaseModel)
OWNED_BY = "crossflow-fake"


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (413 past the app's client_max_size, 400 when not JSON)."""
    raw = await request.read()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body: not JSON ({exc})", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body: must be a JSON object", "body")
    return data


async def parse(request: web.Request, model: type[M]) -> M:
    try:
        return model.model_validate(await read_json(request))
    except ValidationError as exc:
        raise bad_request(exc) from None


@dataclass
class _Plan:
    """What one generation request answers: its engine job's shape and its visible text."""

    prompt_tokens: int
    cached_tokens: int
    engine_tokens: int
    visible_tokens: int
    finish: str

    def use(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.engine_tokens, self.cached_tokens)


class OpenAIApi:
    def __init__(
        self,
        driver: EngineDriver,
        pd: PdContext,
        *,
        model: str,
        max_model_len: int,
    ) -> None:
        self.driver, self.pd = driver, pd
        self.model, self.max_model_len = model, max_model_len

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": OWNED_BY,
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await parse(request, TokenizeRequest)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt and messages", "prompt")
        text = body.prompt if body.messages is None else render_chat(body.messages)
        assert text is not None
        tokens = tokenize(text)
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await parse(request, CompletionRequest)
        tokens = tokenize(body.prompt) if isinstance(body.prompt, str) else body.prompt
        return await self._generate(request, body, tokens, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await parse(request, ChatRequest)
        return await self._generate(request, body, tokenize(render_chat(body.messages)), chat=True)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    def _check_lengths(self, params: GenerateParams, prompt: int, chat: bool) -> None:
        field = "messages" if chat else "prompt"
        if prompt == 0:
            raise ApiError(400, f"{field}: must not be empty", field)
        out, limit = params.output_tokens, self.max_model_len
        kv_total = self.driver.engine.script.kv_total_tokens
        if prompt >= limit:
            raise ApiError(
                400,
                f"{field}: this model's maximum context length is {limit} tokens; "
                f"the prompt has {prompt}",
                field,
            )
        out_field = "max_tokens"
        if params.max_tokens is None and params.max_completion_tokens is not None:
            out_field = "max_completion_tokens"
        if prompt + out > limit:
            raise ApiError(
                400,
                f"{out_field}: this model's maximum context length is {limit} tokens; you "
                f"requested {prompt + out} ({prompt} in the prompt, {out} in the completion)",
                out_field,
            )
        if prompt + out > kv_total:
            raise ApiError(
                400,
                f"{out_field}: {prompt + out} tokens do not fit this engine's KV cache "
                f"({kv_total} tokens)",
                out_field,
            )

    async def _generate(
        self, request: web.Request, params: GenerateParams, token_ids: list[int], *, chat: bool
    ) -> web.StreamResponse:
        self._check_model(params.model)
        self._check_lengths(params, len(token_ids), chat)
        placement = await self.pd.place(params, len(token_ids))
        run: Run | None = None
        response: web.StreamResponse
        handed = False
        try:
            plan, run = self._submit(params, placement, token_ids)
            reply = Reply(chat, self.model, request.headers.get("X-Request-Id"))
            if params.stream:
                response = await self._stream(request, params, plan, reply, run, placement)
            else:
                job = await run.settle()
                if job.state not in (JobState.FINISHED, JobState.HELD):
                    raise ApiError(503, f"request {job.state.value}: the engine is closing")
                extra = placement.on_held(run) if placement.on_held is not None else {}
                text = output_text(plan.visible_tokens)
                response = web.json_response(reply.full(text, plan.finish, plan.use(), extra))
            handed = True
            return response
        finally:
            if not handed:
                if run is not None:
                    self.driver.abort(run)
                if placement.on_failed is not None:
                    placement.on_failed()

    def _submit(
        self, params: GenerateParams, placement: Placement, token_ids: list[int]
    ) -> tuple[_Plan, Run]:
        prompt = len(token_ids)
        engine_tokens = visible = placement.output_tokens
        finish = "length"
        stop = stop_index(params.stop or [], engine_tokens)
        if stop is not None:  # the stop word is generated, not shown
            engine_tokens, visible, finish = stop + 1, stop, "stop"
        hashes = block_hashes(token_ids)
        cached = self.driver.cache.match(hashes, prompt) if placement.local else 0
        spec = EngineRequest(
            prompt_tokens=prompt, output_tokens=engine_tokens, cached_tokens=cached
        )
        try:
            run = self.driver.submit(
                spec,
                hashes=hashes,
                kv_transferred=placement.kv_transferred,
                keep_kv=placement.keep_kv,
            )
        except OverflowError as exc:
            raise ApiError(503, str(exc)) from None
        return _Plan(prompt, cached, engine_tokens, visible, finish), run

    async def _stream(
        self,
        request: web.Request,
        params: GenerateParams,
        plan: _Plan,
        reply: Reply,
        run: Run,
        placement: Placement,
    ) -> EventSourceResponse:
        async with sse_response(request, sep="\n", allow_all_methods=True) as sse:
            try:
                await self._send_tokens(sse, params, plan, reply, run, placement)
            except (ConnectionResetError, TimeoutError):  # the client went away, or stalled
                self.driver.abort(run)
                if placement.on_failed is not None:
                    placement.on_failed()
        return sse

    async def _send_tokens(
        self,
        sse: EventSourceResponse,
        params: GenerateParams,
        plan: _Plan,
        reply: Reply,
        run: Run,
        placement: Placement,
    ) -> None:
        if reply.chat:
            await _send(sse, reply.chunk("", None, role=True))
        sent = 0
        while True:
            job = run.job
            assert job is not None
            while sent < min(job.generated, plan.engine_tokens):
                last = sent == plan.engine_tokens - 1
                text = output_piece(sent) if sent < plan.visible_tokens else ""
                await _send(sse, reply.chunk(text, plan.finish if last else None))
                sent += 1
            if run.settled:
                break
            await run.changed()
        ok = job.state in (JobState.FINISHED, JobState.HELD)
        if ok and params.include_usage:
            await _send(sse, reply.usage_chunk(plan.use()))
        if not ok:
            error = ApiError(503, f"request {job.state.value}: the engine is closing")
            await _send(sse, error.body())
        await sse.send("[DONE]")
        if ok and placement.on_held is not None:  # handed over once the answer is out
            placement.on_held(run)
        elif not ok and placement.on_failed is not None:
            placement.on_failed()


async def _send(sse: EventSourceResponse, data: dict[str, Any]) -> None:
    await sse.send(json.dumps(data, separators=(",", ":")))
