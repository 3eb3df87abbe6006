"""A fake LLM engine that speaks what vLLM and SGLang speak, over a synthetic step model.

``crossflow-agent fake-engine`` serves one :class:`~crossflow_agent.sources.synthetic.
SyntheticEngine` over HTTP (aiohttp); tests use :class:`FakeEngineServer` in-process::

    server = FakeEngineServer(engine, protocol="vllm", pd_role="prefill", model="fake-model")
    await server.start()          # port=0: a free port
    ... server.url, server.port, server.bootstrap_port (SGLang prefill only) ...
    await server.close()

The contract (what a gateway may rely on):

**Tokenizer.** One token per whitespace-separated word, id ``zlib.crc32(word.encode()) % 32000``.
Chat messages render as ``"<|{role}|>\\n{content}\\n"`` each, then ``"<|assistant|>\\n"``
(content parts ``[{"type": "text", "text"}]`` join with newlines), tokenized the same way.
``POST /tokenize`` ``{"model"?, "prompt": str}`` or ``{"model"?, "messages": [...]}``
(``add_special_tokens`` accepted, no effect) -> ``{"count", "max_model_len", "tokens"}``.

**OpenAI API.** ``GET /v1/models`` -> ``{"object": "list", "data": [{"id": MODEL, "object":
"model", "created": 0, "owned_by": "crossflow-fake", "max_model_len": M}]}``.
``POST /v1/completions`` (``prompt``: a string or a list of token ids) and
``POST /v1/chat/completions`` (``messages``). Output length ``max_tokens`` (or
``max_completion_tokens``), default 16; output token ``i`` is the word ``w{i}``, the text
``"w0 w1 ..."``. ``stop`` (str or list): a stop string equal to an output word ``wK`` (K <
max_tokens) ends the output before it: K+1 tokens generated, K shown, ``finish_reason``
``"stop"``; otherwise ``"length"``. ``n`` must be 1; other sampling fields are ignored.
Unstreamed: ``{"id": "cmpl-..."|"chatcmpl-...", "object": "text_completion"|"chat.completion",
"created", "model", "choices": [{"index": 0, "text"|"message": {"role": "assistant",
"content"}, "logprobs": null, "finish_reason"}], "usage": {"prompt_tokens",
"completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}}}`` (an
``X-Request-Id`` header becomes the id's suffix). Streamed (``"stream": true``): SSE,
``data: {chunk}\\n\\n`` per token then ``data: [DONE]\\n\\n``; chunks are ``text_completion``
(``choices[0].text``) or ``chat.completion.chunk`` (a first chunk with ``delta: {"role":
"assistant", "content": ""}``, then ``delta.content``); the last token's chunk carries
``finish_reason``; ``stream_options.include_usage`` adds a chunk with ``"choices": []`` and
``usage`` before ``[DONE]``. A request is a job of the synthetic engine (prompt tokens = the
tokenizer's count): its queueing, chunked prefill, KV room and step times decide when each
token comes, so TTFT and ITL are real wall-clock times of the model (a token is answered once
the step that makes it has ended; as in the step model, the first token comes from the decode
step after the prompt's last prefill chunk, not from that chunk's step). A client that
disconnects aborts its job (KV freed).
Errors: ``{"error": {"message", "type", "param", "code"}}``; 400 ``BadRequestError`` names
the field in ``param`` and in the message (``"max_tokens: ..."``) and changes nothing;
prompt + max_tokens over ``max_model_len`` (or the KV cache) is 400; an unknown ``model`` is
404 ``NotFoundError``; a full queue or a closing engine 503; a failed KV transfer 500
``InternalServerError`` (param ``kv_transfer_params`` or ``bootstrap_room``).

**Prefix cache.** An LRU of chained hashes of 16-token blocks (:mod:`.prefix_cache`); a locally
prefilled prompt's cached tokens (``usage.prompt_tokens_details.cached_tokens``) are its longest
run of leading full blocks already present (within its first ``len - 1`` tokens); they are not
prefilled again. A prompt's blocks go in when its KV is complete.

**P/D, vLLM** (``--protocol vllm``; :mod:`.vllm_kv`, :mod:`.pd`). On a prefill (or both)
engine, a request with ``kv_transfer_params: {"do_remote_decode": true, ...}`` (``stream``
must be false) is prefilled and generates 1 token; its KV is held (exported) for ``kv_ttl_s``
(60 s) and the answer adds top-level ``"kv_transfer_params": {"do_remote_prefill": true,
"do_remote_decode": false, "remote_engine_id", "remote_block_ids", "remote_host",
"remote_port", "remote_request_id", "tp_size": 1}`` (host and port: this engine's API). On a
decode (or both) engine, a request carrying those (``do_remote_prefill: true``) first pulls the
KV with ``POST http://remote_host:remote_port/fake/kv/pull`` (frees it there; unknown,
expired or a different prompt length: 500), then decodes ``max_tokens`` tokens with its
prompt counted ``external_kv_transfer`` (no local prefill; a transfer time when the engine's
``kv_transfer_gb_s`` is set). A request without ``kv_transfer_params`` is prefilled locally
anywhere (``local_compute``, cached blocks ``local_cache_hit``). ``/metrics`` is vLLM's format
(:mod:`crossflow_agent.sources.synthetic_metrics`).

**P/D, SGLang** (``--protocol sglang``, the default; :mod:`.sglang_bootstrap`). The router sends
the same request, with ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room`` (int), to a
prefill and a decode engine at once and answers the decode engine's response. A prefill engine
(``pd_role="prefill"``) serves a bootstrap site on ``bootstrap_port``, requires
``bootstrap_room``, prefills the prompt (1 token; its normal answer) and holds the KV as the
room's for ``kv_ttl_s``. A decode engine given ``bootstrap_room`` waits at
``bootstrap_host:bootstrap_port`` up to ``bootstrap_timeout_s`` (30 s) for the room (not
ready: 500), then decodes with the prompt counted as transferred; without the bootstrap fields
it prefills locally. ``pd_role="both"`` ignores them. ``/metrics`` is SGLang's format.

**Health and faults** (:mod:`.control`). ``GET /health``: 200, 503 while down; ``GET /healthz``:
"ok". ``POST /control`` ``{"down": bool}``: health and every API call (``/v1/*``, ``/tokenize``,
``/fake/*``) answer 503; ``{"fail_next": n}``: the next n API requests (``/v1/*``,
``/tokenize``) answer 500; ``{"slowdown": x}`` stretches every engine step. The fake's own
routes (``/metrics``, ``/state``, ``/requests``, ``/control``) are described in
:mod:`.control`. Bodies over 1 MiB are refused (413).
"""

from __future__ import annotations

from crossflow_agent.fake_engine.pd import EngineProtocol, PdRole
from crossflow_agent.fake_engine.server import FakeEngineServer

__all__ = ["EngineProtocol", "FakeEngineServer", "PdRole"]
