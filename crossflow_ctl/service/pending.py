"""This replica's count of the prompts it sent to each prefill pool since the pool's reports.

Demand's wait lags the pool's queue by up to one report period
(:mod:`crossflow_ctl.domain.pending`). A prompt this replica answers NO_DEMAND goes to the
prefill pool at once (a router never holds it: there is no room to wait for when the pool is
not behind, and the client library's queue refuses to be configured to), so its uncached
tokens are added to the pool's wait until reports stored after it show it: a prompt is stamped
with the newest ingest sequence of the pool's reports this replica has seen (every replica
reads the same sequences; receipt times would compare clocks of different replicas). A prompt
answered NORMAL for another reason may be held by its router and reach the pool later or never
(borrowed on a re-offer): it is not counted.

Why this is safe for stateless brokers (DESIGN.md §6): it is soft state, in this process only,
never written to the store and never needed for correctness. Safety (no over-commit) is the
store's atomic check-and-debit, which this does not touch; the count only moves Demand's wait
toward what the pool will report anyway. What it misses only ever makes the wait lower, the
reports alone being the floor: prompts sent through other replicas, prompts a router held and
sent later, and everything before a restart. A lower wait means less borrowing, the side the
system falls back to. A prompt counts only until the reports stored after it, at most one
report period plus the replica's view cache age, so a count can never grow without bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType

from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.models import PoolSnapshot
from crossflow_ctl.domain.pending import (
    Unreported,
    report_order,
    sent_to_servers,
    sent_weight,
    sequence_restarted,
    weighted_tokens,
)

MAX_SENT = 65_536
"""Prompts remembered per pool: far more than one report period holds at any real rate; past
it the oldest are forgotten (under-counted, the safe side)."""


def sent_to_pool(request: AdmissionRequest, answer: Admission) -> bool:
    """Whether ``answer`` sends ``request`` to the prefill pool now: NORMAL because Demand
    failed (its plan's reason, also in shadow mode, where the router sends everything to
    prefill), on the first call of a request that is acted on (not a dry run, not a retry,
    whose first call was counted by whichever replica answered it)."""
    return (
        answer.decision is Decision.NORMAL
        and answer.plan is not None
        and answer.plan.reason is Reason.NO_DEMAND
        and not request.dry_run
        and request.attempt == 0
    )


@dataclass(slots=True)
class _Pool:
    sent: deque[tuple[int, int, str]] = field(default_factory=deque)
    """(newest report sequence seen when sent, uncached tokens, the prefill server it was
    sent to or ""), in the order sent."""
    seen_seq: int = 0
    """The newest report sequence of the pool this replica has seen (0: none)."""
    snapshot: PoolSnapshot | None = None
    """The snapshot ``weighted`` was computed for."""
    seqs: tuple[int, ...] = ()
    held: tuple[int, ...] = ()
    """The last non-empty ``seqs`` (to tell a restarted sequence)."""
    weighted: int = 0
    """Sum of ``sent_weight`` over ``sent`` at ``seqs``."""
    split_for: tuple[tuple[str, ...], tuple[int, ...]] | None = None
    """The reports (node ids, sequences) the split below is kept for (None: none kept): a
    snapshot with the same reports, rebuilt per Admit by the embedded store, shares it."""
    server_seqs: dict[str, int] = field(default_factory=dict)
    """Each live server's report sequence in those reports."""
    untargeted: int = 0
    """Sum of ``sent_weight`` over the prompts of ``sent`` sent to no named server."""
    by_server: dict[str, int] = field(default_factory=dict)
    """Tokens sent to each named server that its report does not show."""
    answered: tuple[PoolSnapshot, Unreported] | None = None
    """The last :meth:`SentToPools.unreported` answer and the snapshot it was for, until the
    book changes (anything sent, dropped or weighed anew drops it)."""


class SentToPools:
    """Per pool, the prompts this replica sent to it (see module docstring)."""

    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}

    def _pool(self, name: str) -> _Pool:
        """The pool's book (made once: ``setdefault`` would build a throwaway one per Admit)."""
        state = self._pools.get(name)
        if state is None:
            state = self._pools[name] = _Pool()
        return state

    def record(self, pool: str, tokens: int, server: str | None = None) -> None:
        """``tokens`` uncached tokens were sent to ``pool`` (to its prefill ``server``, when
        the router named one) now, after the newest of its reports this replica has seen
        (:meth:`tokens` sees them: Demand reads it before answering)."""
        if tokens <= 0:
            return
        state = self._pool(pool)
        state.answered = None
        if len(state.sent) >= MAX_SENT:
            entry = state.sent.popleft()
            state.weighted -= sent_weight(entry[0], entry[1], state.seqs)
            self._count(state, entry, -1)
        entry = (state.seen_seq, tokens, server or "")
        state.sent.append(entry)
        state.weighted += sent_weight(state.seen_seq, tokens, state.seqs)
        self._count(state, entry, 1)

    @staticmethod
    def _count(state: _Pool, entry: tuple[int, int, str], sign: int) -> None:
        """Keep the split of :meth:`unreported` up to date with one prompt added or dropped
        (each Admit's split is then O(servers), not a pass over every prompt remembered)."""
        if state.split_for is None:
            return
        seen, tokens, server = entry
        if not server:
            state.untargeted += sign * sent_weight(seen, tokens, state.seqs)
            return
        seq = state.server_seqs.get(server, 0)
        if 0 < seq <= seen:
            state.by_server[server] = state.by_server.get(server, 0) + sign * tokens

    def unreported(self, snapshot: PoolSnapshot) -> Unreported:
        """What Demand adds for the tokens sent to the pool that ``snapshot`` does not show:
        all of them spread over the pool (:meth:`tokens`), unless every server reports its
        wait in time; then those sent to a named server count on it until its own next report,
        the rest spread over the pool."""
        state = self._pool(snapshot.pool)
        answered = state.answered
        if answered is not None and answered[0] is snapshot and state.snapshot is snapshot:
            return answered[1]  # the same snapshot and book: the same answer (immutable)
        shared = self.tokens(snapshot)
        if not state.seqs or snapshot.server_waits_ms() is None:
            state.answered = (snapshot, Unreported(shared))
            return state.answered[1]
        known = snapshot.report_seqs
        key = (tuple(r.node_id for r in snapshot.reports), known)
        if state.split_for != key:
            state.server_seqs = dict(zip(key[0], known, strict=True)) if known else {}
            untargeted = ((seen, n) for seen, n, server in state.sent if not server)
            state.untargeted = weighted_tokens(untargeted, state.seqs)
            targeted = (e for e in state.sent if e[2])
            state.by_server = sent_to_servers(targeted, state.server_seqs)
            state.split_for = key
        # A fresh mapping, never the live one: callers keep what they were given (the
        # Admitter's Demand memo compares it with the next call's answer).
        by_server = MappingProxyType({k: v for k, v in state.by_server.items() if v > 0})
        state.answered = (snapshot, Unreported(state.untargeted // len(state.seqs), by_server))
        return state.answered[1]

    def tokens(self, snapshot: PoolSnapshot) -> int:
        """Uncached tokens sent to the pool that ``snapshot``'s reports do not show yet."""
        state = self._pool(snapshot.pool)
        if snapshot is not state.snapshot:
            seqs = report_order(snapshot.report_seqs)
            state.answered = None
            if sequence_restarted(seqs, state.held):
                # Every prompt is stamped with a sequence the new reports will not pass for
                # as long as the old ones lasted: forget them (the safe side) and start again.
                state.sent.clear()
                state.seen_seq = 0
                state.split_for = None
            if seqs:
                state.held = seqs
            if seqs and seqs[-1] > state.seen_seq:
                state.seen_seq = seqs[-1]
            if seqs != state.seqs:
                self._renew(state, seqs)
            state.snapshot = snapshot
        return state.weighted // len(state.seqs) if state.seqs else 0

    @staticmethod
    def _renew(state: _Pool, seqs: tuple[int, ...]) -> None:
        """New reports: forget the prompts every report shows (sent after the oldest was
        seen), and weigh the rest by the new reports."""
        if seqs:
            while state.sent and state.sent[0][0] < seqs[0]:
                state.sent.popleft()
        state.seqs = seqs
        state.split_for = None  # prompts were dropped and the weights change: split afresh
        state.weighted = weighted_tokens(((seen, n) for seen, n, _ in state.sent), seqs)
