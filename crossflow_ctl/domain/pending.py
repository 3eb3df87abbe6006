"""Prompts sent to the prefill pool that its load reports do not show yet (DESIGN.md §4.1).

Demand reads the pool's wait from its servers' last reports, one per agent period. Between two
reports every prompt routed to the pool is missing from them, so in a burst the wait lags the
queue by up to a period and Demand keeps failing while the queue grows. The broker knows of
the prompts it answered NO_DEMAND (a router sends those to the pool at once), so it adds them,
as a prompt sent at ``t`` is in a report received after ``t`` and in none received before.

Not knowing which server took a prompt, a prompt counts in the share of the pool's reports that
were received before it was sent: all of them until the first server reports again, none once
every server has. Pure arithmetic; the bookkeeping is the broker's
(:mod:`crossflow_ctl.service.pending`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence


def report_times(reported_at_ms: Sequence[int]) -> tuple[int, ...]:
    """A pool's report receipt times in the order :func:`sent_weight` takes them."""
    return tuple(sorted(reported_at_ms))


def sent_weight(at_ms: int, tokens: int, times: Sequence[int]) -> int:
    """``tokens`` sent at ``at_ms`` times the number of reports (``times``, sorted) received no
    later: the reports that do not show them. Divided by ``len(times)``, the tokens unreported."""
    return tokens * bisect_right(times, at_ms)


def weighted_tokens(sent: Iterable[tuple[int, int]], times: Sequence[int]) -> int:
    """:func:`sent_weight` summed over ``sent`` ((sent at ms, uncached tokens) pairs)."""
    return sum(sent_weight(at_ms, tokens, times) for at_ms, tokens in sent)


def unreported_tokens(sent: Iterable[tuple[int, int]], reported_at_ms: Sequence[int]) -> int:
    """Tokens of ``sent`` ((sent at ms, uncached tokens) pairs) the pool's reports, received at
    ``reported_at_ms`` (one per server), do not show yet: each prompt weighted by the share of
    reports received no later than it was sent (rounded down). No report times: none (the
    conservative side: Demand then reads the reports alone)."""
    if not reported_at_ms:
        return 0
    times = report_times(reported_at_ms)
    return weighted_tokens(sent, times) // len(times)
