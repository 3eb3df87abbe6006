"""Exact outcomes for retried Admit, Commit and Release: request records keyed by request_id.

For router authors (also in README.md):

* Send a ``request_id`` (unique per request) with Admit, ``attempt`` 0 on the first call and
  n on the n-th retry. A BORROW is recorded under the id (one ``SET NX`` round trip); a retry
  first looks for the record and gets the recorded reservation back with ``replayed`` set,
  never a second debit. First calls that answer NORMAL record nothing (no cost on that path);
  a retry records whatever it answers, so a first call still in flight that borrows later finds
  the retry's answer recorded, answers that, and releases its own debit. Of any calls with one
  id, exactly one outcome wins, and no debit is left that no router knows of.
* An Admit the broker answers NORMAL because the store was slow may still see its debit land
  later: the broker waits for that debit in the background and releases it.
* Commit and Release are idempotent per reservation; with a ``request_id`` their success is
  recorded, and a retry (``attempt`` > 0) gets the recorded outcome back. After UNAVAILABLE,
  retry with the same id: the call may have run, and the answer tells how it ended. Refusals
  record nothing (no refusal changes the store); a retry is refused the same way. A router that
  gives up on a reservation must Release it (Release is valid from HELD and COMMITTED).
* Records live for the commit TTL plus the hold TTL. Calls without a ``request_id`` keep the
  old at-most-once-per-call behaviour.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import CrossflowError, StoreUnavailable
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.store.base import DebitOutcome, Store

T = TypeVar("T")
log = structlog.get_logger()


async def run_once(
    store: Store,
    key: str,
    attempt: int,
    ttl_ms: int,
    call: Callable[[], Awaitable[T]],
    encode: Callable[[T], str],
    decode_payload: Callable[[str], T],
) -> T:
    """Commit/Release with a request record: a retry replays a recorded success; otherwise
    ``call`` runs (idempotent per reservation) and its success is recorded."""
    if attempt > 0 and (stored := await store.read_request(key)) is not None:
        return decode_payload(stored)
    result = await call()  # a refusal or a store error records nothing
    await store.record_request(key, encode(result), ttl_ms)
    return result


def encode_admission(answer: Admission) -> str:
    """An answer as its request record (without the explanation, which is not replayed)."""
    return answer.model_copy(update={"plan": None}).model_dump_json()


def replay_admission(record: str) -> Admission:
    return Admission.model_validate_json(record).model_copy(update={"replayed": True})


async def admit_once(
    store: Store,
    request: AdmissionRequest,
    policy: PolicySettings,
    decide: Callable[[AdmissionRequest], Awaitable[Admission]],
    release_late: Callable[[str, str], None],
) -> Admission:
    """Admit under a request record (module docstring). Fails closed (NORMAL) when a retry
    cannot read the record; a debit whose answer lost the race to record is released."""
    key, ttl = f"admit:{request.request_id}", policy.commit_ttl_ms + policy.hold_ttl_ms
    limit_s = policy.admit_timeout_ms / 1000.0
    if request.attempt > 0:
        try:
            async with asyncio.timeout(limit_s):
                stored = await store.read_request(key)
        except TimeoutError:
            log.warning("admit.timeout", timeout_ms=policy.admit_timeout_ms, step="record")
            return Admission.normal(
                Reason.TIMEOUT, f"store slower than {policy.admit_timeout_ms} ms (request record)"
            )
        except StoreUnavailable as exc:
            log.warning("admit.store_unavailable", error=str(exc), step="record")
            return Admission.normal(Reason.STORE_UNAVAILABLE, f"store unavailable: {exc}")
        if stored is not None:
            return replay_admission(stored)
    answer = await decide(request)
    if answer.decision is not Decision.BORROW and request.attempt == 0:
        return answer
    try:
        async with asyncio.timeout(limit_s):
            stored = await store.record_request(key, encode_admission(answer), ttl)
    except (TimeoutError, StoreUnavailable) as exc:  # unrecorded: the answer still stands
        log.warning("admit.record_failed", error=repr(exc))
        return answer
    if stored is None:
        return answer
    if answer.reservation_id:
        release_late(answer.reservation_id, "another call with this request_id answered first")
    return replay_admission(stored)


class OrphanDebits:
    """Debits no router was told of (the Admit answered NORMAL before the debit landed, or its
    answer lost the race to settle the request record), released in the background."""

    def __init__(self, release: Callable[[str], Awaitable[object]]) -> None:
        self._release = release
        self._tasks: set[asyncio.Task[None]] = set()

    def watch(self, debits: asyncio.Future[list[DebitOutcome]]) -> None:
        """Done-callback of debits their Admit stopped waiting for: release those granted."""
        if debits.cancelled() or debits.exception() is not None:
            return  # nothing landed, or the store failed: a HELD debit expires by itself
        for outcome in debits.result():
            if outcome.granted and outcome.reservation is not None:
                self.release(outcome.reservation.reservation_id, "admission timed out")

    def release(self, reservation_id: str, why: str) -> None:
        async def run() -> None:
            try:
                await self._release(reservation_id)
                log.warning("admit.orphan_released", reservation_id=reservation_id, why=why)
            except CrossflowError as exc:  # expired meanwhile, or the store is down: it expires
                log.warning(
                    "admit.orphan_release_failed", reservation_id=reservation_id, error=str(exc)
                )

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
