"""The fake engine's OpenAI-compatible API over real HTTP: shapes, streams, usage, errors."""

from __future__ import annotations

import asyncio
import json
import zlib

import openai
import pytest

from crossflow_agent.fake_engine.tokenizer import render_chat, tokenize
from crossflow_agent.sources.prom import parse
from crossflow_agent.sources.synthetic import EngineScript
from tests.agent.fake_engine.conftest import (
    LIMIT_S,
    chunks,
    client,
    eventually,
    serving,
    sse_events,
    state,
)

PROMPT = " ".join(f"word{i}" for i in range(40))  # 40 tokens


def test_tokenizer_is_one_crc_per_word() -> None:
    assert tokenize("hello  world\nhello") == [
        zlib.crc32(b"hello") % 32000,
        zlib.crc32(b"world") % 32000,
        zlib.crc32(b"hello") % 32000,
    ]
    assert tokenize("") == []

    class Msg:
        def __init__(self, role: str, content: str) -> None:
            self.role, self.content = role, content

    text = render_chat([Msg("system", "be brief"), Msg("user", "hi there")])
    assert text == "<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n"


async def test_tokenize_route_and_models() -> None:
    async with serving(protocol="vllm", max_model_len=4096) as server, client(server) as http:
        r = await http.post("/tokenize", json={"model": "fake-model", "prompt": "a b c"})
        assert r.status_code == 200
        assert r.json() == {"count": 3, "max_model_len": 4096, "tokens": tokenize("a b c")}
        messages = [{"role": "user", "content": "hi there"}]
        r = await http.post("/tokenize", json={"messages": messages, "add_special_tokens": False})
        assert r.json()["tokens"] == tokenize("<|user|>\nhi there\n<|assistant|>\n")
        assert r.json()["count"] == 4  # <|user|> hi there <|assistant|>
        r = await http.post("/tokenize", json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        models = (await http.get("/v1/models")).json()
        assert models["object"] == "list"
        card = models["data"][0]
        assert card["id"] == "fake-model" and card["object"] == "model"
        assert card["owned_by"] == "crossflow-fake" and card["max_model_len"] == 4096


async def test_unstreamed_completion_and_chat_completion() -> None:
    async with serving() as server, client(server) as http:
        r = await http.post(
            "/v1/completions", json={"model": "fake-model", "prompt": PROMPT, "max_tokens": 5}
        )
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["model"] == "fake-model" and isinstance(body["created"], int)
        (choice,) = body["choices"]
        assert choice["text"] == "w0 w1 w2 w3 w4" and choice["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == 40
        assert body["usage"]["completion_tokens"] == 5 and body["usage"]["total_tokens"] == 45

        messages = [{"role": "user", "content": PROMPT}]
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": messages, "stop": ["w2"]},
            headers={"X-Request-Id": "abc"},
        )
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-abc"
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": "w0 w1"}
        assert choice["finish_reason"] == "stop"
        prompt_tokens = len(tokenize(render_chat_text(PROMPT)))
        assert body["usage"]["prompt_tokens"] == prompt_tokens
        assert body["usage"]["completion_tokens"] == 3  # the stop word was generated
        r = await http.post("/v1/completions", json={"prompt": [1, 2, 3]})  # default 16 tokens
        assert r.json()["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 16,
            "total_tokens": 19,
            "prompt_tokens_details": {"cached_tokens": 0},
        }


def render_chat_text(content: str) -> str:
    return f"<|user|>\n{content}\n<|assistant|>\n"


async def test_streamed_completion_and_chat_completion() -> None:
    async with serving() as server, client(server) as http:
        body = {"prompt": PROMPT, "max_tokens": 6, "stream": True}
        body["stream_options"] = {"include_usage": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            got = chunks(await sse_events(r))
        *tokens, last = got
        assert [c["choices"][0]["text"] for c in tokens] == [
            "w0",
            " w1",
            " w2",
            " w3",
            " w4",
            " w5",
        ]
        assert {c["object"] for c in got} == {"text_completion"}
        assert len({c["id"] for c in got}) == 1
        assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 5 + ["length"]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
        assert last["usage"]["prompt_tokens"] == 40

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=chat) as r:
            got = chunks(await sse_events(r))
        assert {c["object"] for c in got} == {"chat.completion.chunk"}
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [c["choices"][0]["delta"].get("content", "") for c in got]
        assert "".join(deltas) == "w0 w1 w2"
        assert got[-1]["choices"][0]["finish_reason"] == "length"
        assert all("usage" not in c for c in got)

        stopped = {"prompt": "x", "max_tokens": 9, "stop": "w2", "stream": True}
        async with http.stream("POST", "/v1/completions", json=stopped) as r:
            got = chunks(await sse_events(r))
        assert [c["choices"][0]["text"] for c in got] == ["w0", " w1", ""]
        assert [c["choices"][0]["finish_reason"] for c in got] == [None, None, "stop"]


async def test_openai_sdk_streamed_and_unstreamed() -> None:
    async with serving(protocol="vllm") as server:
        sdk = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1",
            api_key="unused",
            timeout=LIMIT_S,
            max_retries=0,
            http_client=openai.DefaultAsyncHttpx2Client(trust_env=False),
        )
        async with sdk:
            models = await sdk.models.list()
            assert [m.id for m in models.data] == ["fake-model"]
            done = await sdk.completions.create(model="fake-model", prompt=PROMPT, max_tokens=4)
            assert done.choices[0].text == "w0 w1 w2 w3"
            assert done.usage is not None and done.usage.completion_tokens == 4
            chat = await sdk.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "hello"}],
                max_completion_tokens=2,
            )
            assert chat.choices[0].message.content == "w0 w1"
            assert chat.choices[0].finish_reason == "length"
            stream = await sdk.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, finish, used = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                used = chunk.usage or used
            assert text == "w0 w1 w2 w3 w4" and finish == "length"
            assert used is not None and used.completion_tokens == 5
            pieces = []
            async for chunk in await sdk.completions.create(
                model="fake-model", prompt="x y", max_tokens=3, stream=True
            ):
                pieces.append(chunk.choices[0].text)
            assert "".join(pieces) == "w0 w1 w2"
            with pytest.raises(openai.NotFoundError):
                await sdk.completions.create(model="other", prompt="x", max_tokens=1)


async def test_a_repeated_prompt_hits_the_prefix_cache() -> None:
    prompt = " ".join(f"t{i}" for i in range(100))  # 6 full blocks and 4 tokens
    async with serving(protocol="vllm") as server, client(server) as http:
        first = (
            await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        ).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = (
            await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        ).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        other = prompt.replace("t20", "changed")  # block 1 differs: only block 0 is shared
        third = (await http.post("/v1/completions", json={"prompt": other, "max_tokens": 1})).json()
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        s = await state(server)
        assert s["counters"]["prefill_cache"] == 96 + 16
        assert s["counters"]["prefill_compute"] == 100 + 4 + 84
        metrics = parse((await http.get("/metrics")).text)
        assert metrics.total("vllm:prefix_cache_hits_total") == 112


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 40_000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 99_999]}, 400, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "stream": "yes please"}, 400, "stream"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages.0.content",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": "maybe"}},
            400,
            "kv_transfer_params.do_remote_prefill",
        ),
        ("/v1/completions", [1, 2], 400, "body"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ],
)
async def test_bad_input_names_the_field_and_changes_nothing(
    path: str, body: object, status: int, param: str
) -> None:
    async with serving(max_model_len=32_768) as server, client(server) as http:
        r = await http.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == status
        assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        assert param.split(".")[0] in error["message"]
        s = await state(server)
        assert s["counters"]["prompt"] == 0 and s["queued_requests"] == 0
        assert s["running_requests"] == s["prefilling_requests"] == 0
        r = await http.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = await http.post("/v1/completions", content=b"x" * (1024 * 1024 + 1))
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        r = await http.get("/v1/completions")
        assert r.status_code == 405


async def test_a_client_that_disconnects_mid_stream_aborts_its_request() -> None:
    async with serving() as server:
        async with client(server) as http:
            body = {"prompt": PROMPT, "max_tokens": 20_000, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                first = await anext(lines)
                assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "w0"
                s = await state(server)
                assert s["running_requests"] == 1 and s["kv_used_tokens"] > 40
            # leaving the block closed the response; closing the client drops the connection

        async def freed() -> bool:
            s = await state(server)
            return (
                s["running_requests"] == 0
                and s["kv_used_tokens"] == 0
                and s["kv_reserved_tokens"] == 0
                and s["counters"]["aborted"] == 1
            )

        await eventually(freed, "the engine request aborted and its KV freed")
        assert (await state(server))["counters"]["requests"] == 0


async def test_an_unstreamed_request_aborts_too_when_its_client_leaves() -> None:
    async with serving() as server:
        http = client(server)
        task = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 20_000})
        )

        async def running() -> bool:
            return (await state(server))["running_requests"] == 1

        await eventually(running, "the request running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await http.aclose()

        async def freed() -> bool:
            s = await state(server)
            return s["running_requests"] == 0 and s["kv_reserved_tokens"] == 0

        await eventually(freed, "the engine request aborted")


async def test_tokens_follow_the_engine_queue() -> None:
    # one slot: the second request waits in the engine's queue while the first decodes
    async with serving(EngineScript(max_running=1)) as server, client(server) as http:
        got: dict[str, list[str]] = {"a": [], "b": []}

        async def one(name: str, max_tokens: int) -> None:
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        got[name].append(line)

        async def started() -> bool:
            return bool(got["a"])

        first = asyncio.create_task(one("a", 400))
        await eventually(started, "the first stream under way")
        second = asyncio.create_task(one("b", 5))

        async def queued() -> dict[str, object] | None:
            s = await state(server)
            return s if s["queued_requests"] == 1 else None

        s = await queued() or await eventually(queued, "the second request queued")
        assert s["running_requests"] == 1 and not got["b"]  # no token while queued
        await asyncio.gather(first, second)
        assert len(got["a"]) == 400 and len(got["b"]) == 5
