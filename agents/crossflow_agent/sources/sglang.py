"""SGLang's ``/metrics`` (python/sglang/srt/metrics/collector.py) -> EngineSnapshot.

Gauges (summed over data-parallel ranks): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``
(+ the PD decode ``..._prealloc_queue_reqs`` / ``..._transfer_queue_reqs``),
``sglang:num_used_tokens``, ``sglang:max_total_num_tokens``, ``sglang:decode_sum_seq_lens``,
``sglang:kv_transfer_speed_gb_s``, ``sglang:cache_hit_rate``, ``sglang:gen_throughput``.
Counters, as rates over the window: ``sglang:generation_tokens_total``,
``sglang:prompt_tokens_total``, ``sglang:realtime_tokens_total{mode="prefill_compute"}``
(uncached prompt tokens) and ``{mode="prefill_cache"}`` (prompt tokens served from the prefix
cache, counted as the scheduler runs them, on the same clock as the computed ones),
``sglang:num_requests_total``. Histogram:
``sglang:inter_token_latency_seconds`` (p50/p99 of the window's observations).

SGLang exports no queued-token gauge, so the outstanding uncached prompt tokens of a prefill
server are estimated as ``queued requests x mean uncached prompt tokens per request`` (the mean
from the counters' deltas, remembered across windows with no new request); the mean cached
prefix per request (``prefill_cache`` tokens per request; older SGLang without it: prompt minus
uncached tokens, the prompt counted only when a request finishes) lets the agent price the queued
prompts' wait on its roofline, context cost included.

On a decode server, the requests waiting for KV room are the decode prealloc queue (those in
the transfer queue hold their KV already): ``kv_waiting_requests``. Their KV is
``sglang:pending_prealloc_token_usage`` (a fraction of each rank's ``max_total_num_tokens``)
where a release fills it in; releases that export it but leave it at 0 give no figure (None:
the lease estimates per request).

For online calibration (:meth:`SGLangReader.totals`): output tokens, the ITL histogram's sum and
count, ``realtime_tokens_total{mode="prefill_compute"|"prefill_cache"}`` and
``num_requests_total``, with the running batch and ``decode_sum_seq_lens``. SGLang counts no
engine steps, so a window's steps are estimated as its output tokens over its mean running batch
(:func:`crossflow_ctl.domain.step_fit.step_window`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from crossflow_agent.sources.base import ScrapeError
from crossflow_agent.sources.prom import (
    Exposition,
    Window,
    count,
    counter_delta,
    rate,
    window_quantiles,
)
from crossflow_ctl.domain.step_windows import StepTotals
from crossflow_ctl.domain.telemetry import EngineSnapshot

ITL = "sglang:inter_token_latency_seconds"
PENDING_PREALLOC = "sglang:pending_prealloc_token_usage"
REQUIRED = ("sglang:num_running_reqs", "sglang:num_used_tokens", "sglang:max_total_num_tokens")


class SGLangReader:
    name = "sglang"

    def read(
        self,
        now: Exposition,
        before: Exposition | None,
        window: Window,
        window_s: float,
        taken_at_ms: int,
    ) -> EngineSnapshot:
        missing = [n for n in REQUIRED if not now.has(n)]
        if missing:
            raise ScrapeError("parse", "not an SGLang exposition: missing " + ", ".join(missing))

        def gauge(name: str) -> float:
            return now.total(name) or 0.0

        def counted(name: str) -> int:
            return count(gauge(name), name)

        queued = (
            gauge("sglang:num_queue_reqs")
            + gauge("sglang:num_decode_prealloc_queue_reqs")
            + gauge("sglang:num_decode_transfer_queue_reqs")
        )
        gen = rate(now, before, window_s, "sglang:generation_tokens_total")
        if gen is None:
            gen = rate(now, before, window_s, "sglang:realtime_tokens_total", mode="decode")
        if gen is None:
            gen = gauge("sglang:gen_throughput")
        prompt = rate(now, before, window_s, "sglang:prompt_tokens_total") or 0.0
        uncached = rate(
            now, before, window_s, "sglang:realtime_tokens_total", mode="prefill_compute"
        )
        if uncached is None:
            uncached = prompt * (1.0 - min(1.0, max(0.0, gauge("sglang:cache_hit_rate"))))
        p50, p99 = window_quantiles(now, before, ITL, 0.5, 0.99)
        speed = now.total("sglang:kv_transfer_speed_gb_s")
        mean_uncached = _mean_uncached_per_request(now, before, window, uncached, window_s)
        cached = rate(now, before, window_s, "sglang:realtime_tokens_total", mode="prefill_cache")
        if cached is None:  # older SGLang: prompt tokens (counted at finish) less the computed
            cached = max(0.0, prompt - uncached)
        mean_cached = _mean_per_request(now, before, window, "mean_cached", cached, window_s)
        return EngineSnapshot(
            taken_at_ms=taken_at_ms,
            source=self.name,
            running_requests=counted("sglang:num_running_reqs"),
            queued_requests=count(queued, "sglang:num_queue_reqs"),
            kv_used_tokens=counted("sglang:num_used_tokens"),
            kv_total_tokens=counted("sglang:max_total_num_tokens"),
            decode_context_tokens=counted("sglang:decode_sum_seq_lens"),
            generation_rate_tps=gen,
            prompt_rate_tps=prompt,
            itl_p50_ms=None if p50 is None else p50 * 1000.0,
            itl_p99_ms=None if p99 is None else p99 * 1000.0,
            kv_transfer_bytes_per_s=None if speed is None else speed * 1e9,
            kv_waiting_requests=counted("sglang:num_decode_prealloc_queue_reqs"),
            kv_waiting_tokens=_pending_prealloc_tokens(now),
            outstanding_uncached_tokens=count(
                gauge("sglang:num_queue_reqs") * mean_uncached, "outstanding_uncached_tokens"
            ),
            prefill_processing_rate_tps=uncached,
            prefill_mean_cached_tokens=mean_cached,
            window_s=window_s,
        )

    def totals(self, now: Exposition, at_s: float) -> StepTotals | None:
        """The step counters for online calibration (None: not an SGLang exposition with an
        ITL histogram)."""
        if any(not now.has(n) for n in REQUIRED) or not now.has(f"{ITL}_count"):
            return None
        decode = now.first("sglang:generation_tokens_total")
        if decode is None:
            decode = now.total("sglang:realtime_tokens_total", mode="decode")
        return _totals(
            at_s=at_s,
            steps=None,
            decode_tokens=decode or 0.0,
            itl_sum_s=now.total(f"{ITL}_sum") or 0.0,
            itl_count=now.total(f"{ITL}_count") or 0.0,
            prefill_tokens=now.total("sglang:realtime_tokens_total", mode="prefill_compute") or 0.0,
            cached_tokens=now.total("sglang:realtime_tokens_total", mode="prefill_cache") or 0.0,
            prompts=now.total("sglang:num_requests_total") or 0.0,
            running_requests=now.total("sglang:num_running_reqs") or 0.0,
            context_tokens=now.total("sglang:decode_sum_seq_lens") or 0.0,
            kv_total_tokens=now.total("sglang:max_total_num_tokens") or 0.0,
        )


def _pending_prealloc_tokens(now: Exposition) -> int | None:
    """KV tokens the decode prealloc queue waits for: each rank's usage x its KV total (None
    when no rank reports a positive usage)."""
    totals = {
        frozenset(labels.items()): value
        for labels, value in now.series.get("sglang:max_total_num_tokens", [])
    }
    tokens = 0.0
    for labels, usage in now.series.get(PENDING_PREALLOC, []):
        if usage > 0:
            tokens += usage * totals.get(frozenset(labels.items()), 0.0)
    return count(tokens, PENDING_PREALLOC) if tokens > 0 else None


def _mean_uncached_per_request(
    now: Exposition,
    before: Exposition | None,
    window: Window,
    uncached_tps: float,
    window_s: float,
) -> float:
    mean = _mean_per_request(now, before, window, "mean_uncached", uncached_tps, window_s)
    return 0.0 if mean is None else mean


def _mean_per_request(
    now: Exposition,
    before: Exposition | None,
    window: Window,
    key: str,
    tokens_tps: float,
    window_s: float,
) -> float | None:
    """``tokens_tps`` over the window per new request, remembered as ``key`` across windows
    with no new request (None before the first)."""
    new_requests = counter_delta(
        now.total("sglang:num_requests_total"),
        None if before is None else before.total("sglang:num_requests_total"),
    )
    if new_requests and new_requests > 0 and window_s > 0:
        window.memo[key] = tokens_tps * window_s / new_requests
    return window.memo.get(key)


def _totals(**values: Any) -> StepTotals | None:
    """The totals, or None when a counter or gauge is out of bounds (NaN, negative): the lease
    rules judge the snapshot; calibration just skips the scrape."""
    try:
        return StepTotals.model_validate(values)
    except ValidationError:
        return None
