"""This replica's count of the prompts it sent to each prefill pool since the pool's reports.

Demand's wait lags the pool's queue by up to one report period
(:mod:`crossflow_ctl.domain.pending`). A prompt this replica answers NO_DEMAND goes to the
prefill pool at once (a router never holds it: there is no room to wait for when the pool is
not behind, and the client library's queue refuses to be configured to), so its uncached
tokens are added to the pool's wait until reports received after it show it. A prompt answered
NORMAL for another reason may be held by its router and reach the pool later or never
(borrowed on a re-offer): it is not counted.

Why this is safe for stateless brokers (DESIGN.md §6): it is soft state, in this process only,
never written to the store and never needed for correctness. Safety (no over-commit) is the
store's atomic check-and-debit, which this does not touch; the count only moves Demand's wait
toward what the pool will report anyway. What it misses only ever makes the wait lower, the
reports alone being the floor: prompts sent through other replicas, prompts a router held and
sent later, and everything before a restart. A lower wait means less borrowing, the side the
system falls back to. A prompt counts only until the reports received after it, at most one
report period plus the replica's view cache age, so a count can never grow without bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.models import PoolSnapshot
from crossflow_ctl.domain.pending import report_times, sent_weight, weighted_tokens

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
    sent: deque[tuple[int, int]] = field(default_factory=deque)
    """(sent at ms, uncached tokens), in the order sent."""
    snapshot: PoolSnapshot | None = None
    """The snapshot ``weighted`` was computed for."""
    times: tuple[int, ...] = ()
    weighted: int = 0
    """Sum of ``sent_weight`` over ``sent`` at ``times``."""


class SentToPools:
    """Per pool, the prompts this replica sent to it (see module docstring)."""

    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}

    def record(self, pool: str, tokens: int, now_ms: int) -> None:
        """``tokens`` uncached tokens were sent to ``pool`` at ``now_ms``."""
        if tokens <= 0:
            return
        state = self._pools.setdefault(pool, _Pool())
        if len(state.sent) >= MAX_SENT:
            at_ms, old = state.sent.popleft()
            state.weighted -= sent_weight(at_ms, old, state.times)
        state.sent.append((now_ms, tokens))
        state.weighted += sent_weight(now_ms, tokens, state.times)

    def tokens(self, snapshot: PoolSnapshot) -> int:
        """Uncached tokens sent to the pool that ``snapshot``'s reports do not show yet."""
        state = self._pools.get(snapshot.pool)
        if state is None or not snapshot.reported_at_ms:
            return 0
        if snapshot is not state.snapshot:
            times = report_times(snapshot.reported_at_ms)
            if times != state.times:
                self._renew(state, times)
            state.snapshot = snapshot
        return state.weighted // len(state.times)

    @staticmethod
    def _renew(state: _Pool, times: tuple[int, ...]) -> None:
        """New reports: forget the prompts every report shows (sent before the oldest), and
        weigh the rest by the new reports."""
        while state.sent and state.sent[0][0] < times[0]:
            state.sent.popleft()
        state.times = times
        state.weighted = weighted_tokens(state.sent, times)
