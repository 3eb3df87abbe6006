"""Exact outcomes for retried Admit, Commit and Release: request records keyed by request_id.

For router authors (also in README.md):

* Send a ``request_id`` (unique per request) with Admit, and the same id with a retry. The first
  call claims a record; its outcome (BORROW with its reservation, or NORMAL with its reason) is
  stored, and every retry within the record's TTL (commit TTL + hold TTL) gets that same outcome
  back with ``replayed`` set, never a second debit.
* A retry that finds the first call still unresolved settles the record itself as NORMAL
  (TIMEOUT); the first call, when it finishes, finds the record settled and releases any debit
  it made. Of the two, exactly one outcome wins, and no debit is left that no router knows of.
* An Admit the broker answers NORMAL because the store was slow may still see its debit land
  later: the broker waits for that debit in the background and releases it.
* Commit and Release are idempotent per reservation; with a ``request_id`` a retry gets the
  first call's recorded success. After UNAVAILABLE, retry with the same id: the call may have
  run, and the retry tells how it ended. A refusal (NotFound, FailedPrecondition) records
  nothing, as no refusal changes the store; a retry is refused the same way. A router that
  gives up on a reservation must Release it (Release is valid from HELD and COMMITTED).
* Calls without a ``request_id`` keep their old, at-most-once-per-call behaviour.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Reason
from crossflow_ctl.domain.errors import CrossflowError, StoreUnavailable
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.store.base import PENDING, DebitOutcome, Store

T = TypeVar("T")
log = structlog.get_logger()


async def run_once(
    store: Store,
    key: str,
    ttl_ms: int,
    call: Callable[[], Awaitable[T]],
    encode: Callable[[T], str],
    decode_payload: Callable[[str], T],
) -> T:
    """Commit/Release with a request record: replay a settled outcome; otherwise (first call,
    or an earlier one that never settled) run ``call`` (idempotent per reservation) and settle."""
    stored = await store.claim_request(key, ttl_ms)
    if stored is not None and stored != PENDING:
        return decode_payload(stored)
    try:
        result = await call()
    except StoreUnavailable:
        raise  # left PENDING: a retry runs the call again
    except CrossflowError:
        await store.forget_request(key)  # a refusal leaves nothing behind
        raise
    await store.settle_request(key, encode(result), ttl_ms)
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
    """Admit under a request record: replay a settled outcome, settle an unresolved earlier
    call as NORMAL, or decide and settle. Fails closed (NORMAL) when the record is out of
    reach; a debit whose answer lost the race to settle is released (``release_late``)."""
    key, ttl = f"admit:{request.request_id}", policy.commit_ttl_ms + policy.hold_ttl_ms
    limit_s = policy.admit_timeout_ms / 1000.0
    try:
        async with asyncio.timeout(limit_s):
            stored = await store.claim_request(key, ttl)
    except TimeoutError:
        log.warning("admit.timeout", timeout_ms=policy.admit_timeout_ms, step="claim")
        return Admission.normal(
            Reason.TIMEOUT, f"store slower than {policy.admit_timeout_ms} ms (request record)"
        )
    except StoreUnavailable as exc:
        log.warning("admit.store_unavailable", error=str(exc), step="claim")
        return Admission.normal(Reason.STORE_UNAVAILABLE, f"store unavailable: {exc}")
    if stored is None:
        answer = await decide(request)
    elif stored == PENDING:
        answer = Admission.normal(
            Reason.TIMEOUT, "an earlier call with this request_id did not finish"
        )
    else:
        return replay_admission(stored)
    try:
        async with asyncio.timeout(limit_s):
            stored = await store.settle_request(key, encode_admission(answer), ttl)
    except (TimeoutError, StoreUnavailable) as exc:
        log.warning("admit.record_unavailable", error=repr(exc))
        stored = ""
    if stored is None:
        return answer
    if answer.reservation_id:
        release_late(answer.reservation_id, "request record settled by another call")
    if stored:
        return replay_admission(stored)
    return Admission.normal(Reason.STORE_UNAVAILABLE, "request record unavailable")


class OrphanDebits:
    """Debits no router was told of (the Admit answered NORMAL before the debit landed, or its
    answer lost the race to settle the request record), released in the background."""

    def __init__(self, release: Callable[[str], Awaitable[object]]) -> None:
        self._release = release
        self._tasks: set[asyncio.Task[None]] = set()

    def watch(self, debit: asyncio.Future[DebitOutcome]) -> None:
        """Done-callback of a debit its Admit stopped waiting for: release it if granted."""
        if debit.cancelled() or debit.exception() is not None:
            return  # nothing landed, or the store failed: a HELD debit expires by itself
        outcome = debit.result()
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
