"""Late binding for routers: hold prompts while the prefill pool is behind and no decode node
has room, re-offer them when room appears, send them to prefill when prefill has room.

Transport-agnostic: an :class:`AdmissionQueue` is given an :class:`Admitter` (anything with
``async admit(AdmissionRequest) -> Admission``: the gRPC ``AdmissionClient``, or the service
``Broker`` in-process) and is fed room updates (``RoomUpdate``: the broker's ``WatchRoom``
stream via :meth:`AdmissionQueue.run`, or a simulator calling :meth:`AdmissionQueue.on_room`).

Every submitted prompt gets exactly one :class:`Outcome`: BORROW with a reservation (commit it
at once: it is HELD only for the policy's ``hold_ttl_ms``), or NORMAL with the broker's reason
and the :class:`Dispatch` cause. It is delivered through the :class:`Ticket` ``submit`` returns
(``await ticket``) and the ``on_outcome`` callback, synchronously, the moment it is decided.

Driving it:

* live: ``asyncio.create_task(queue.run(client.room_updates()))``; ``run`` also fires hold
  deadlines and re-asks ``prefill_room`` every ``recheck_ms`` on the system clock, and closes
  the queue when the stream ends or the task is cancelled;
* discrete-event (no sleeps): give it a ``ManualClock`` and call ``submit``, ``on_room`` and
  ``tick`` yourself (``on_room``, ``tick`` and ``close`` return the outcomes they decided);
  ``next_deadline_ms()`` says when the next hold deadline falls. Nothing here sleeps or spawns
  a task outside ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Callable, Generator
from typing import Any, Protocol, TypeVar

import structlog

from crossflow_ctl.client.holding import Dispatch, Held, HoldBook, PassRoom, QueueConfig, Step
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.clock import Clock, SystemClock
from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.domain.room import RoomUpdate

log = structlog.get_logger()
R = TypeVar("R")


class Admitter(Protocol):
    async def admit(self, request: AdmissionRequest) -> Admission: ...


class Outcome(Frozen):
    request: AdmissionRequest
    admission: Admission
    """BORROW with node and reservation, or NORMAL with the reason the broker last gave."""
    dispatch: Dispatch
    held_ms: int = 0
    """Time between submit and this outcome, on the queue's clock."""
    offers: int = 1
    """Admit calls made for this prompt."""
    held: bool = False
    """Whether it was held (its outcome came after the first answer, not with it)."""

    @property
    def borrowed(self) -> bool:
        return self.admission.decision is Decision.BORROW


class Ticket:
    """One submitted prompt; ``await ticket`` gives its :class:`Outcome`."""

    def __init__(self, request: AdmissionRequest) -> None:
        self.request = request
        self._outcome: Outcome | None = None
        self._future: asyncio.Future[Outcome] | None = None

    @property
    def outcome(self) -> Outcome | None:
        return self._outcome

    def done(self) -> bool:
        return self._outcome is not None

    def _resolve(self, outcome: Outcome) -> None:
        if self._outcome is not None:
            raise RuntimeError("a prompt gets exactly one outcome")
        self._outcome = outcome
        if self._future is not None and not self._future.done():
            self._future.set_result(outcome)

    async def wait(self) -> Outcome:
        if self._outcome is not None:
            return self._outcome
        if self._future is None or self._future.done():
            self._future = asyncio.get_running_loop().create_future()
        return await self._future

    def __await__(self) -> Generator[Any, None, Outcome]:
        return self.wait().__await__()


class QueueObserver(Protocol):
    """Metrics hooks; every method is called synchronously and must not raise."""

    def held_changed(self, held: int) -> None: ...
    def reoffered(self, request: AdmissionRequest) -> None: ...
    def decided(self, outcome: Outcome) -> None: ...


class QueueStats:
    """Counters the queue always keeps (``queue.stats``); also usable as an observer."""

    def __init__(self) -> None:
        self.held = 0
        self.max_held = 0
        self.reoffers = 0
        self.by_dispatch: dict[Dispatch, int] = {}
        self.hold_ms_total = 0
        self.held_outcomes = 0

    def held_changed(self, held: int) -> None:
        self.held = held
        self.max_held = max(self.max_held, held)

    def reoffered(self, request: AdmissionRequest) -> None:
        self.reoffers += 1

    def decided(self, outcome: Outcome) -> None:
        self.by_dispatch[outcome.dispatch] = self.by_dispatch.get(outcome.dispatch, 0) + 1
        if outcome.held:
            self.hold_ms_total += outcome.held_ms
            self.held_outcomes += 1


PrefillRoom = Callable[[AdmissionRequest], bool]
"""The router's word that prefill can take this prompt now (e.g. its pool wait is short)."""


class AdmissionQueue:
    def __init__(
        self,
        admitter: Admitter,
        config: QueueConfig | None = None,
        *,
        clock: Clock | None = None,
        prefill_room: PrefillRoom | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
        observer: QueueObserver | None = None,
        prefill_target: Callable[[AdmissionRequest], str | None] | None = None,
    ) -> None:
        """``prefill_target``: the prefill server the router would send a held prompt to now,
        named on each re-offer (a router that picks servers by load); without it a re-offer
        names none and the broker judges the least-loaded server's wait."""
        self.admitter = admitter
        self.prefill_target = prefill_target
        self.config = config or QueueConfig()
        self.clock: Clock = clock or SystemClock()
        self.prefill_room = prefill_room
        self.on_outcome = on_outcome
        self.stats = QueueStats()
        self._observers: list[QueueObserver] = [self.stats] + ([observer] if observer else [])
        self._book: HoldBook[Ticket] = HoldBook(self.config)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._closed = False
        self._step: list[Outcome] = []
        """Outcomes decided by the on_room / tick / close call in progress."""

    # -- state -------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        return len(self._book)

    @property
    def closed(self) -> bool:
        return self._closed

    def held_requests(self) -> list[AdmissionRequest]:
        return [h.request for h in self._book.ordered()]

    def next_deadline_ms(self) -> int | None:
        """When the earliest hold deadline falls (queue clock), None when nothing is held."""
        return self._book.next_deadline_ms()

    def poke(self) -> None:
        """Tell a running queue that prefill may have room now (re-asks ``prefill_room``)."""
        self._wake.set()

    # -- the three inputs: a prompt, a room update, time ----------------------------------------
    async def submit(self, request: AdmissionRequest) -> Ticket:
        """Offer ``request`` once; hold it if the answer is worth holding for. The returned
        ticket is already done unless the prompt is held. An error of this first Admit (bad
        input, or a client that does not fail closed) propagates and nothing is held; errors
        of later re-offers never do (they read as BROKER_UNAVAILABLE: everything held goes to
        prefill)."""
        ticket = Ticket(request)
        since = self.clock.now_ms()
        admission = await self.admitter.admit(self._with_ahead(request))
        async with self._lock:
            self._step = []
            if admission.decision is Decision.BORROW:
                self._decide(ticket, admission, Dispatch.BORROWED, since, 1)
                return ticket
            if self._closed:
                cause = self._closed_cause(self._book.worth_holding(admission))
                self._decide(ticket, admission, cause, since, 1)
                return ticket
            if self._book.worth_holding(admission) and self._prefill_has_room(request):
                self._decide(ticket, admission, Dispatch.PREFILL_ROOM, since, 1)
                return ticket
            refused = self._book.hold(ticket, request, admission, since)
            if refused is not None:
                self._decide(ticket, admission, refused, since, 1)
            else:
                self._held_changed()
                self._wake.set()
        return ticket

    async def on_room(self, update: RoomUpdate) -> list[Outcome]:
        """A room update: dispatch everything if Demand is gone or room is unknown; else
        re-offer held prompts in order until one is refused (a queue that is behind offers
        fresh prompts first and skips refusals: ``QueueConfig.fresh_first_ms``); a prompt the
        pass's own grants left no room for counts as refused without its Admit
        (:class:`PassRoom`). Then deadlines and prefill room.
        Returns the outcomes decided here, in order (also delivered to tickets and callback)."""
        async with self._lock:
            self._step = []
            self._expire()
            cause = self._book.on_room(update.view)
            if cause is not None:
                self._dispatch_all(cause)
                return self._step
            # A queue that is behind skips a refused prompt; else the pass ends there, so no
            # prompt overtakes an older one that found no room.
            now_ms = self.clock.now_ms()
            skip_refused = self._book.behind(now_ms)
            room = PassRoom(update.view, with_kv=skip_refused)
            borrowed: list[tuple[int, int]] = []
            """(tokens held ahead, own tokens) of each prompt this pass borrowed: those ahead
            of a later re-offered prompt (fewer tokens ahead) are no longer ahead of it."""
            for held, ahead in self._book.to_reoffer(update.view, now_ms):
                if held.key not in self._book:
                    continue
                if not room.fits(held):  # refused, as its Admit would be, without the Admit
                    if skip_refused:
                        continue
                    break
                for observer in self._observers:
                    observer.reoffered(held.request)
                gone = sum(tokens for at, tokens in borrowed if at < ahead)
                request = self._book.reoffer_request(
                    held, ahead - gone, self._prefill_target_of(held.request)
                )
                admission = await self._reoffer(request)
                step = self._book.answered(held, admission)
                if step is Step.BORROWED:
                    room.took(admission)
                    borrowed.append((ahead, held.request.uncached_prompt_tokens))
                    self._finish(held, admission, Dispatch.BORROWED_LATE)
                    continue
                if step is Step.DISPATCH_ALL:
                    self._dispatch_all(self._book.dispatch_for(admission))
                    return self._step
                if not skip_refused:
                    break
            self._expire()
            self._to_prefill()
            return self._step

    async def tick(self) -> list[Outcome]:
        """Fire due hold deadlines and re-ask ``prefill_room``, at the clock's current time.
        Returns the outcomes decided here."""
        async with self._lock:
            self._step = []
            self._expire()
            self._to_prefill()
            return self._step

    async def withdraw(self, ticket: Ticket) -> Outcome | None:
        """Stop holding ``ticket``'s prompt: it is dispatched NORMAL (WITHDRAWN). Returns its
        outcome, or None when it was not held (it already has its outcome)."""
        async with self._lock:
            self._step = []
            held = self._book.take(ticket)
            if held is None:
                return None
            self._finish(held, held.last, Dispatch.WITHDRAWN)
            return ticket.outcome

    async def close(self) -> list[Outcome]:
        """Dispatch everything held to prefill (CLOSED); later prompts are never held.
        Returns the outcomes decided here."""
        async with self._lock:
            self._step = []
            self._closed = True
            self._dispatch_all(Dispatch.CLOSED)
            step = self._step
        self._wake.set()
        return step

    # -- live driver ----------------------------------------------------------------------------
    async def run(self, updates: AsyncIterable[RoomUpdate]) -> None:
        """Feed ``updates`` to :meth:`on_room` and fire deadlines on the clock until the stream
        ends or this task is cancelled; then :meth:`close` (nothing stays held)."""
        timer = asyncio.create_task(self._timer(), name="admission-queue-timer")
        try:
            async for update in updates:
                await self.on_room(update)
        finally:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
            await asyncio.shield(self.close())
            aclose = getattr(updates, "aclose", None)
            if aclose is not None:  # end the stream now (a gRPC watch), not at GC
                with contextlib.suppress(Exception):
                    await aclose()

    async def _timer(self) -> None:
        while not self._closed:
            self._wake.clear()
            timeout_s: float | None = None
            deadline = self._book.next_deadline_ms()
            if deadline is not None:
                until_ms = max(0, deadline - self.clock.now_ms())
                if self.prefill_room is not None:
                    until_ms = min(until_ms, self.config.recheck_ms)
                timeout_s = until_ms / 1000.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._wake.wait()
            await self.tick()

    # -- the first offer ------------------------------------------------------------------------
    def _with_ahead(self, request: AdmissionRequest) -> AdmissionRequest:
        """``request`` as first offered: with the tokens it would be held behind, so the
        broker weighs borrowing against waiting for them (none when it would not be held).
        Reads the book without the lock: nothing between here and the admit awaits."""
        ahead = 0 if self._closed else self._book.ahead_of_new(request)
        if ahead == request.held_ahead_tokens:
            return request
        return request.model_copy(update={"held_ahead_tokens": ahead})

    # -- helpers (called with the lock held) ----------------------------------------------------
    async def _reoffer(self, request: AdmissionRequest) -> Admission:
        """A re-offer never raises: an admitter error reads as a broker out of reach."""
        try:
            return await self.admitter.admit(request)
        except Exception as exc:
            log.warning("admission_queue.reoffer_failed", error=repr(exc))
            return Admission.normal(Reason.BROKER_UNAVAILABLE, f"re-offer failed: {exc}")

    def _prefill_target_of(self, request: AdmissionRequest) -> str | None:
        # a failing pick names no server (the broker reads the least-loaded one)
        return _router_hook(self.prefill_target, request, None, "prefill_target")

    def _prefill_has_room(self, request: AdmissionRequest) -> bool:
        # a failing check counts as room: held prompts must not be stranded
        return bool(_router_hook(self.prefill_room, request, False, "prefill_room", True))

    def _expire(self) -> None:
        for held in self._book.due(self.clock.now_ms()):
            self._finish(held, held.last, Dispatch.DEADLINE)

    def _to_prefill(self) -> None:
        for held in self._book.heads():
            if not self._prefill_has_room(held.request):
                break
            self._book.take(held.key)
            self._finish(held, held.last, Dispatch.PREFILL_ROOM)

    def _dispatch_all(self, cause: Dispatch) -> None:
        for held in self._book.drain():
            self._finish(held, held.last, cause)

    def _finish(self, held: Held[Ticket], admission: Admission, cause: Dispatch) -> None:
        self._decide(held.key, admission, cause, held.since_ms, held.offers, held=True)

    @staticmethod
    def _closed_cause(worth_holding: bool) -> Dispatch:
        return Dispatch.CLOSED if worth_holding else Dispatch.NOT_HELD

    def _held_changed(self) -> None:
        for observer in self._observers:
            observer.held_changed(len(self._book))

    def _decide(
        self,
        ticket: Ticket,
        admission: Admission,
        cause: Dispatch,
        since_ms: int,
        offers: int,
        *,
        held: bool = False,
    ) -> None:
        # Every field, in order, of its type (the submitted request, its answer, the queue's
        # own counts): built without validation, once per prompt.
        outcome = Outcome.trusted(
            request=ticket.request,
            admission=admission,
            dispatch=cause,
            held_ms=max(0, self.clock.now_ms() - since_ms),
            offers=offers,
            held=held,
        )
        ticket._resolve(outcome)
        self._step.append(outcome)
        self._held_changed()
        for observer in self._observers:
            observer.decided(outcome)
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome)
            except Exception:
                log.exception("admission_queue.on_outcome_failed")


def _router_hook(
    hook: Callable[[AdmissionRequest], R] | None,
    request: AdmissionRequest,
    absent: R,
    name: str,
    failed: R | None = None,
) -> R | None:
    """A router callback's answer: ``absent`` without one, ``failed`` (logged) when it raises. A
    router callback must never end the queue (``run`` would close it, dispatching every held
    prompt and holding none again)."""
    if hook is None:
        return absent
    try:
        return hook(request)
    except Exception:
        log.exception(f"admission_queue.{name}_failed")
        return failed
