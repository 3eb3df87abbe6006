"""A node's view is rebuilt only from what changed: admission's background renewal re-reads its
working set every half cache age, and an unchanged lender must cost a comparison, not a parse,
while a changed one is seen at once (the reply is compared whole, never trusted by age)."""

from __future__ import annotations

from typing import Any

from crossflow_ctl.domain.models import ComputeTime, Credits, Lease
from crossflow_ctl.store import redis_codec as codec
from tests.store.helpers import NOW


def lease_fields(version: int, compute: int = 1_000) -> list[bytes]:
    lease = Lease(
        node_id="d1",
        epoch=1,
        version=version,
        ttl_ms=5_000,
        credits=Credits(compute_tokens=compute, slots=4),
    )
    values = codec.lease_hash_values(lease, NOW, NOW + 5_000)
    return [
        b
        for name, value in zip(codec.LEASE_FIELDS, values, strict=True)
        for b in (name.encode(), value.encode())
    ]


def reply(
    version: int = 1, seq: int = 0, debits: int = 0, cordoned: bool = False, us: int = 0
) -> list[Any]:
    """A ``node_view.lua`` reply as hiredis gives it (fresh objects each call, like a read)."""
    info = [
        b"decode",
        b"default",
        b'{"zone": "a"}',
        b"1" if cordoned else b"0",
        b"",
        b"1700000000000",
        str(seq).encode(),
    ]
    totals = [
        str(debits).encode(),
        b"0",
        b"0",
        b"0",
        b"1" if debits else b"0",
        b"1" if debits else b"0",
        str(us).encode(),
        str(debits if us else 0).encode(),
    ]
    return [info, lease_fields(version), *totals]


def test_an_unchanged_reply_returns_the_state_built_before() -> None:
    views = codec.NodeViews()
    first = views.state("d1", reply())
    assert first is not None
    assert views.state("d1", reply()) is first
    assert first.lease is not None and first.lease.lease.version == 1
    assert first.info.labels == {"zone": "a"}


def test_changed_totals_are_rebuilt_and_the_rest_reused() -> None:
    views = codec.NodeViews()
    first = views.state("d1", reply())
    second = views.state("d1", reply(debits=300))
    assert first is not None and second is not None and second is not first
    assert second.open_debits == Credits(compute_tokens=300, slots=1)
    assert second.open_reservations == 1
    assert second.open_compute == ComputeTime()
    assert second.lease is first.lease and second.info is first.info
    timed = views.state("d1", reply(debits=300, us=60_000))
    assert timed is not None and timed.open_debits == second.open_debits
    assert timed.open_compute == ComputeTime(us=60_000, tokens=300)


def test_a_new_lease_or_notice_is_seen_at_once() -> None:
    views = codec.NodeViews()
    first = views.state("d1", reply())
    leased = views.state("d1", reply(version=2))
    noticed = views.state("d1", reply(version=2, seq=7))
    assert first is not None and leased is not None and noticed is not None
    assert leased.lease is not None and leased.lease.lease.version == 2
    assert leased.info is first.info
    assert noticed.info.notice_seq == 7 and noticed.lease is leased.lease
    assert noticed.info.model_copy(update={"notice_seq": 0}) == first.info


def test_changed_info_is_parsed_again() -> None:
    views = codec.NodeViews()
    first = views.state("d1", reply())
    cordoned = views.state("d1", reply(cordoned=True))
    assert first is not None and cordoned is not None
    assert not first.info.cordoned and cordoned.info.cordoned


def test_an_unknown_node_is_forgotten_and_the_map_stays_bounded() -> None:
    views = codec.NodeViews(capacity=2)
    first = views.state("d1", reply())
    assert views.state("d1", []) is None
    again = views.state("d1", reply())
    assert again is not None and again is not first and again == first
    views.state("d2", reply())
    views.state("d3", reply())  # over capacity: the map starts over, answers stay exact
    rebuilt = views.state("d1", reply())
    assert rebuilt is not again and rebuilt == again
