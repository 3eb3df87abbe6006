"""The readers' step counters (online calibration) against what the synthetic engine did, in
virtual time: a window read from vLLM's or SGLang's exposition is the engine's own steps."""

from __future__ import annotations

import pytest

from crossflow_agent.sources.http import read_with_totals
from crossflow_agent.sources.prom import Window, parse
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_agent.sources.synthetic import EngineRequest, EngineScript, SyntheticEngine
from crossflow_agent.sources.vllm import VLLMReader
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.step_windows import step_window
from tests.agent.conftest import fixture_text
from tests.agent.test_synthetic_jobs import Mono

MODEL, NODE = MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"]


def busy_engine() -> tuple[SyntheticEngine, Mono]:
    mono = Mono()
    e = SyntheticEngine(MODEL, NODE, EngineScript(chunk_tokens=1024), monotonic=mono)
    for _ in range(6):
        e.submit(EngineRequest(prompt_tokens=3000, cached_tokens=500, output_tokens=400))
    return e, mono


def test_a_vllm_window_is_the_engines_own_steps() -> None:
    e, mono = busy_engine()
    reader, window = VLLMReader(), Window()
    mono.now = 0.5
    _, before = read_with_totals(reader, window, e.render("vllm"), 500, mono.now)
    steps0, gen0, itl_sum0 = e.counters["steps"], e.counters["generation"], e.itl.sum
    computed0 = e.counters["prefill_compute"]
    mono.now = 3.0
    _, now = read_with_totals(reader, window, e.render("vllm"), 3000, mono.now)
    assert before is not None and now is not None
    assert now.kv_total_tokens == 400_000
    w = step_window(before, now)
    assert w is not None
    assert w.window_s == pytest.approx(2.5)
    assert w.steps == e.counters["steps"] - steps0
    assert w.decode_tokens == e.counters["generation"] - gen0
    assert w.itl_s == pytest.approx((e.itl.sum - itl_sum0) / w.decode_tokens)
    # the histogram splits the steps into decode steps and chunk steps (at most 1024 tokens, the
    # engine's chunk, read to within the bucket (1024, 2048]) carrying what the engine computed
    assert sum(s for s, _ in w.mix) == pytest.approx(1.0)
    chunks = [p for s, p in w.mix if p > 0]
    assert chunks and max(chunks) <= 1.1 * 1024
    computed = e.counters["prefill_compute"] - computed0
    assert sum(s * p for s, p in w.mix) == pytest.approx(computed / w.steps, rel=0.01)


def test_an_sglang_window_estimates_its_steps_from_the_batch() -> None:
    e, mono = busy_engine()
    reader, window = SGLangReader(), Window()
    mono.now = 2.0  # past the prefill: a steady batch of 6
    _, before = read_with_totals(reader, window, e.render("sglang"), 2000, mono.now)
    steps0 = e.counters["steps"]
    mono.now = 3.0
    _, now = read_with_totals(reader, window, e.render("sglang"), 3000, mono.now)
    assert before is not None and now is not None and now.steps is None
    w = step_window(before, now)
    assert w is not None
    assert w.batch == pytest.approx(6.0)
    assert w.steps == pytest.approx(e.counters["steps"] - steps0, rel=0.05)


def test_fixture_expositions_give_totals() -> None:
    vllm = VLLMReader().totals(parse(fixture_text("vllm_t1.prom")), 1.0)
    assert vllm is not None
    assert vllm.decode_tokens == 82_400 and vllm.itl_count > 0
    assert vllm.kv_total_tokens > 0
    sglang = SGLangReader().totals(parse(fixture_text("sglang_t1.prom")), 1.0)
    assert sglang is not None and sglang.steps is None and sglang.itl_count > 0


def test_no_totals_from_an_exposition_without_an_itl_histogram() -> None:
    text = fixture_text("vllm_t1.prom")
    cut = "\n".join(line for line in text.splitlines() if "inter_token" not in line)
    assert VLLMReader().totals(parse(cut), 1.0) is None
    assert SGLangReader().totals(parse(fixture_text("vllm_t1.prom")), 1.0) is None


def test_a_negative_counter_gives_no_totals_and_no_crash() -> None:
    text = fixture_text("vllm_t1.prom").replace(
        'vllm:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct",engine="0"}'
        " 82400.0",
        'vllm:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct",engine="0"}'
        " -5.0",
    )
    assert VLLMReader().totals(parse(text), 1.0) is None
