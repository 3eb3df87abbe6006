"""What the demo reads from the gateway's and the engines' ``/metrics`` (Prometheus text).

The gateway's own counters say which path requests took and how long they waited for their
first byte there; the engines' vLLM counters say where their prompt tokens came from
(``local_compute``: computed there; ``local_cache_hit``: found in its prefix cache;
``external_kv_transfer``: a decode engine's, prefilled on the prefill pool) and the decode
engines' ITL histograms how many tokens came over the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
Samples = dict[str, list[tuple[dict[str, str], float]]]

ITL_HISTOGRAM = "vllm:inter_token_latency_seconds"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def parse(text: str) -> Samples:
    """Every sample by its name (``..._total``, ``..._bucket`` as exposed)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        value
        for have, value in samples.get(name, [])
        if all(have.get(k) == v for k, v in labels.items())
    )


def by_label(
    samples: Samples, name: str, label: str, unless: tuple[str, str] | None = None
) -> dict[str, float]:
    """``name``'s samples summed by ``label``; ``unless=(label, value)`` leaves those out."""
    out: dict[str, float] = {}
    for have, value in samples.get(name, []):
        if unless is not None and have.get(unless[0]) == unless[1]:
            continue
        key = have.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


async def fetch(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> Samples:
    """GET ``url`` (a ``/metrics``) and parse it."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        return parse(await resp.text())


# -- the gateway ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GatewayFigures:
    """The gateway's counters (a fresh gateway per replay: its totals are the replay's)."""

    requests: dict[str, float] = field(default_factory=dict)
    """By path (``borrowed``, ``normal``, ``fallback``, ``error``), every status but 499 (the
    client left before the whole answer: the replay's requests cancelled when it stopped)."""
    ttft_sum_s: dict[str, float] = field(default_factory=dict)
    ttft_count: dict[str, float] = field(default_factory=dict)
    reasons: dict[str, float] = field(default_factory=dict)
    """Admission reasons (``borrowed``, ``no_demand``, ...)."""
    dispatch: dict[str, float] = field(default_factory=dict)
    """Late-binding outcomes (``not_held``, ``borrowed_late``, ``deadline``, ...)."""
    held_count: float = 0.0
    held_sum_s: float = 0.0
    reservations_open: float = 0.0
    broker_unavailable: float = 0.0
    failovers: float = 0.0

    def ttft_mean_ms(self, path: str) -> float | None:
        count = self.ttft_count.get(path, 0.0)
        return 1000.0 * self.ttft_sum_s.get(path, 0.0) / count if count else None

    @property
    def held_mean_ms(self) -> float:
        return 1000.0 * self.held_sum_s / self.held_count if self.held_count else 0.0

    @classmethod
    def read(cls, samples: Samples) -> GatewayFigures:
        return cls(
            requests=by_label(
                samples, "crossflow_gateway_requests_total", "path", unless=("code", "499")
            ),
            ttft_sum_s=by_label(samples, "crossflow_gateway_ttft_seconds_sum", "path"),
            ttft_count=by_label(samples, "crossflow_gateway_ttft_seconds_count", "path"),
            reasons=by_label(samples, "crossflow_gateway_admissions_total", "reason"),
            dispatch=by_label(samples, "crossflow_gateway_admissions_total", "dispatch"),
            held_count=total(samples, "crossflow_gateway_held_seconds_count"),
            held_sum_s=total(samples, "crossflow_gateway_held_seconds_sum"),
            reservations_open=total(samples, "crossflow_gateway_reservations_open"),
            broker_unavailable=total(samples, "crossflow_gateway_broker_unavailable_total"),
            failovers=total(samples, "crossflow_gateway_failovers_total"),
        )


# -- the engines ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineCounts:
    """One engine's counters at one moment."""

    prompt_tokens: dict[str, float] = field(default_factory=dict)
    """``vllm:prompt_tokens_by_source_total`` by source."""
    itl_buckets: dict[float, float] = field(default_factory=dict)
    """ITL histogram: cumulative count by upper bound (seconds; inf for +Inf)."""

    @classmethod
    def read(cls, samples: Samples) -> EngineCounts:
        buckets: dict[float, float] = {}
        for have, value in samples.get(f"{ITL_HISTOGRAM}_bucket", []):
            le = float(have.get("le", "inf"))
            buckets[le] = buckets.get(le, 0.0) + value
        return cls(by_label(samples, BY_SOURCE, "source"), buckets)

    def minus(self, before: EngineCounts) -> EngineCounts:
        return EngineCounts(
            {k: v - before.prompt_tokens.get(k, 0.0) for k, v in self.prompt_tokens.items()},
            {k: v - before.itl_buckets.get(k, 0.0) for k, v in self.itl_buckets.items()},
        )

    def tokens_over(self, slo_ms: float) -> tuple[float, float]:
        """(ITL observations above ``slo_ms``, all of them): the bucket bound at the SLO is
        the line (the demo's decode engines have one there)."""
        everything = self.itl_buckets.get(math.inf, 0.0)
        bounds = [b for b in self.itl_buckets if b <= slo_ms / 1000.0 + 1e-9]
        within = self.itl_buckets[max(bounds)] if bounds else 0.0
        return everything - within, everything


@dataclass(frozen=True)
class EngineTotals:
    """The engines' counters over one replay, summed."""

    borrowed_prompt_tokens: float = 0.0
    """Computed on a decode engine: borrowed prompts (and fallbacks)."""
    decode_cached_prompt_tokens: float = 0.0
    """Found in a decode engine's own prefix cache (a real vLLM decode engine looks there
    before it pulls the rest of a prompt's KV)."""
    transferred_prompt_tokens: float = 0.0
    """Prefilled on the prefill pool, KV moved to the decode engine."""
    computed_prompt_tokens: float = 0.0
    """Prompt tokens any engine computed (not found in its prefix cache)."""
    cached_prompt_tokens: float = 0.0
    """Prompt tokens any engine found in its prefix cache."""
    itl_over_slo: float = 0.0
    """Decode engines' ITL observations (one per token) over the SLO."""
    itl_observations: float = 0.0

    @classmethod
    def of(
        cls,
        after: Mapping[str, EngineCounts],
        before: Mapping[str, EngineCounts],
        decode: Iterable[str],
        slo_ms: float,
    ) -> EngineTotals:
        decode = set(decode)
        borrowed = decode_cached = moved = computed = cached = over = seen = 0.0
        for node, counts in after.items():
            d = counts.minus(before.get(node, EngineCounts()))
            computed += d.prompt_tokens.get("local_compute", 0.0)
            cached += d.prompt_tokens.get("local_cache_hit", 0.0)
            if node not in decode:
                continue  # a prefill engine's one token a request is no ITL
            borrowed += d.prompt_tokens.get("local_compute", 0.0)
            decode_cached += d.prompt_tokens.get("local_cache_hit", 0.0)
            moved += d.prompt_tokens.get("external_kv_transfer", 0.0)
            o, n = d.tokens_over(slo_ms)
            over, seen = over + o, seen + n
        return cls(borrowed, decode_cached, moved, computed, cached, over, seen)
