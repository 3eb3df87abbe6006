"""Prometheus exposition text -> summed samples, and the ``rate()`` / ``histogram_quantile()``
arithmetic over two scrapes.

Parsing is prometheus_client's (``text_string_to_metric_families``). Series of one metric that
differ only in labels (data-parallel ranks, tensor-parallel ranks) are summed, unless a label
filter picks some of them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from crossflow_agent.sources.base import ScrapeError

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Exposition:
    """One scrape's samples: ``series[name]`` is every (labels, value) of that sample name."""

    series: Mapping[str, list[tuple[dict[str, str], float]]]

    def has(self, name: str) -> bool:
        return name in self.series

    def total(self, name: str, **match: str) -> float | None:
        """Sum of the samples named ``name`` whose labels include ``match`` (None if absent)."""
        rows = self.series.get(name)
        if rows is None:
            return None
        picked = [v for labels, v in rows if all(labels.get(k) == m for k, m in match.items())]
        return math.fsum(picked) if picked else None

    def first(self, *names: str, **match: str) -> float | None:
        """The total of the first of ``names`` present."""
        for name in names:
            value = self.total(name, **match)
            if value is not None:
                return value
        return None

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [labels for labels, _ in self.series.get(name, [])]

    def buckets(self, histogram: str) -> dict[float, float]:
        """Cumulative bucket counts of ``histogram`` by upper bound, summed over series."""
        out: dict[float, float] = defaultdict(float)
        for labels, value in self.series.get(f"{histogram}_bucket", []):
            le = labels.get("le")
            if le is None:
                continue
            out[float(le)] += value
        return dict(out)


def parse(text: str) -> Exposition:
    """Parse exposition text; a malformed document raises ScrapeError("parse")."""
    series: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series[sample.name].append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise ScrapeError("parse", f"bad exposition text: {exc}") from None
    return Exposition(series=dict(series))


def count(value: float, name: str) -> int:
    """A gauge that counts things, as an int; NaN or infinite is ScrapeError("implausible").

    Negative or over-large counts pass through: the lease rules judge those, with a reason.
    """
    if not math.isfinite(value):
        raise ScrapeError("implausible", f"{name} is {value}")
    return round(value)


def counter_delta(now: float | None, before: float | None) -> float | None:
    """Increase of a counter between two scrapes; a drop means a reset (as rate() treats it)."""
    if now is None or before is None:
        return None
    return now if now < before else now - before


def histogram_quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts (upper bound -> count).

    Linear interpolation inside the bucket where rank ``q * total`` falls, from the previous
    bound (0 for the first bucket). A rank in the +Inf bucket gives the highest finite bound.
    None when there are no observations.
    """
    bounds = sorted(cumulative)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = cumulative[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if bound <= 0:
                return bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def bucket_deltas(now: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    """Per-window cumulative counts; a reset (any bucket went down) uses ``now`` as is."""
    if any(now.get(le, 0.0) < before.get(le, 0.0) for le in now):
        return dict(now)
    return {le: now[le] - before.get(le, 0.0) for le in now}


@dataclass
class Window:
    """The previous scrape and its time, to turn counters into rates over the last window."""

    previous: Exposition | None = None
    previous_at_s: float = 0.0
    memo: dict[str, float] = field(default_factory=dict)
    """Source-specific values carried between windows (e.g. mean prompt length)."""

    def advance(self, now: Exposition, now_s: float) -> tuple[Exposition | None, float]:
        """Store ``now``; return the previous exposition and the window length in seconds."""
        before, before_s = self.previous, self.previous_at_s
        self.previous, self.previous_at_s = now, now_s
        if before is None or now_s <= before_s:
            return None, 0.0
        return before, now_s - before_s


def rate(
    now: Exposition, before: Exposition | None, window_s: float, name: str, **match: str
) -> float | None:
    """Per-second increase of counter ``name`` over the window (None without a window)."""
    if before is None or window_s <= 0:
        return None
    delta = counter_delta(now.total(name, **match), before.total(name, **match))
    return None if delta is None else delta / window_s


def window_quantiles(
    now: Exposition, before: Exposition | None, histogram: str, *qs: float
) -> list[float | None]:
    """Quantiles of the observations made during the window (None: none were made)."""
    if before is None:
        return [None for _ in qs]
    deltas = bucket_deltas(now.buckets(histogram), before.buckets(histogram))
    return [histogram_quantile(q, deltas) for q in qs]
