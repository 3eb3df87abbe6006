"""One real vLLM engine (no KV connector): the OpenAI routes a gateway speaks, /tokenize, the
/metrics names the agent's vLLM reader uses, and ``crossflow-agent inspect`` against it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from crossflow_agent.sources.vllm import CACHE_INFO, ITL_NAMES, USAGE_NAMES, WAITING_BY_REASON
from tests.realengine.harness import VLLMEngine, words_prompt

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.timeout(420)]

MAX_TOKENS = 12
MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Which list holds the items of the table?"},
]


def _post(engine: VLLMEngine, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{engine.url}{route}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _stream(engine: VLLMEngine, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE chunks of a streamed answer; asserts the stream ends with ``data: [DONE]``."""
    chunks: list[dict[str, Any]] = []
    data = [""]
    with httpx.stream("POST", f"{engine.url}{route}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read().decode()
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [ln[len("data: ") :] for ln in response.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    return chunks


def _counts(usage: dict[str, Any]) -> tuple[int, int, int]:
    """The token counts of a ``usage`` (a streamed one leaves out the ``*_details`` keys)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def test_completions_unstreamed_and_streamed_agree(vllm_engine: VLLMEngine) -> None:
    body = {"model": vllm_engine.model, "prompt": words_prompt(40, seed=3),
            "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    whole = _post(vllm_engine, "/v1/completions", body)
    assert whole["object"] == "text_completion"
    assert whole["model"] == vllm_engine.model
    [choice] = whole["choices"]
    assert isinstance(choice["text"], str) and choice["text"]
    assert choice["finish_reason"] == "length"  # random weights: the length cap ends it
    usage = whole["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    assert whole["kv_transfer_params"] is None  # no connector, no P/D

    chunks = _stream(
        vllm_engine,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == choice["text"]  # greedy in float32: the same tokens either way
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert _counts(chunks[-1]["usage"]) == _counts(usage)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}


def test_chat_completions_unstreamed_and_streamed_agree(vllm_engine: VLLMEngine) -> None:
    body = {"model": vllm_engine.model, "messages": MESSAGES,
            "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    whole = _post(vllm_engine, "/v1/chat/completions", body)
    assert whole["object"] == "chat.completion"
    [choice] = whole["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == MAX_TOKENS

    chunks = _stream(
        vllm_engine,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0].get("role") == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == choice["message"]["content"]
    assert _counts(chunks[-1]["usage"]) == _counts(whole["usage"])


def test_tokenize_counts_what_usage_reports(vllm_engine: VLLMEngine) -> None:
    prompt = words_prompt(60, seed=4)
    tokens = _post(vllm_engine, "/tokenize", {"model": vllm_engine.model, "prompt": prompt})
    assert tokens["count"] == len(tokens["tokens"]) > 60  # a real BPE: more tokens than words
    done = _post(vllm_engine, "/v1/completions",
                 {"model": vllm_engine.model, "prompt": prompt, "max_tokens": 1})  # fmt: skip
    assert done["usage"]["prompt_tokens"] == tokens["count"]

    # Chat: /tokenize applies the same chat template as /v1/chat/completions.
    chat = _post(vllm_engine, "/tokenize", {"model": vllm_engine.model, "messages": MESSAGES,
                                            "add_generation_prompt": True})  # fmt: skip
    answer = _post(vllm_engine, "/v1/chat/completions",
                   {"model": vllm_engine.model, "messages": MESSAGES, "max_tokens": 1})  # fmt: skip
    assert answer["usage"]["prompt_tokens"] == chat["count"]


def _names(metrics: str) -> set[str]:
    return {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }


def test_metrics_have_what_the_agents_vllm_reader_reads(vllm_engine: VLLMEngine) -> None:
    body = {"model": vllm_engine.model, "prompt": words_prompt(20, seed=5), "max_tokens": 4}
    _post(vllm_engine, "/v1/completions", body)
    metrics = vllm_engine.metrics_text()
    names = _names(metrics)
    wanted = {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        USAGE_NAMES[0],  # vllm:kv_cache_usage_perc (the older name is not exported any more)
        CACHE_INFO,
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        f"{ITL_NAMES[0]}_bucket",  # vllm:inter_token_latency_seconds
        "vllm:request_prompt_tokens_sum",
        "vllm:request_prompt_tokens_count",
        WAITING_BY_REASON,
        "vllm:prompt_tokens_by_source_total",
    }
    assert wanted <= names, sorted(wanted - names)
    assert (
        f'{WAITING_BY_REASON}{{engine="0",model_name="{vllm_engine.model}",reason="capacity"}}'
        in (metrics)
    )
    info = next(ln for ln in metrics.splitlines() if ln.startswith(CACHE_INFO + "{"))
    assert 'kv_cache_size_tokens="65536"' in info  # 128 MiB / 2 KiB a token
    assert 'block_size="128"' in info and 'num_gpu_blocks="512"' in info


def test_agent_inspect_makes_a_snapshot_of_the_engine(vllm_engine: VLLMEngine) -> None:
    agent = Path(sys.executable).with_name("crossflow-agent")
    assert agent.exists(), f"{agent}: the project is not installed in this venv"
    done = subprocess.run(
        [str(agent), "inspect", "--source", "vllm", "--role", "decode",
         "--metrics-url", vllm_engine.metrics_url, "--window-ms", "300", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["failure"] == ""
    snapshot = report["snapshot"]
    assert snapshot["source"] == "vllm"
    assert snapshot["kv_total_tokens"] == 65536
    assert snapshot["running_requests"] == 0 and snapshot["queued_requests"] == 0
    assert snapshot["kv_waiting_requests"] == 0
    assert snapshot["window_s"] > 0
