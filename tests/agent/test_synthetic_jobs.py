"""The synthetic engine's per-request jobs: progress, abort, held (exported) and transferred KV,
and its vLLM-format exposition read by the real vLLM reader. Virtual time only."""

from __future__ import annotations

import pytest

from crossflow_agent.sources.http import read_text
from crossflow_agent.sources.prom import Window, parse
from crossflow_agent.sources.synthetic import (
    EngineRequest,
    EngineScript,
    Job,
    JobState,
    SyntheticEngine,
)
from crossflow_agent.sources.vllm import VLLMReader
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS

MODEL, NODE = MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"]


class Mono:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine(script: EngineScript | None = None) -> tuple[SyntheticEngine, Mono]:
    mono = Mono()
    return SyntheticEngine(MODEL, NODE, script, monotonic=mono), mono


def run_until(e: SyntheticEngine, mono: Mono, done, limit_s: float = 60.0) -> None:
    while not done() and mono.now < limit_s:
        due = e.next_due_s()
        mono.now = due if due is not None else mono.now + 0.01
        e.advance()
    assert done()


def test_listener_sees_each_token_after_its_step_ends() -> None:
    e, mono = engine()
    seen: list[tuple[JobState, int, float]] = []
    job = e.submit(
        EngineRequest(prompt_tokens=1000, output_tokens=5),
        listener=lambda j: seen.append((j.state, j.generated, mono.now)),
    )
    assert job.state is JobState.PREFILLING and job.id > 0
    step_end = e.next_due_s()
    assert step_end is not None and step_end > 0
    mono.now = step_end / 2
    e.advance()
    assert job.prefilled == 0  # the step is still running
    run_until(e, mono, lambda: job.ended)
    assert job.state is JobState.FINISHED and job.generated == 5
    gens = [g for _, g, _ in seen]
    assert gens == sorted(gens) and gens[-1] == 5
    assert job.first_token_s is not None and job.prompt_done_s is not None
    assert job.arrived_s <= job.prompt_done_s < job.first_token_s <= (job.ended_s or 0)
    assert e.reserved_kv == 0 and e.kv_used_tokens == 0
    assert e.ttft.counts and sum(e.ttft.counts) == 1


def test_abort_frees_kv_wherever_the_job_is() -> None:
    e, mono = engine(EngineScript(kv_total_tokens=3000, max_running=4))
    first = e.submit(EngineRequest(prompt_tokens=1000, output_tokens=1000))
    second = e.submit(EngineRequest(prompt_tokens=1000, output_tokens=1000))
    assert second.state is JobState.WAITING  # 2000 reserved of 3000: no room
    e.abort(second)
    assert second.state is JobState.ABORTED and not e.waiting
    mono.now = 0.5
    e.advance()
    assert first.generated > 0 and e.reserved_kv == 2000
    e.abort(first)
    assert first.state is JobState.ABORTED
    assert e.reserved_kv == 0 and e.kv_used_tokens == 0 and not e.running
    assert e.counters["aborted"] == 2 and e.counters["requests"] == 0
    mono.now = 1.0
    e.advance()  # a step planned before the abort lands without touching it
    assert first.generated < 1000 and e.reserved_kv == 0


def test_keep_kv_holds_the_cache_until_released() -> None:
    e, mono = engine()
    job = e.submit(EngineRequest(prompt_tokens=800, output_tokens=1), keep_kv=True)
    run_until(e, mono, lambda: job.state is JobState.HELD)
    assert e.kv_used_tokens == 801 and e.reserved_kv == 801
    assert e.state()["held_requests"] == 1 and e.counters["requests"] == 1
    e.release(job)
    assert job.state is JobState.FINISHED and e.kv_used_tokens == 0 and e.reserved_kv == 0


def test_transferred_kv_needs_no_prefill_and_takes_its_transfer_time() -> None:
    e, mono = engine(EngineScript(kv_transfer_gb_s=1.0))
    job = e.submit(EngineRequest(prompt_tokens=4000, output_tokens=3), kv_transferred=True)
    assert job.state is JobState.TRANSFERRING and job.transferred == 4000
    transfer_s = 4000 * MODEL.kv_bytes_per_token / 1e9
    assert e.next_due_s() == pytest.approx(transfer_s)
    run_until(e, mono, lambda: job.ended)
    assert job.prompt_done_s == pytest.approx(transfer_s)
    assert e.counters["prefill_compute"] == 0 and e.counters["prefill_transfer"] == 4000
    assert job.generated == 3


def test_a_request_that_can_never_fit_is_refused() -> None:
    e, _ = engine(EngineScript(kv_total_tokens=1000))
    seen: list[Job] = []
    job = e.submit(EngineRequest(prompt_tokens=900, output_tokens=200), listener=seen.append)
    assert job.state is JobState.REFUSED and seen == [job]


def test_vllm_exposition_is_read_by_the_vllm_reader() -> None:
    e, mono = engine()
    e.submit(EngineRequest(prompt_tokens=3000, cached_tokens=1000, output_tokens=10_000))
    e.submit(EngineRequest(prompt_tokens=2000, output_tokens=10_000), kv_transferred=True)
    reader, window = VLLMReader(), Window()
    mono.now = 1.0
    read_text(reader, window, e.render("vllm"), 1000, mono.now)
    mono.now = 2.0
    text = e.render("vllm")
    snap = read_text(reader, window, text, 2000, mono.now)
    assert snap.running_requests == 2 and snap.queued_requests == 0
    assert snap.kv_total_tokens == 400_000 and snap.kv_used_tokens > 5000
    assert snap.generation_rate_tps > 0 and snap.itl_p50_ms is not None
    expo = parse(text)
    by = "vllm:prompt_tokens_by_source_total"
    assert expo.total(by, source="local_compute") == 2000
    assert expo.total(by, source="local_cache_hit") == 1000
    assert expo.total(by, source="external_kv_transfer") == 2000
    assert expo.total("vllm:prompt_tokens_total") == 5000
    assert expo.total("vllm:prefix_cache_queries_total") == 3000
    assert expo.total("vllm:prefix_cache_hits_total") == 1000
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:iteration_tokens_total_count",
        "vllm:request_prefill_time_seconds_count",
    ):
        assert (expo.total(name) or 0) > 0, name
    assert 'model_name="synthetic"' in text and "vllm:request_prompt_tokens_bucket" in text


def test_vllm_counts_prompts_not_yet_given_a_chunk_as_waiting() -> None:
    """vLLM v1 keeps a request in its waiting queue until the scheduler first gives it tokens.
    The fake admitted every prompt that fit at once and counted them all running, so a prefill
    server's queue read as empty however long it was: its agent reported no prompt work
    outstanding, and the broker saw no Demand (the demo on vLLM metrics answered no_demand
    to 128 of its 175 prompts)."""
    e, mono = engine(EngineScript(chunk_tokens=2048))
    for _ in range(3):
        e.submit(EngineRequest(prompt_tokens=8000, output_tokens=1))
    reader, window = VLLMReader(), Window()
    snap = read_text(reader, window, e.render("vllm"), 0, mono.now)
    assert (snap.running_requests, snap.queued_requests) == (0, 3)  # no chunk has ended yet
    due = e.next_due_s()
    assert due is not None
    mono.now = due
    e.advance()  # the first chunk of the first prompt is done
    snap = read_text(reader, window, e.render("vllm"), 1000, mono.now)
    assert (snap.running_requests, snap.queued_requests) == (1, 2)
