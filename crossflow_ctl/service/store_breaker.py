"""Admission's fail-fast while the store does not answer (issue 29): the domain's
:class:`~crossflow_ctl.domain.breaker.CircuitBreaker`, its probe, its metric and its log lines.

Admission reports the outcome of its store calls (:meth:`StoreBreaker.succeeded` after a debit
round answered, :meth:`StoreBreaker.failed` after a store error or the admission deadline).
After ``failures_to_open`` failures in a row the breaker opens: :attr:`StoreBreaker.allows` is
then False and admission answers :attr:`StoreBreaker.answer` (NORMAL, reason
STORE_UNAVAILABLE) at once, without calling the store, so a hung store costs each Admit nothing
rather than the full ``admit_timeout_ms``. One probe task, started when it opens, pings the
store every ``probe_interval_ms`` (each ping bounded by ``probe_timeout_ms``) until a ping
answers, which closes the breaker (so does any store call that answers meanwhile); the task
then ends. Its state is the gauge ``crossflow_broker_store_breaker_state``.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from crossflow_ctl.aio import within
from crossflow_ctl.domain.admission import Admission, Reason
from crossflow_ctl.domain.breaker import BREAKER_STATE_VALUES, CircuitBreaker
from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.observability import BrokerMetrics
from crossflow_ctl.service.config import StoreBreakerSettings
from crossflow_ctl.store.base import Store

log = structlog.get_logger()


class StoreBreaker:
    """The breaker of one replica's admission over ``store`` (module docstring)."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        settings: StoreBreakerSettings,
        metrics: BrokerMetrics,
    ) -> None:
        self._store = store
        self._clock = clock
        self._settings = settings
        self._metrics = metrics
        self.state = CircuitBreaker(clock, settings.failures_to_open, settings.probe_interval_ms)
        self._probe: asyncio.Task[None] | None = None
        self._stopped = False
        self.answered = 0
        """Admits answered at once (without the store) since the breaker last opened."""
        self.answer = Admission.normal(
            Reason.STORE_UNAVAILABLE,
            "store unavailable: admission's circuit breaker is open after "
            f"{settings.failures_to_open} consecutive store failures; probing every "
            f"{settings.probe_interval_ms} ms",
        )
        """The answer to every Admit while the breaker is not closed."""
        metrics.set_store_breaker(BREAKER_STATE_VALUES[self.state.state])

    @property
    def allows(self) -> bool:
        """Whether admission may call the store (always, when the breaker is disabled)."""
        return self.state.allows

    def refused(self, count: int) -> list[Admission]:
        """``count`` answers given without the store while the breaker is not closed."""
        self.answered += count
        return [self.answer] * count

    def succeeded(self) -> None:
        """A store call of admission answered."""
        if self.state.succeeded():
            self._closed("a store call answered")

    def failed(self, error: str) -> None:
        """A store call of admission failed or ran past its deadline (``error`` says which)."""
        if not self._settings.enabled or not self.state.failed():
            return
        self.answered = 0
        self._metrics.record_store_breaker_open()
        self._publish()
        log.warning(
            "store.breaker_open",
            failures=self._settings.failures_to_open,
            error=error,
            effect="Admit answers NORMAL (store_unavailable) without calling the store until "
            "a probe or store call answers",
            probe_interval_ms=self._settings.probe_interval_ms,
        )
        if self._probe is None and not self._stopped:
            self._probe = asyncio.get_running_loop().create_task(
                self._probe_until_closed(), name="store-breaker-probe"
            )

    async def close(self) -> None:
        """Stop the probe, if one runs, and start none again (at shutdown)."""
        self._stopped = True
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe

    def _publish(self) -> None:
        self._metrics.set_store_breaker(BREAKER_STATE_VALUES[self.state.state])

    def _closed(self, why: str) -> None:
        self._publish()
        log.warning(
            "store.breaker_closed",
            why=why,
            open_ms=self._clock.now_ms() - self.state.opened_at_ms,
            probes=self.state.probes,
            answered_without_store=self.answered,
        )

    async def _probe_until_closed(self) -> None:
        """One ping at a time, each ``probe_interval_ms`` after the last failed one, until the
        breaker closes (a ping answers, or an admission store call did)."""
        state, timeout_s = self.state, self._settings.probe_timeout_ms / 1000.0
        try:
            while not state.allows:
                # at least a millisecond: a clock that does not move must not spin the loop
                await asyncio.sleep(max(state.ms_to_probe(), 1) / 1000.0)
                if not state.probe_due():
                    continue
                self._publish()
                try:
                    await within(self._store.ping(), timeout_s)
                except Exception as exc:  # still failing: StoreUnavailable, a timeout, anything
                    state.probe_failed()
                    self._publish()
                    log.debug("store.breaker_probe_failed", error=repr(exc))
                else:
                    if state.succeeded():
                        self._closed("a probe answered")
        finally:
            if self._probe is asyncio.current_task():
                self._probe = None
