"""A real prefill -> decode hop between two vLLM CPU engines over NixlConnector.

What is exercised: vLLM's P/D protocol as a gateway speaks it (prefill with
``kv_transfer_params={"do_remote_decode": true}``, ``max_tokens=1``, unstreamed; decode with
the prefill answer's ``kv_transfer_params``, unstreamed or streamed, completions and chat), NIXL
(nixl-cu12's UCX, no GPU) pulling the prompt's KV blocks from the prefill engine's CPU KV cache
into the decode engine's, and the decode engine's ``vllm:prompt_tokens_by_source_total``.

Proven, not only counted: with the twin prefill engine (same tokenizer and shapes, other
weights) the decode engine answers differently from a one-engine run, so it computed with the
KV it was sent, not with a silent local recompute.

Not exercised on CPU: GPU memory (VRAM) registration and the host-buffer copy a GPU engine
does, RDMA/NVLink transports (UCX runs over loopback here), tensor parallelism (TP=1 each, so no
heterogeneous-TP mapping), the push connector (NixlPushConnector) and prefill-side prefix-cache
hits (``remote_prefill_cached_tokens`` is 0), aborts and KV lease expiry, and timing of any kind.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.realengine.conftest import PDEngines
from tests.realengine.harness import VLLMEngine, counter_delta, prefill_request, words_prompt

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 12


def _post(engine: VLLMEngine, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{engine.url}{route}", json=body, timeout=120)
    assert response.status_code == 200, f"{engine.name}: {response.text}"
    return dict(response.json())


def _two_hops(
    prefill: VLLMEngine, decode: VLLMEngine, route: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """Prefill answer, decode answer and the decode engine's prompt-token sources for the hop."""
    first = _post(prefill, route, prefill_request(body))
    before = decode.prompt_tokens_by_source()
    second = _post(decode, route, {**body, "kv_transfer_params": first["kv_transfer_params"]})
    return first, second, counter_delta(decode.prompt_tokens_by_source(), before)


def test_two_hop_completion_moves_the_prompts_kv(pd_engines: PDEngines) -> None:
    prefill, decode = pd_engines.prefill, pd_engines.decode
    body = {"model": decode.model, "prompt": words_prompt(300, seed=11),
            "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    first, second, sources = _two_hops(prefill, decode, "/v1/completions", body)

    params = first["kv_transfer_params"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 256  # three of the CPU backend's 128-token blocks
    assert first["usage"]["completion_tokens"] == 1
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"]
    [blocks] = params["remote_block_ids"]  # one KV cache group: the prompt's 128-token blocks
    assert len(blocks) == -(-prompt_tokens // 128)
    assert params["remote_num_tokens"] == prompt_tokens
    assert params["transfer_mode"] == "pull"

    # Every prompt token came over NIXL; none was computed or found locally on the decode side.
    assert sources == {"external_kv_transfer": prompt_tokens, "local_cache_hit": 0.0,
                       "local_compute": 0.0}  # fmt: skip
    assert second["usage"]["prompt_tokens"] == prompt_tokens
    assert second["usage"]["completion_tokens"] == MAX_TOKENS
    # The prefill engine's own one-engine answer (asked afterwards, so no cache of the decode
    # engine is warmed by it): the same weights give the same greedy tokens.
    alone = _post(prefill, "/v1/completions", body)
    assert second["choices"][0]["text"] == alone["choices"][0]["text"]


def test_decode_computes_with_the_kv_it_was_sent(pd_engines: PDEngines) -> None:
    """KV from the twin (other weights) makes the decode engine answer what neither model would
    alone: the transferred blocks are what it attends to."""
    twin, decode, prefill = pd_engines.twin_prefill, pd_engines.decode, pd_engines.prefill
    body = {"model": decode.model, "prompt": words_prompt(300, seed=12),
            "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    first, second, sources = _two_hops(twin, decode, "/v1/completions", body)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert sources["external_kv_transfer"] == prompt_tokens and sources["local_compute"] == 0
    mixed = second["choices"][0]["text"]
    same_weights = _post(prefill, "/v1/completions", body)["choices"][0]["text"]
    twin_alone = _post(twin, "/v1/completions", body)["choices"][0]["text"]
    assert mixed != same_weights, "the decode engine ignored the twin's KV and recomputed"
    assert mixed != twin_alone


def test_two_hop_streamed_decode_and_chat(pd_engines: PDEngines) -> None:
    """The shapes a gateway sends: the decode hop streamed, and chat completions both hops."""
    prefill, decode = pd_engines.prefill, pd_engines.decode
    body = {"model": decode.model, "prompt": words_prompt(300, seed=13),
            "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    first = _post(prefill, "/v1/completions", prefill_request(body))
    before = decode.prompt_tokens_by_source()
    streamed = {**body, "stream": True, "kv_transfer_params": first["kv_transfer_params"]}
    with httpx.stream("POST", f"{decode.url}/v1/completions", json=streamed, timeout=120) as r:
        assert r.status_code == 200, r.read().decode()
        data = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
    sources = counter_delta(decode.prompt_tokens_by_source(), before)
    assert sources["external_kv_transfer"] == first["usage"]["prompt_tokens"]
    assert sources["local_compute"] == 0
    assert text == _post(prefill, "/v1/completions", body)["choices"][0]["text"]

    chat = {"model": decode.model, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "messages": [{"role": "user", "content": words_prompt(300, seed=14)}]}  # fmt: skip
    c_first, c_second, c_sources = _two_hops(prefill, decode, "/v1/chat/completions", chat)
    assert c_first["kv_transfer_params"]["do_remote_prefill"] is True
    assert c_sources["external_kv_transfer"] == c_first["usage"]["prompt_tokens"]
    assert c_sources["local_compute"] == 0
    alone = _post(prefill, "/v1/chat/completions", chat)
    assert c_second["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_decode_engine_prefills_a_plain_request_itself(pd_engines: PDEngines) -> None:
    """A request without ``kv_transfer_params`` (how a borrowed prompt runs on a decode node) is
    prefilled by the ``kv_both`` decode engine itself: every prompt token is local compute."""
    decode = pd_engines.decode
    before = decode.prompt_tokens_by_source()
    body = {"model": decode.model, "prompt": words_prompt(300, seed=15),
            "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    answer = _post(decode, "/v1/completions", body)
    sources = counter_delta(decode.prompt_tokens_by_source(), before)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert sources == {"external_kv_transfer": 0.0, "local_cache_hit": 0.0,
                       "local_compute": prompt_tokens}  # fmt: skip
    assert answer["kv_transfer_params"] is None
    assert (
        answer["choices"][0]["text"]
        == _post(pd_engines.prefill, "/v1/completions", body)["choices"][0]["text"]
    )
