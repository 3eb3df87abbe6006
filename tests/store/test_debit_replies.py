"""The debit script's replies read as outcomes (``redis_debit.DebitCall.outcome``): a grant's
reply read as it comes (bytes, str or integers) gives the outcome the decoded reading gave, and
every other status is read as before."""

from __future__ import annotations

from typing import Any

import pytest

from crossflow_ctl.domain.models import Credits, Reservation, ReservationState
from crossflow_ctl.store.base import DebitOutcome, DebitRequest, RequestRecord
from crossflow_ctl.store.redis_debit import DebitCall

DEBIT = Credits(compute_tokens=512, kv_tokens=576, output_tokens=64, slots=1)


def call(record: RequestRecord | None = None) -> DebitCall:
    request = DebitRequest("d1", DEBIT, "r1", "router/a", record, 250, 0)
    return DebitCall.build(request, 1_000, 100, 0xABC)


def forms(*reply: Any) -> list[list[Any]]:
    """The reply as redis-py hands it over: bytes, or decoded to str; numbers as integers or
    as their text."""
    as_bytes = [v.encode() if isinstance(v, str) else v for v in reply]
    as_text = [str(v) if isinstance(v, int) else v for v in reply]
    return [list(reply), as_bytes, as_text, [str(v).encode() for v in reply]]


@pytest.mark.parametrize("record", [None, RequestRecord("admit:r1", 5_000, "{}")])
def test_a_grant_reads_the_same_in_every_form(record: RequestRecord | None) -> None:
    debit = call(record)
    expected = DebitOutcome(
        granted=True,
        reservation=Reservation(
            reservation_id=debit.reservation_id,
            node_id="d1",
            state=ReservationState.HELD,
            debit=DEBIT,
            compute_us=250,
            lease_epoch=3,
            lease_version=9,
            created_at_ms=1_000,
            expires_at_ms=1_100,
            grant_seq=42,
            request_id="r1",
            owner="router/a",
        ),
        lease_epoch=3,
        lease_version=9,
        record_key="" if record is None else "admit:r1",
    )
    for reply in forms("granted", 3, 9, 42, "1,2,3,4,5"):
        assert debit.outcome(reply) == expected, reply


def test_the_other_statuses_read_as_before() -> None:
    debit = call()
    for reply in forms("short", 3, 9, "1,5", "1,2,3,4,5"):
        out = debit.outcome(reply)
        assert (out.granted, out.refusal, out.short_credits) == (
            False,
            "short",
            ("compute_tokens", "slots"),
        )
        assert (out.lease_epoch, out.lease_version) == (3, 9)
    for reply in forms("recorded", 3, 9, '{"decision":"borrow"}'):
        out = debit.outcome(reply)
        assert (out.refusal, out.recorded) == ("recorded", '{"decision":"borrow"}')
    for reply in forms("expired", 3, 9):
        out = debit.outcome(reply)
        assert (out.granted, out.refusal, out.lease_epoch) == (False, "expired", 3)
    for reply in forms("unknown_node"):
        assert debit.outcome(reply) == DebitOutcome(granted=False, refusal="unknown_node")
