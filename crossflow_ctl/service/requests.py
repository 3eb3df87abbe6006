"""Exact outcomes for retried Admit, Commit and Release: request records keyed by request_id.

For router authors (also in docs/late-binding.md):

* Send a ``request_id`` (unique per request) with Admit, ``attempt`` 0 on the first call and
  n on the n-th retry. A BORROW is recorded under the id; a retry first looks for the record
  and gets the recorded reservation back with ``replayed`` set, never a second debit. First
  calls that answer NORMAL record nothing (no cost on that path); a retry records whatever it
  answers, so a first call still in flight that borrows later finds the retry's answer
  recorded, answers that, and debits nothing (or releases its own debit). Of any calls with
  one id, exactly one outcome wins, and no debit is left that no router knows of.
* Cost: on a store that ``folds_request_records`` (standalone Redis) the record rides in the
  debit's atomic script, for first calls and retries alike: a BORROW with a request id is ONE
  round trip, and a record already there is answered without debiting. A retry that answers
  NORMAL by policy records its answer with ``SET NX GET`` (one round trip, which hands back an
  earlier record instead); one that answers NORMAL because the store failed or was slow
  records nothing (its debit, should it land, is released and its record deleted, as a first
  call's). Elsewhere (Redis Cluster: the record and the node lie in different slots) a retry
  first reads the record, and the BORROW is recorded after its debit (``SET NX``, one more
  round trip); a debit that lost the race is released.
* An Admit the broker answers NORMAL because the store was slow may still see its debit land
  later: the broker waits for that debit in the background and releases it (deleting its
  record first, when it was recorded with the debit, so a retry decides afresh).
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
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import structlog

from crossflow_ctl.aio import wait_settled, within
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import CrossflowError, StoreUnavailable
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.store.base import DebitOutcome, RequestRecord, Store

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


FAILED = frozenset((Reason.TIMEOUT, Reason.STORE_UNAVAILABLE))
"""NORMAL answers given for want of the store, not by policy: a debit may still land (and be
released), so a retry answering one records nothing (nor replays a record that debit wrote)."""

GRANT_FACTS = frozenset({"reservation_id", "expires_at_ms", "lease_epoch", "lease_version"})
"""An answer's fields a store adds to a record it writes with the debit (``RequestRecord``)."""


def encode_admission(answer: Admission) -> str:
    """An answer as its request record (without the explanation, which is not replayed)."""
    return answer.model_dump_json(exclude={"plan"})


def admit_record_key(request: AdmissionRequest, policy: PolicySettings) -> tuple[str, int]:
    """The key and TTL of an Admit's request record."""
    return f"admit:{request.request_id}", record_ttl_ms(policy)


def record_ttl_ms(policy: PolicySettings) -> int:
    """How long a request record outlives its call: a retry may come until the reservation it
    names could have been held and committed."""
    return policy.commit_ttl_ms + policy.hold_ttl_ms


def recorded_apart(store: Store, request: AdmissionRequest, policy: PolicySettings) -> bool:
    """Whether ``request``'s answer needs :func:`admit_once` (a record read or written apart
    from its debit): a retry (its NORMAL answer is recorded too), or a first call whose record
    its debit cannot write; not a call without a request id, nor a dry run."""
    if not request.request_id or request.dry_run:
        return False
    return request.attempt > 0 or admit_record(store, request, policy) is None


def admit_record(
    store: Store, request: AdmissionRequest, policy: PolicySettings
) -> tuple[str, int] | None:
    """The key and TTL of the record a debit writes itself (a store that
    ``folds_request_records``); None when the record, if any, is written after the debit."""
    if not (store.folds_request_records and request.request_id) or request.dry_run:
        return None
    return admit_record_key(request, policy)


def borrow_record(key: str, ttl_ms: int, answer: Admission) -> RequestRecord:
    """The record a debit writes with its grant: ``answer`` (a BORROW whose grant facts the
    store fills in) as :func:`encode_admission` would write it."""
    return RequestRecord(key, ttl_ms, answer.model_dump_json(exclude={"plan", *GRANT_FACTS}))


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
    key, ttl = admit_record_key(request, policy)
    folded = admit_record(store, request, policy) is not None
    limit_s = policy.admit_timeout_ms / 1000.0
    if request.attempt > 0 and not folded:  # folded: the debit's script, or SET NX GET, tells
        try:
            stored = await within(store.read_request(key), limit_s)
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
    if answer.replayed or (folded and answer.decision is Decision.BORROW):
        return answer  # recorded with its debit, or an earlier call's record
    if answer.decision is not Decision.BORROW and (
        request.attempt == 0 or (folded and answer.reason in FAILED)
    ):
        return answer  # NORMAL on a first call, or (folded) for want of the store: unrecorded
    try:
        stored = await within(store.record_request(key, encode_admission(answer), ttl), limit_s)
    except (TimeoutError, StoreUnavailable) as exc:  # unrecorded: the answer still stands
        log.warning("admit.record_failed", error=repr(exc))
        return answer
    if stored is None:
        return answer
    if answer.reservation_id:
        release_late(answer.reservation_id, "another call with this request_id answered first")
    return replay_admission(stored)


ORPHAN_RELEASES_AT_ONCE = 8
"""Orphan releases in flight to the store at once; the rest wait their turn."""


class OrphanDebits:
    """Debits no router was told of (the Admit answered NORMAL before the debit landed, its
    caller stopped waiting, or its answer lost the race to settle the request record),
    released in the background; a record written with such a debit is deleted first, so a
    retry decides afresh rather than replaying a released reservation.

    At most ``ORPHAN_RELEASES_AT_ONCE`` releases talk to the store at once. Orphans come in
    bursts exactly when the store is slow (a round of debits whose Admits all timed out: up to
    a whole AdmitStream batch each), and one connection per release could take the Redis pool
    from the Admits that followed, which then timed out too and left more orphans."""

    def __init__(
        self, release: Callable[[str], Awaitable[object]], store: Store | None = None
    ) -> None:
        self._release = release
        self._store = store
        self._tasks: set[asyncio.Task[None]] = set()
        self._turns = asyncio.Semaphore(ORPHAN_RELEASES_AT_ONCE)

    def watch(self, outcomes: Sequence[DebitOutcome], why: str) -> None:
        """The outcomes of debits no caller hears of, once they landed (``why``: their Admit
        timed out, its caller left, or its batch failed): release those granted (debits that
        failed never come here: a HELD debit expires by itself)."""
        for outcome in outcomes:
            if outcome.granted and outcome.reservation is not None:
                rid = outcome.reservation.reservation_id
                self.release(rid, why, outcome.record_key)

    def release(self, reservation_id: str, why: str, record_key: str = "") -> None:
        """Release ``reservation_id`` in the background, after deleting the request record
        under ``record_key`` (when given) if it names that reservation."""

        async def run() -> None:
            try:
                async with self._turns:
                    if record_key and self._store is not None:
                        await self._store.forget_request(record_key, reservation_id)
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
        """Wait up to ``timeout_s`` for the releases running, and any they start meanwhile
        (a late hand-over landing during the wait)."""
        await wait_settled(lambda: self._tasks, timeout_s)
