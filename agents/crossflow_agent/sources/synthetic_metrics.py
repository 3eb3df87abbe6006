"""The synthetic engine's state as Prometheus text, in SGLang's or vLLM's (v1) format.

Both are rendered with prometheus_client from custom collectors over the engine's counters and
histograms, with the metric names, labels and help texts the real engines use, so the real
readers (:mod:`crossflow_agent.sources.sglang`, :mod:`crossflow_agent.sources.vllm`) parse them.

vLLM format: gauges ``vllm:num_requests_running`` (decoding, and prefilling once a chunk of
the prompt was scheduled), ``vllm:num_requests_waiting`` (queued, receiving KV, or admitted but
not yet given a prefill chunk: vLLM v1 keeps a request in its waiting queue until the scheduler
first gives it tokens), ``vllm:num_requests_waiting_by_reason``
(``capacity``: queued for a slot or KV room; ``deferred``: waiting for remote KV),
``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info`` (``block_size`` 16,
``num_gpu_blocks`` = KV tokens // 16); counters ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total`` / ``_hits_total`` (local
prompt tokens / their cached share), ``vllm:prompt_tokens_by_source_total{source=
"local_compute"|"local_cache_hit"|"external_kv_transfer"}`` (summing to
``vllm:prompt_tokens_total``), ``vllm:num_preemptions_total`` (0), ``vllm:request_success_total``;
histograms ``vllm:inter_token_latency_seconds``, ``vllm:time_to_first_token_seconds``,
``vllm:request_prompt_tokens``, ``vllm:iteration_tokens_total``,
``vllm:request_prefill_time_seconds``. Every series has ``model_name`` and ``engine="0"``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from crossflow_agent.sources.synthetic import SyntheticEngine

VLLM_BLOCK_TOKENS = 16
ITL_BUCKETS_S = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.0,
    2.0,
    5.0,
)
TTFT_BUCKETS_S: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25)
TTFT_BUCKETS_S += (0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_TIME_BUCKETS_S: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0)
REQUEST_TIME_BUCKETS_S += (15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
REQUEST_TIME_BUCKETS_S += (7680.0,)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PROMPT_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


@dataclass
class Histogram:
    """Counts per bucket (the last one past every bound) and the sum of what was observed."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, count: int = 1) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += count
                break
        else:
            self.counts[-1] += count
        self.sum += value * count

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            buckets.append((le, float(cumulative)))
        family.add_metric(labels, buckets, self.sum)


def _render(collector: Collector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def render_sglang(engine: SyntheticEngine) -> str:
    return _render(_SGLangCollector(engine))


def render_vllm(engine: SyntheticEngine) -> str:
    return _render(_VLLMCollector(engine))


class _SGLangCollector(Collector):
    def __init__(self, engine: SyntheticEngine) -> None:
        self.e = engine

    def collect(self) -> Iterator[Metric]:
        e = self.e
        sched = {
            "model_name": e.model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
        }
        tok = {"model_name": e.model_name}
        total = e.script.kv_total_tokens
        used = e.kv_used_tokens
        prompt = e.counters["prompt"]
        gauges: list[tuple[str, str, float]] = [
            ("num_running_reqs", "The number of running requests.", len(e.running)),
            ("num_used_tokens", "The number of used tokens.", used),
            ("token_usage", "The token usage.", used / total),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", total),
            (
                "decode_sum_seq_lens",
                "The sum of all sequence lengths in decode.",
                sum(r.kv_now for r in e.running),
            ),
            ("gen_throughput", "The generation throughput (token/s).", e._last_gen_tps),
            (
                "num_queue_reqs",
                "The number of requests in the waiting queue.",
                len(e.waiting) + len(e.prefilling) + len(e.transferring),
            ),
            (
                "cache_hit_rate",
                "The prefix cache hit rate.",
                e.counters["prefill_cache"] / prompt if prompt else 0.0,
            ),
            (
                "kv_transfer_speed_gb_s",
                "The transfer speed of the KV cache in GB/s.",
                e.script.kv_transfer_gb_s,
            ),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"sglang:{name}", doc, labels=list(sched))
            g.add_metric(list(sched.values()), float(value))
            yield g
        rt = CounterMetricFamily(
            "sglang:realtime_tokens",
            "Total number of tokens processed.",
            labels=[*sched, "mode"],
        )
        for mode in ("prefill_compute", "prefill_cache", "decode"):
            rt.add_metric([*sched.values(), mode], float(e.counters[mode]))
        yield rt
        for name, doc, key in (
            ("prompt_tokens", "Number of prefill tokens processed.", "prompt"),
            ("generation_tokens", "Number of generation tokens processed.", "generation"),
            ("num_requests", "Number of requests processed.", "requests"),
        ):
            c = CounterMetricFamily(f"sglang:{name}", doc, labels=list(tok))
            c.add_metric(list(tok.values()), float(e.counters[key]))
            yield c
        h = HistogramMetricFamily(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels=list(tok),
        )
        e.itl.add_to(h, list(tok.values()))
        yield h


class _VLLMCollector(Collector):
    def __init__(self, engine: SyntheticEngine) -> None:
        self.e = engine

    def collect(self) -> Iterator[Metric]:
        e = self.e
        base = {"model_name": e.model_name, "engine": "0"}
        keys, values = list(base), list(base.values())
        c = e.counters
        yield from self._gauges(keys, values)
        info_labels = {
            "block_size": str(VLLM_BLOCK_TOKENS),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": "0",
            "num_gpu_blocks": str(e.script.kv_total_tokens // VLLM_BLOCK_TOKENS),
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(info_labels),
        )
        info.add_metric(list(info_labels.values()), 1.0)
        yield info
        local = c["prompt"] - c["prefill_transfer"]
        for name, doc, value in (
            ("prompt_tokens", "Number of prefill tokens processed.", c["prompt"]),
            ("generation_tokens", "Number of generation tokens processed.", c["generation"]),
            (
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                local,
            ),
            (
                "prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                c["prefill_cache"],
            ),
            ("num_preemptions", "Cumulative number of preemption from the engine.", 0),
        ):
            counter = CounterMetricFamily(f"vllm:{name}", doc, labels=keys)
            counter.add_metric(values, float(value))
            yield counter
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*keys, "source"],
        )
        for source, value in (
            ("local_compute", local - c["prefill_cache"]),
            ("local_cache_hit", c["prefill_cache"]),
            ("external_kv_transfer", c["prefill_transfer"]),
        ):
            by_source.add_metric([*values, source], float(value))
        yield by_source
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*keys, "finished_reason"],
        )
        success.add_metric([*values, "length"], float(c["requests"]))
        yield success
        for name, doc, hist in (
            (
                "inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                e.itl,
            ),
            (
                "time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                e.ttft,
            ),
            ("request_prompt_tokens", "Number of prefill tokens processed.", e.request_prompt),
            (
                "iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                e.step_tokens,
            ),
            (
                "request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                e.prefill_time,
            ),
        ):
            family = HistogramMetricFamily(f"vllm:{name}", doc, labels=keys)
            hist.add_to(family, values)
            yield family

    def _gauges(self, keys: list[str], values: list[str]) -> Iterator[Metric]:
        e = self.e
        # Prompts admitted but not given a chunk yet are still in vLLM's waiting queue: counted
        # running, a prefill server's queue read as empty however long it was, and the agent
        # reported no prompt work outstanding (no Demand) under any load.
        started = sum(1 for r in e.prefilling if r.prefilled > 0)
        for name, doc, value in (
            (
                "num_requests_running",
                "Number of requests in model execution batches.",
                len(e.running) + started,
            ),
            (
                "num_requests_waiting",
                "Number of requests waiting to be processed.",
                len(e.waiting) + len(e.transferring) + len(e.prefilling) - started,
            ),
            (
                "kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                e.kv_used_tokens / e.script.kv_total_tokens,
            ),
        ):
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=keys)
            g.add_metric(values, float(value))
            yield g
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting to be processed, by reason.",
            labels=[*keys, "reason"],
        )
        by_reason.add_metric([*values, "capacity"], float(len(e.waiting)))
        by_reason.add_metric([*values, "deferred"], float(len(e.transferring)))
        yield by_reason
