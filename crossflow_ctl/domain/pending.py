"""Prompts sent to the prefill pool that its load reports do not show yet (DESIGN.md §4.1).

Demand reads the pool's wait from its servers' last reports, one per agent period. Between two
reports every prompt routed to the pool is missing from them, so in a burst the wait lags the
queue by up to a period and Demand keeps failing while the queue grows. The broker knows of
the prompts it answered NO_DEMAND (a router sends those to the pool at once), so it adds them,
as a prompt is in no report stored before it was sent, and in those stored after.

"Before" is told by the store's ingest sequence of each report (``StoredPoolLoad.seq``), which
every replica reads alike, never by receipt times (each taken on the clock of whichever replica
ingested the report: with clocks skewed by s, a prompt sent up to s before a report would still
count until the server's next one). A prompt is stamped with the newest sequence the sending
replica had seen of its pool: a report with a sequence up to that one was stored before the
prompt was sent, so it cannot show it. A report with a higher one is taken to show it; one
stored between the replica's read and the send does not, which under-counts (the safe side).

Not knowing which server took a prompt, a prompt counts in the share of the pool's reports
stored before it was sent: all of them until the first server reports again, none once every
server has. A prompt sent to a named server (``AdmissionRequest.prefill_node_id``) of a pool
that reports waits in time counts on that server alone, until its own next report
(:func:`sent_to_servers`). Pure arithmetic; the bookkeeping is the broker's
(:mod:`crossflow_ctl.service.pending`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple


class Unreported(NamedTuple):
    """Uncached tokens sent to a pool that its reports do not show yet, as Demand counts them:
    ``shared``, spread over the pool (all of them, unless the pool reports waits in time), and
    ``by_server``, those sent to a named server that its own report does not show yet (pools
    reporting waits in time: each adds to its server's wait, :meth:`PoolSnapshot.
    estimated_wait_ms`)."""

    shared: int = 0
    by_server: Mapping[str, int] = MappingProxyType({})


NONE_UNREPORTED = Unreported()


def report_order(report_seqs: Sequence[int]) -> tuple[int, ...]:
    """A pool's report sequences in the order :func:`sent_weight` takes them. A report without
    a sequence (0: stored by a broker that predates them) cannot be placed before or after a
    prompt, so it is left out (taken to show every prompt: the safe side); kept, it would pin
    every prompt as unreported for as long as such reports keep coming."""
    return tuple(sorted(seq for seq in report_seqs if seq > 0))


def sequence_restarted(seqs: Sequence[int], previous: Sequence[int]) -> bool:
    """Whether the store's report sequence went back (a Redis restart without persistence, a
    flush, a failover that lost writes): every report now (``seqs``, sorted) is older than every
    one before (``previous``, the last non-empty ``seqs``, sorted). Without a restart that
    cannot happen: a server's next report takes a higher sequence than its last, and a server
    that joins one higher than all, so the newest report now is at least as new as the oldest
    before (expiries only remove reports)."""
    return bool(seqs) and bool(previous) and seqs[-1] < previous[0]


def sent_weight(seen_seq: int, tokens: int, seqs: Sequence[int]) -> int:
    """``tokens`` sent once the newest report seen was ``seen_seq``, times the number of reports
    (``seqs``, sorted) stored no later: the reports that do not show them. Divided by
    ``len(seqs)``, the tokens unreported."""
    return tokens * bisect_right(seqs, seen_seq)


def weighted_tokens(sent: Iterable[tuple[int, int]], seqs: Sequence[int]) -> int:
    """:func:`sent_weight` summed over ``sent`` ((newest sequence seen, uncached tokens) pairs)."""
    return sum(sent_weight(seen_seq, tokens, seqs) for seen_seq, tokens in sent)


def unreported_tokens(sent: Iterable[tuple[int, int]], report_seqs: Sequence[int]) -> int:
    """Tokens of ``sent`` ((newest report sequence seen when sent, uncached tokens) pairs) the
    pool's reports, stored with ``report_seqs`` (one per server), do not show yet: each prompt
    weighted by the share of reports stored no later than the newest it had seen (rounded
    down). No sequences: none (the conservative side: Demand then reads the reports alone)."""
    seqs = report_order(report_seqs)
    if not seqs:
        return 0
    return weighted_tokens(sent, seqs) // len(seqs)


def sent_to_servers(
    sent: Iterable[tuple[int, int, str]], server_seqs: Mapping[str, int]
) -> dict[str, int]:
    """Tokens of ``sent`` ((newest report sequence seen when sent, uncached tokens, server)
    triples) that their server's report (``server_seqs``: each live server's report sequence)
    does not show: that report was stored no later than the newest the sender had seen. A
    server without a live report, or whose report has no sequence (0), counts nothing (the
    first fails Demand anyway; the second is taken to show every prompt, as above)."""
    out: dict[str, int] = {}
    for seen_seq, tokens, server in sent:
        seq = server_seqs.get(server, 0)
        if 0 < seq <= seen_seq:
            out[server] = out.get(server, 0) + tokens
    return out
