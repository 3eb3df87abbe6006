"""What an engine's step counters say its steps did between two scrapes (online calibration).

An engine's ``/metrics`` carries cumulative counters: engine steps (vLLM's
``iteration_tokens_total`` count), output tokens, uncached prompt tokens computed, prompt tokens
served from the prefix cache, prompts prefilled, and the inter-token latency histogram's sum and
count; gauges give the running requests, the KV in use (the decode batch's context) and the KV
capacity. The readers turn one scrape into :class:`StepTotals`; two of them a window apart make a
:class:`StepWindow` (:func:`step_window`): N steps carried D output tokens and P uncached prompt
tokens, so the window's mean step had a decode batch ``B = D / N`` and a prefill chunk
``P / N`` over the mean cached prefix X, at the mean context C; its tokens waited
``y = itl_sum / itl_count`` between steps: the mean step time, as the decode batch lived it.

The fit of these windows is :mod:`crossflow_ctl.domain.step_fit`'s.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field

from crossflow_ctl.domain.models import Frozen

NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Count = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class StepTotals(Frozen):
    """An engine's step counters at one scrape, cumulative since it started (as it counts
    them), and the gauges the window needs. Built by the telemetry readers."""

    at_s: float
    """When the scrape was taken (the agent's monotonic seconds)."""
    steps: Count | None = None
    """Engine steps so far (vLLM: ``iteration_tokens_total`` count); None: not counted (SGLang),
    estimated per window from the output tokens and the running batch."""
    step_tokens_sum: Count | None = None
    step_token_buckets: tuple[tuple[float, float], ...] = ()
    """The tokens-per-step histogram so far: its sum, and (upper bound, cumulative count) per
    bucket, +Inf last (vLLM's ``iteration_tokens_total``); empty: not exported."""
    decode_tokens: Count = 0.0
    """Output tokens so far (each one a request's place in a step)."""
    itl_sum_s: NonNegative = 0.0
    itl_count: Count = 0.0
    """The inter-token latency histogram's sum and count."""
    prefill_tokens: Count = 0.0
    """Uncached prompt tokens computed so far."""
    cached_tokens: Count = 0.0
    """Prompt tokens served from the prefix cache so far."""
    prompts: Count = 0.0
    """Prompts whose prefill has ended so far (their first token came)."""
    running_requests: Count = 0.0
    context_tokens: Count = 0.0
    """Sum of the running requests' contexts now (vLLM: the KV in use)."""
    kv_total_tokens: Count = 0.0
    engine_flops: Count | None = None
    engine_bytes: Count | None = None
    """The engine's own analytic FLOPs and HBM bytes so far, where it exports them (vLLM with
    ``--enable-mfu-metrics``: ``estimated_flops_per_gpu_total``, ``estimated_read_bytes`` +
    ``write_bytes``); reported beside the model spec's, not fitted."""


class StepWindow(Frozen):
    """What an engine's steps did between two scrapes (:func:`step_window`)."""

    window_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
    steps: Count
    """Engine steps in the window (counted, or estimated: see :class:`StepTotals`)."""
    decode_tokens: Count
    prefill_tokens: Count
    """Uncached prompt tokens computed in the window."""
    mix: tuple[tuple[float, float], ...] = ()
    """How the window's steps carried prefill: (share of the steps, prefill tokens of such a
    step), shares summing to 1 (from the tokens-per-step histogram, else
    :func:`step_window`'s two-point guess); empty: every step carries the mean chunk."""
    context_tokens: Count
    """Mean context of the decode batch over the window (the two scrapes' mean)."""
    prefix_tokens: Count
    """Mean cached prefix of the prompts prefilled in the window (0 when none)."""
    itl_s: NonNegative
    """Mean inter-token latency of the window's tokens: the mean step time (0: no sample)."""
    itl_count: Count
    kv_total_tokens: Count = 0.0
    engine_flops_per_step: NonNegative | None = None
    engine_bytes_per_step: NonNegative | None = None

    @property
    def batch(self) -> float:
        """Mean decode batch of a step."""
        return self.decode_tokens / self.steps if self.steps > 0 else 0.0

    @property
    def chunk(self) -> float:
        """Mean uncached prompt tokens of a step."""
        return self.prefill_tokens / self.steps if self.steps > 0 else 0.0

    def steps_mix(self) -> tuple[tuple[float, float], ...]:
        """(share of steps, prefill tokens per such step): :attr:`mix`, or the mean chunk."""
        return self.mix or ((1.0, self.chunk),)


def _delta(now: float | None, before: float | None) -> float | None:
    if now is None or before is None:
        return None
    return now - before


STEP_TOKEN_BUCKETS: tuple[float, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, math.inf,
)  # fmt: skip
"""Upper bounds of a tokens-per-step histogram as vLLM buckets ``iteration_tokens_total``, for
engines that count their own (the simulator's servers)."""

DEFAULT_CHUNK_TOKENS = 2048
"""The prefill a step is taken to carry when the engine exports no tokens-per-step histogram."""


def _bucket_counts(
    now: tuple[tuple[float, float], ...], before: tuple[tuple[float, float], ...]
) -> list[tuple[float, float, float]] | None:
    """(lower bound, upper bound, steps) per bucket over the window; None when the buckets
    differ between the scrapes or a count went back."""
    if not now or len(now) != len(before):
        return None
    out: list[tuple[float, float, float]] = []
    low = prev_now = prev_before = 0.0
    for (le, cum), (le_before, cum_before) in zip(now, before, strict=True):
        if le != le_before:
            return None
        n = (cum - prev_now) - (cum_before - prev_before)
        if n < -1e-9:
            return None
        high = le if math.isfinite(le) else max(2.0 * low, 1.0)
        out.append((low, high, max(0.0, n)))
        low, prev_now, prev_before = high, cum, cum_before
    return out


def _mix_from_histogram(
    buckets: list[tuple[float, float, float]], tokens: float, batch: float
) -> tuple[tuple[float, float], ...]:
    """The steps of each bucket at one token count. A bucket that reaches no higher than the
    decode batch (one token per running request) holds decode steps: no prefill. The steps of
    the buckets above sit at their lower bound plus one common fraction of their width, the one
    that makes the window's tokens add up; their tokens beyond the batch are prefill."""
    steps = sum(n for _, _, n in buckets)
    if steps <= 0:
        return ()
    decode = [(lo, hi, n) for lo, hi, n in buckets if lo < batch or hi <= batch]
    chunked = [(lo, hi, n) for lo, hi, n in buckets if not (lo < batch or hi <= batch)]
    left = tokens - sum(n * min(hi, batch) for _, hi, n in decode)
    low_sum = sum(n * lo for lo, _, n in chunked)
    width = sum(n * (hi - lo) for lo, hi, n in chunked)
    frac = min(1.0, max(0.0, (left - low_sum) / width)) if width > 0 else 0.0
    shares: dict[float, float] = {0.0: sum(n for _, _, n in decode) / steps}
    for lo, hi, n in chunked:
        if n <= 0:
            continue
        prefill = max(0.0, lo + frac * (hi - lo) - batch)
        prefill = 0.0 if prefill < 1.0 else round(prefill, 3)
        shares[prefill] = shares.get(prefill, 0.0) + n / steps
    return tuple((share, prefill) for prefill, share in sorted(shares.items()) if share > 0)


def _two_point_mix(chunk: float, chunk_tokens: float) -> tuple[tuple[float, float], ...]:
    """Steps with no prefill and steps with a ``chunk_tokens`` chunk, in the shares that give
    the mean ``chunk`` (every step carries more when the mean is over it)."""
    if chunk <= 0:
        return ((1.0, 0.0),)
    if chunk >= chunk_tokens:
        return ((1.0, chunk),)
    share = chunk / chunk_tokens
    return ((1.0 - share, 0.0), (share, float(chunk_tokens)))


def step_window(
    before: StepTotals, now: StepTotals, *, chunk_tokens: float = DEFAULT_CHUNK_TOKENS
) -> StepWindow | None:
    """The window between two scrapes; None when it has no length or a counter went back (the
    engine restarted: the window means nothing). ``chunk_tokens``: the chunk a step with prefill
    is taken to carry when the engine exports no tokens-per-step histogram."""
    window_s = now.at_s - before.at_s
    if not window_s > 0 or not math.isfinite(window_s):
        return None
    decode = now.decode_tokens - before.decode_tokens
    prefill = now.prefill_tokens - before.prefill_tokens
    cached = now.cached_tokens - before.cached_tokens
    prompts = now.prompts - before.prompts
    itl_sum = now.itl_sum_s - before.itl_sum_s
    itl_count = now.itl_count - before.itl_count
    counted = _delta(now.steps, before.steps)
    flops = _delta(now.engine_flops, before.engine_flops)
    nbytes = _delta(now.engine_bytes, before.engine_bytes)
    if min(decode, prefill, cached, prompts, itl_sum, itl_count) < 0:
        return None
    if any(d is not None and d < 0 for d in (counted, flops, nbytes)):
        return None
    if counted is None:  # estimated: each step decodes one token per running request
        running = max(1.0, (before.running_requests + now.running_requests) / 2)
        steps = decode / running
    else:
        steps = counted
    per_step = steps if steps > 0 else 1.0
    batch = decode / per_step
    buckets = _bucket_counts(now.step_token_buckets, before.step_token_buckets)
    tokens = _delta(now.step_tokens_sum, before.step_tokens_sum)
    if buckets is not None and tokens is not None and tokens >= 0:
        mix = _mix_from_histogram(buckets, tokens, batch)
    else:
        mix = _two_point_mix(prefill / per_step, chunk_tokens)
    return StepWindow(
        window_s=window_s,
        steps=steps,
        decode_tokens=decode,
        prefill_tokens=prefill,
        mix=mix,
        context_tokens=(before.context_tokens + now.context_tokens) / 2,
        prefix_tokens=cached / prompts if prompts > 0 else 0.0,
        itl_s=itl_sum / itl_count if itl_count > 0 else 0.0,
        itl_count=itl_count,
        kv_total_tokens=now.kv_total_tokens,
        engine_flops_per_step=None if flops is None else flops / per_step,
        engine_bytes_per_step=None if nbytes is None else nbytes / per_step,
    )
