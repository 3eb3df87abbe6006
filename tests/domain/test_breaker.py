"""Admission's circuit breaker over the store (domain.breaker), on a clock moved by hand."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from crossflow_ctl.domain.breaker import BreakerState, CircuitBreaker
from crossflow_ctl.domain.clock import ManualClock


def test_opens_after_consecutive_failures_only() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failures_to_open=3, probe_interval_ms=100)
    assert breaker.allows
    assert not breaker.failed() and not breaker.failed()
    assert not breaker.succeeded()  # a success between failures starts the count again
    assert not breaker.failed() and not breaker.failed()
    assert breaker.allows
    assert breaker.failed()  # the third in a row
    assert breaker.state is BreakerState.OPEN and not breaker.allows
    assert breaker.opened_at_ms == clock.now_ms()


def test_one_probe_per_interval_and_first_success_closes() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failures_to_open=1, probe_interval_ms=100)
    assert breaker.failed()
    assert not breaker.probe_due() and breaker.ms_to_probe() == 100
    clock.advance(99)
    assert not breaker.probe_due() and breaker.ms_to_probe() == 1
    clock.advance(1)
    assert breaker.probe_due()
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.allows
    clock.advance(10_000)
    assert not breaker.probe_due()  # one probe at a time, however long it takes
    breaker.probe_failed()
    assert breaker.state is BreakerState.OPEN and breaker.ms_to_probe() == 100
    clock.advance(100)
    assert breaker.probe_due() and breaker.probes == 2
    assert breaker.succeeded()  # half-open: the first success closes it
    assert breaker.allows and breaker.failures == 0


def test_late_calls_while_open() -> None:
    """A failure from a call made before the breaker opened changes nothing (the probe
    decides); a success from one closes it (the store answered)."""
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failures_to_open=2, probe_interval_ms=100)
    breaker.failed()
    breaker.failed()
    clock.advance(50)
    assert not breaker.failed()
    assert breaker.state is BreakerState.OPEN and breaker.ms_to_probe() == 50
    assert breaker.probe_due() is False
    clock.advance(50)
    assert breaker.probe_due()
    assert not breaker.failed()  # not the probe's outcome
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.probe_failed()
    assert breaker.succeeded()
    breaker.probe_failed()  # the probe's failure after a success closed it: stays closed
    assert breaker.allows
    # and it needs failures_to_open new failures to open again
    assert not breaker.failed()
    assert breaker.failed()


def test_bad_settings_refused() -> None:
    with pytest.raises(ValueError, match="failures_to_open"):
        CircuitBreaker(ManualClock(), failures_to_open=0, probe_interval_ms=100)
    with pytest.raises(ValueError, match="probe_interval_ms"):
        CircuitBreaker(ManualClock(), failures_to_open=1, probe_interval_ms=-1)


class BreakerMachine(RuleBasedStateMachine):
    """Any sequence of store outcomes, probes and clock moves keeps the breaker's promises."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.threshold = 3
        self.interval = 100
        self.breaker = CircuitBreaker(self.clock, self.threshold, self.interval)
        self.run = 0
        """Failures since the last success or opening, counted by the test."""
        self.probing = False
        self.quiet_since = self.clock.now_ms()
        """When the breaker last opened or a probe last failed."""

    @rule(ms=st.integers(min_value=0, max_value=250))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule()
    def fail(self) -> None:
        was = self.breaker.state
        opened = self.breaker.failed()
        if was is BreakerState.CLOSED:
            self.run += 1
            assert opened == (self.run == self.threshold)
            if opened:
                self.run, self.quiet_since = 0, self.clock.now_ms()
        else:  # a late failure while open or probing changes nothing
            assert not opened and self.breaker.state is was

    @rule()
    def succeed(self) -> None:
        was = self.breaker.state
        assert self.breaker.succeeded() == (was is not BreakerState.CLOSED)
        self.run, self.probing = 0, False
        assert self.breaker.allows

    @rule()
    def ask_probe(self) -> None:
        was = self.breaker.state
        due = self.breaker.probe_due()
        if due:
            assert was is BreakerState.OPEN and not self.probing
            assert self.clock.now_ms() - self.quiet_since >= self.interval
            self.probing = True
        elif was is BreakerState.OPEN:
            assert self.clock.now_ms() - self.quiet_since < self.interval

    @precondition(lambda self: self.probing)
    @rule()
    def probe_fails(self) -> None:
        self.breaker.probe_failed()
        self.probing = False
        self.quiet_since = self.clock.now_ms()
        assert self.breaker.state is BreakerState.OPEN

    @invariant()
    def states_agree(self) -> None:
        state = self.breaker.state
        assert self.breaker.allows == (state is BreakerState.CLOSED)
        assert (state is BreakerState.HALF_OPEN) == self.probing
        if state is BreakerState.CLOSED:
            assert self.breaker.failures == self.run < self.threshold
        else:
            assert 0 <= self.breaker.ms_to_probe() <= self.interval


TestBreakerMachine = BreakerMachine.TestCase
TestBreakerMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
