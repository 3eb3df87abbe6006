"""A circuit breaker over the store, as a pure state machine: no I/O, no timers, its clock given.

Admission waits for the store at most ``admit_timeout_ms`` (DESIGN.md §5.6). A store that stops
answering (a hung Redis: the socket open, no reply) would make every Admit wait that long; the
breaker turns repeated failures into an immediate NORMAL instead::

    CLOSED --failures_to_open consecutive failures--> OPEN
    OPEN --probe_interval_ms after it opened or its last probe failed--> HALF_OPEN (one probe)
    HALF_OPEN --the probe fails--> OPEN (the next probe probe_interval_ms later)
    any state --a store call succeeds--> CLOSED

Only CLOSED lets admission call the store. While OPEN or HALF_OPEN, one probe at a time (the
caller's, started when :meth:`CircuitBreaker.probe_due` says so) checks the store; its success,
or that of any call still in flight from before the breaker opened, closes it. A failure that
lands while it is not CLOSED comes from a call made before it opened and changes nothing: only
the probe's own outcome (:meth:`CircuitBreaker.probe_failed`) schedules the next probe.
"""

from __future__ import annotations

from enum import StrEnum

from crossflow_ctl.domain.clock import Clock


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


BREAKER_STATE_VALUES = {BreakerState.CLOSED: 0, BreakerState.OPEN: 1, BreakerState.HALF_OPEN: 2}
"""Each state as a number (a gauge's value)."""


class CircuitBreaker:
    """The state machine of the module docstring, on ``clock``'s milliseconds."""

    def __init__(self, clock: Clock, failures_to_open: int, probe_interval_ms: int) -> None:
        if failures_to_open < 1:
            raise ValueError("failures_to_open must be at least 1")
        if probe_interval_ms < 0:
            raise ValueError("probe_interval_ms must not be negative")
        self._clock = clock
        self.failures_to_open = failures_to_open
        self.probe_interval_ms = probe_interval_ms
        self.state = BreakerState.CLOSED
        self.failures = 0
        """Consecutive failures while CLOSED (0 once it opens or a call succeeds)."""
        self.opened_at_ms = 0
        """When it last opened (clock ms); meaningful while not CLOSED."""
        self.next_probe_ms = 0
        """When the next probe is due (clock ms); meaningful while OPEN."""
        self.probes = 0
        """Probes started since it last opened."""

    @property
    def allows(self) -> bool:
        """Whether admission may call the store now (CLOSED)."""
        return self.state is BreakerState.CLOSED

    def failed(self) -> bool:
        """A store call failed or timed out; True when this opened the breaker."""
        if self.state is not BreakerState.CLOSED:
            return False  # a call made before it opened: the probe decides
        self.failures += 1
        if self.failures < self.failures_to_open:
            return False
        now = self._clock.now_ms()
        self.state = BreakerState.OPEN
        self.failures = 0
        self.opened_at_ms = now
        self.next_probe_ms = now + self.probe_interval_ms
        self.probes = 0
        return True

    def succeeded(self) -> bool:
        """A store call answered; True when this closed the breaker."""
        self.failures = 0
        if self.state is BreakerState.CLOSED:
            return False
        self.state = BreakerState.CLOSED
        return True

    def probe_due(self) -> bool:
        """True, once, when a probe should start now: the breaker is OPEN and its next probe is
        due. It is then HALF_OPEN until the probe's outcome is recorded (:meth:`succeeded` or
        :meth:`probe_failed`), so at most one probe runs at a time."""
        if self.state is not BreakerState.OPEN or self._clock.now_ms() < self.next_probe_ms:
            return False
        self.state = BreakerState.HALF_OPEN
        self.probes += 1
        return True

    def probe_failed(self) -> None:
        """The probe found the store still failing: OPEN again, the next probe an interval on.
        Nothing changes unless a probe was running (a success may have closed it meanwhile)."""
        if self.state is BreakerState.HALF_OPEN:
            self.state = BreakerState.OPEN
            self.next_probe_ms = self._clock.now_ms() + self.probe_interval_ms

    def ms_to_probe(self) -> int:
        """Milliseconds until the next probe is due (0 when due now, or not OPEN)."""
        if self.state is not BreakerState.OPEN:
            return 0
        return max(0, self.next_probe_ms - self._clock.now_ms())
