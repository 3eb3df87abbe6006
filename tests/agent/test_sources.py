"""Scrape a real HTTP server on loopback serving SGLang and vLLM metric text; check the
snapshot's values, rates and ITL quantiles against hand-computed ones."""

from __future__ import annotations

import math

import pytest

from crossflow_agent.sources.base import ScrapeError
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.prom import bucket_deltas, histogram_quantile, parse
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_agent.sources.vllm import VLLMReader
from crossflow_ctl.domain.clock import ManualClock
from tests.agent.conftest import MetricsServer, fixture_text


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _two_scrapes(server: MetricsServer, reader, prefix: str):
    mono, clock = FakeMonotonic(), ManualClock()
    source = PrometheusSource(server.url, reader, clock=clock, monotonic=mono)
    try:
        server.text = fixture_text(f"{prefix}_t0.prom")
        first = await source.scrape()
        server.text = fixture_text(f"{prefix}_t1.prom")
        mono.now += 2.0
        clock.advance(2000)
        second = await source.scrape()
    finally:
        await source.aclose()
    return first, second, clock


async def test_sglang_snapshot_values_rates_and_itl_quantiles(metrics_server) -> None:
    first, snap, clock = await _two_scrapes(metrics_server, SGLangReader(), "sglang")
    # first scrape: gauges only, no window yet
    assert first.window_s == 0.0 and first.itl_p50_ms is None
    assert first.generation_rate_tps == 800.0  # the gen_throughput gauge, summed over dp ranks
    # gauges, summed over the two data-parallel ranks
    assert snap.taken_at_ms == clock.now_ms() and snap.source == "sglang"
    assert snap.running_requests == 11 + 7
    assert snap.kv_used_tokens == 31_000 + 21_000
    assert snap.kv_total_tokens == 400_000
    assert snap.decode_context_tokens == 30_000 + 20_400
    assert snap.queued_requests == (3 + 1) + 1 + 1  # waiting + decode prealloc + transfer
    # waiting for KV room: the prealloc queue; its KV is rank 0's pending usage x its total
    assert snap.kv_waiting_requests == 1 and snap.kv_waiting_tokens == 0.01 * 200_000
    # a release without the pending-usage gauge tells only how many wait
    assert first.kv_waiting_requests == 1 and first.kv_waiting_tokens is None
    assert snap.kv_transfer_bytes_per_s == pytest.approx(12.5e9)
    # counters over the 2 s window
    assert snap.window_s == 2.0
    assert snap.prompt_rate_tps == pytest.approx(8000 / 2)
    assert snap.generation_rate_tps == pytest.approx(1600 / 2)
    assert snap.prefill_processing_rate_tps == pytest.approx(6000 / 2)  # prefill_compute mode
    # 6000 uncached tokens over 4 new requests = 1500 per request, x 4 waiting
    assert snap.outstanding_uncached_tokens == 4 * 1500
    # 6000 prefill_cache tokens over 4 new requests: a 1500-token cached prefix each, counted
    # as the scheduler ran them (prompt - uncached, 8000 - 6000, mixes in the prompt counter's
    # finish-time clock: it would say 500)
    assert snap.prefill_mean_cached_tokens == pytest.approx(1500.0)
    assert first.prefill_mean_cached_tokens is None  # no window, no mean yet
    # ITL: window deltas 0.010:10 0.015:30 0.020:60 0.025:90 0.030:98 0.035:99 0.040:100
    # p50: rank 50 in (0.015, 0.020]: 15 + 5 * (50 - 30) / (60 - 30) ms
    assert snap.itl_p50_ms == pytest.approx(15 + 5 * 20 / 30)
    # p99: rank 99 in (0.030, 0.035]: 30 + 5 * (99 - 98) / (99 - 98) ms
    assert snap.itl_p99_ms == pytest.approx(35.0)


async def test_vllm_snapshot_values_rates_and_itl_quantiles(metrics_server) -> None:
    first, snap, _ = await _two_scrapes(metrics_server, VLLMReader(), "vllm")
    assert first.itl_p99_ms is None
    assert snap.source == "vllm"
    assert snap.running_requests == 12 and snap.queued_requests == 5
    # waiting for KV room: reason="capacity" only (not "deferred"); vLLM tells no tokens
    assert snap.kv_waiting_requests == 2 and snap.kv_waiting_tokens is None
    assert first.kv_waiting_requests == 0  # a release without the by-reason gauge
    assert snap.kv_total_tokens == 20_000 * 16  # num_gpu_blocks x block_size
    assert snap.kv_used_tokens == 0.25 * 320_000
    assert snap.decode_context_tokens == snap.kv_used_tokens
    assert snap.prompt_rate_tps == pytest.approx(10_000 / 2)
    assert snap.generation_rate_tps == pytest.approx(2_400 / 2)
    # prefix cache: 4000 hits of 10000 queried -> 60% uncached
    assert snap.prefill_processing_rate_tps == pytest.approx(5_000 * 0.6)
    # mean prompt 10000 / 4 = 2500 tokens, 60% uncached, 5 waiting
    assert snap.outstanding_uncached_tokens == round(5 * 2500 * 0.6)
    assert snap.prefill_mean_cached_tokens == pytest.approx(2500 * 0.4)  # the hit share of it
    assert first.prefill_mean_cached_tokens is None  # no prefix-cache window yet
    # ITL deltas 0.01:0 0.025:40 0.05:180 0.075:200
    assert snap.itl_p50_ms == pytest.approx(25 + 25 * (100 - 40) / (180 - 40))
    assert snap.itl_p99_ms == pytest.approx(50 + 25 * (198 - 180) / (200 - 180))


async def test_a_counter_reset_counts_from_zero(metrics_server) -> None:
    mono = FakeMonotonic()
    source = PrometheusSource(metrics_server.url, SGLangReader(), monotonic=mono)
    try:
        metrics_server.text = fixture_text("sglang_t1.prom")
        await source.scrape()
        metrics_server.text = fixture_text("sglang_t0.prom")  # the engine restarted: counters fell
        mono.now += 10.0
        snap = await source.scrape()
    finally:
        await source.aclose()
    assert snap.prompt_rate_tps == pytest.approx(100_000 / 10)  # rate() takes the new value
    assert snap.itl_p50_ms is not None  # quantiles of the post-reset histogram as is


@pytest.mark.parametrize(
    ("status", "text", "kind"),
    [
        (500, "oops", "http_error"),
        (200, "this is { not prometheus", "parse"),
        (200, "# TYPE foo gauge\nfoo 1\n", "parse"),  # well formed, but not an SGLang engine
    ],
)
async def test_scrape_failures_are_typed(metrics_server, status, text, kind) -> None:
    metrics_server.status, metrics_server.text = status, text
    source = PrometheusSource(metrics_server.url, SGLangReader())
    try:
        with pytest.raises(ScrapeError) as info:
            await source.scrape()
    finally:
        await source.aclose()
    assert info.value.kind == kind


async def test_unreachable_and_timeout(metrics_server) -> None:
    url = metrics_server.url
    metrics_server.delay_s = 2.0
    slow = PrometheusSource(url, SGLangReader(), timeout_s=0.1)
    try:
        with pytest.raises(ScrapeError) as info:
            await slow.scrape()
        assert info.value.kind == "timeout"
    finally:
        await slow.aclose()
    await metrics_server.close()
    gone = PrometheusSource(url, SGLangReader())
    try:
        with pytest.raises(ScrapeError) as info:
            await gone.scrape()
        assert info.value.kind == "unreachable"
    finally:
        await gone.aclose()


def test_histogram_quantile_edges() -> None:
    inf = math.inf
    assert histogram_quantile(0.5, {0.1: 0.0, inf: 0.0}) is None  # no observations
    assert histogram_quantile(0.5, {}) is None
    # everything above the highest finite bound: that bound
    assert histogram_quantile(0.99, {0.1: 0.0, 0.2: 0.0, inf: 10.0}) == 0.2
    # first bucket interpolates from 0
    assert histogram_quantile(0.5, {0.1: 10.0, inf: 10.0}) == pytest.approx(0.05)
    assert bucket_deltas({0.1: 1.0, inf: 2.0}, {0.1: 5.0, inf: 6.0}) == {0.1: 1.0, inf: 2.0}


def test_parse_sums_series_and_filters_labels() -> None:
    expo = parse(fixture_text("sglang_t0.prom"))
    assert expo.total("sglang:num_running_reqs") == 16
    assert expo.total("sglang:num_running_reqs", dp_rank="1") == 6
    assert expo.total("sglang:realtime_tokens_total", mode="decode") == 50_000
    assert expo.total("sglang:nope") is None


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("sglang:num_running_reqs{", "NaN"), "sglang:num_running_reqs is nan"),
        (("sglang:num_running_reqs{", "-20.0"), "running_requests is negative (-14)"),
        (("sglang:num_used_tokens{", "900000.0"), "kv_used_tokens 920000 > kv_total_tokens"),
    ],
)
async def test_odd_engine_values_give_implausible_zero_leases(metrics_server, edit, needle) -> None:
    from crossflow_agent.agent import Agent
    from crossflow_agent.settings import AgentSettings
    from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
    from crossflow_ctl.domain.models import ZeroReason

    prefix, value = edit
    lines = fixture_text("sglang_t0.prom").splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    lines[first] = lines[first].rsplit(" ", 1)[0] + " " + value  # the dp_rank 0 series
    metrics_server.text = "\n".join(lines) + "\n"
    settings = AgentSettings(node_id="n1", brokers=["127.0.0.1:1"], metrics_url=metrics_server.url)
    source = PrometheusSource(settings.metrics_url, SGLangReader())
    agent = Agent(settings, source, MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"])
    try:
        lease = await agent.tick()
    finally:
        await source.aclose()
    assert lease is not None and lease.credits.is_zero()
    assert lease.zero_reason is ZeroReason.TELEMETRY_IMPLAUSIBLE and needle in lease.zero_detail
