"""vLLM (v1 engine) ``/metrics`` -> EngineSnapshot.

Gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(a 0..1 fraction; ``vllm:gpu_cache_usage_perc`` on older releases) and the info gauge
``vllm:cache_config_info`` whose labels give ``num_gpu_blocks`` x ``block_size`` = KV token
slots (or ``kv_cache_size_tokens`` where present). Counters, as rates:
``vllm:generation_tokens_total``, ``vllm:prompt_tokens_total``, ``vllm:prefix_cache_queries_total``
/ ``vllm:prefix_cache_hits_total`` (uncached share of prompt tokens). Histograms:
``vllm:inter_token_latency_seconds`` (``vllm:time_per_output_token_seconds`` on older
releases) for ITL, ``vllm:request_prompt_tokens`` for the mean prompt length.

On a prefill server the mean cached prefix of a prompt (mean prompt length x the prefix cache's
hit share) lets the agent price the queued prompts' wait on its roofline, context cost
included; without prefix-cache counters it is not told. vLLM's
``vllm:request_prefill_time_seconds`` is per request and overlaps across a batch, so it is not
used as the server's time.

On a decode server the requests waiting for KV room are
``vllm:num_requests_waiting_by_reason{reason="capacity"}`` (v1; absent on older releases: 0).
vLLM does not tell their tokens, so the lease estimates them per request; borrowed prompts
waiting for KV are among them, so what the broker's debits count is counted twice (the safe
side).

vLLM exports no sum of decode context lengths; the KV tokens in use stand for it (the running
requests' contexts are what occupies the cache; shared prefixes make it an underestimate).

For online calibration (:meth:`VLLMReader.totals`, :mod:`crossflow_ctl.domain.step_fit`) the
counters as they stand: engine steps and their sizes (the ``vllm:iteration_tokens_total``
histogram: its count, sum and buckets), output tokens,
the ITL histogram's sum and count, uncached and cached prompt tokens
(``vllm:prompt_tokens_by_source_total{source="local_compute"|"local_cache_hit"}``; older
releases: ``prompt_tokens_total`` less ``prefix_cache_hits_total``, and those hits), prompts
prefilled (``time_to_first_token_seconds`` count) and, with ``--enable-mfu-metrics``, vLLM's own
FLOP and byte estimates (``estimated_flops_per_gpu_total``, ``estimated_{read,write}_bytes_per_
gpu_total``).
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

ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
CACHE_INFO = "vllm:cache_config_info"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
ITERATION = "vllm:iteration_tokens_total"


def _kv_total_tokens(now: Exposition) -> int:
    for labels in now.labels_of(CACHE_INFO):
        try:
            if labels.get("kv_cache_size_tokens", "").isdigit():
                return int(labels["kv_cache_size_tokens"])
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            continue
    raise ScrapeError("parse", f"{CACHE_INFO} has no num_gpu_blocks/block_size labels")


class VLLMReader:
    name = "vllm"

    def read(
        self,
        now: Exposition,
        before: Exposition | None,
        window: Window,
        window_s: float,
        taken_at_ms: int,
    ) -> EngineSnapshot:
        usage = now.first(*USAGE_NAMES)
        running = now.total("vllm:num_requests_running")
        if usage is None or running is None:
            raise ScrapeError("parse", "not a vLLM exposition: no running/KV usage gauges")
        total = _kv_total_tokens(now)
        used = count(usage * total, "vllm:kv_cache_usage_perc")
        waiting = now.total("vllm:num_requests_waiting") or 0.0
        gen = rate(now, before, window_s, "vllm:generation_tokens_total") or 0.0
        prompt = rate(now, before, window_s, "vllm:prompt_tokens_total") or 0.0
        uncached_share = self._uncached_share(now, before, window)
        itl = next((n for n in ITL_NAMES if now.has(f"{n}_bucket")), ITL_NAMES[0])
        p50, p99 = window_quantiles(now, before, itl, 0.5, 0.99)
        mean_prompt = self._mean_prompt(now, before, window)
        return EngineSnapshot(
            taken_at_ms=taken_at_ms,
            source=self.name,
            running_requests=count(running, "vllm:num_requests_running"),
            queued_requests=count(waiting, "vllm:num_requests_waiting"),
            kv_used_tokens=used,
            kv_total_tokens=total,
            decode_context_tokens=used if running > 0 else 0,
            generation_rate_tps=gen,
            prompt_rate_tps=prompt,
            itl_p50_ms=None if p50 is None else p50 * 1000.0,
            itl_p99_ms=None if p99 is None else p99 * 1000.0,
            kv_waiting_requests=count(
                now.total(WAITING_BY_REASON, reason="capacity") or 0.0, WAITING_BY_REASON
            ),
            outstanding_uncached_tokens=count(
                waiting * mean_prompt * uncached_share, "outstanding_uncached_tokens"
            ),
            prefill_processing_rate_tps=prompt * uncached_share,
            prefill_mean_cached_tokens=(
                mean_prompt * (1.0 - uncached_share) if "uncached_share" in window.memo else None
            ),
            window_s=window_s,
        )

    def totals(self, now: Exposition, at_s: float) -> StepTotals | None:
        """The step counters for online calibration (None: not a vLLM exposition with an ITL
        histogram)."""
        itl = next((n for n in ITL_NAMES if now.has(f"{n}_count")), None)
        usage = now.first(*USAGE_NAMES)
        running = now.total("vllm:num_requests_running")
        if itl is None or usage is None or running is None:
            return None
        try:
            kv_total = _kv_total_tokens(now)
        except ScrapeError:
            return None
        computed = now.total(BY_SOURCE, source="local_compute")
        cached = now.total(BY_SOURCE, source="local_cache_hit")
        if computed is None:
            hits = now.total("vllm:prefix_cache_hits_total") or 0.0
            computed = max(0.0, (now.total("vllm:prompt_tokens_total") or 0.0) - hits)
            cached = hits
        read = now.total("vllm:estimated_read_bytes_per_gpu_total")
        write = now.total("vllm:estimated_write_bytes_per_gpu_total")
        return _totals(
            at_s=at_s,
            steps=now.total(f"{ITERATION}_count"),
            step_tokens_sum=now.total(f"{ITERATION}_sum"),
            step_token_buckets=tuple(sorted(now.buckets(ITERATION).items())),
            decode_tokens=now.total("vllm:generation_tokens_total") or 0.0,
            itl_sum_s=now.total(f"{itl}_sum") or 0.0,
            itl_count=now.total(f"{itl}_count") or 0.0,
            prefill_tokens=computed,
            cached_tokens=cached or 0.0,
            prompts=now.first(
                "vllm:time_to_first_token_seconds_count", "vllm:request_prompt_tokens_count"
            )
            or 0.0,
            running_requests=running,
            context_tokens=usage * kv_total if running > 0 else 0.0,
            kv_total_tokens=kv_total,
            engine_flops=now.total("vllm:estimated_flops_per_gpu_total"),
            engine_bytes=None if read is None else read + (write or 0.0),
        )

    @staticmethod
    def _uncached_share(now: Exposition, before: Exposition | None, window: Window) -> float:
        if before is not None:
            queries = counter_delta(
                now.total("vllm:prefix_cache_queries_total"),
                before.total("vllm:prefix_cache_queries_total"),
            )
            hits = counter_delta(
                now.total("vllm:prefix_cache_hits_total"),
                before.total("vllm:prefix_cache_hits_total"),
            )
            if queries and hits is not None and queries > 0:
                window.memo["uncached_share"] = max(0.0, 1.0 - hits / queries)
        return window.memo.get("uncached_share", 1.0)

    @staticmethod
    def _mean_prompt(now: Exposition, before: Exposition | None, window: Window) -> float:
        if before is not None:
            total = counter_delta(
                now.total("vllm:request_prompt_tokens_sum"),
                before.total("vllm:request_prompt_tokens_sum"),
            )
            count = counter_delta(
                now.total("vllm:request_prompt_tokens_count"),
                before.total("vllm:request_prompt_tokens_count"),
            )
            if total is not None and count:
                window.memo["mean_prompt"] = total / count
        return window.memo.get("mean_prompt", 0.0)


def _totals(**values: Any) -> StepTotals | None:
    """The totals, or None when a counter or gauge is out of bounds (NaN, negative): the lease
    rules judge the snapshot; calibration just skips the scrape."""
    try:
        return StepTotals.model_validate(values)
    except ValidationError:
        return None
