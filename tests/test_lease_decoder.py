"""The lease stream's LeaseDecoder: a lease repeating the last one's credits reuses their
validated Credits, and every lease decodes (or is refused) exactly as lease_from_proto does."""

from __future__ import annotations

import pytest

from crossflow_ctl.api.v1 import common_pb2
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.wire import convert as c


def _msg(version: int, compute: int = 1000, **fields: object) -> common_pb2.Lease:
    return common_pb2.Lease(
        node_id=str(fields.pop("node_id", "n1")),
        epoch=1,
        version=version,
        ttl_ms=1000,
        credits=common_pb2.Credits(compute_tokens=compute, kv_tokens=2000, slots=4),
        queue_wait_ms=float(fields.pop("queue_wait_ms", 1.5)),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )


def test_repeated_credits_reuse_the_validated_instance_and_decode_as_before() -> None:
    decode = c.LeaseDecoder()
    first, second = decode(_msg(1)), decode(_msg(2))
    assert second.credits is first.credits  # not validated again
    assert second == c.lease_from_proto(_msg(2))
    moved = decode(_msg(3, compute=999))
    assert moved.credits is not first.credits
    assert moved == c.lease_from_proto(_msg(3, compute=999))
    assert decode(_msg(4, compute=999)).credits is moved.credits


def test_a_bad_lease_after_a_good_one_is_refused_naming_the_same_field() -> None:
    decode = c.LeaseDecoder()
    decode(_msg(1))
    for bad, field in (
        (_msg(2, node_id="bad id!"), "lease.node_id"),
        (_msg(2, queue_wait_ms=float("nan")), "lease.queue_wait_ms"),
        (_msg(0), "lease.version"),
        (_msg(2, zero_reason=common_pb2.ZERO_REASON_STARTING), "lease"),
    ):
        with pytest.raises(InvalidArgument) as got:
            decode(bad)
        with pytest.raises(InvalidArgument) as plain:
            c.lease_from_proto(bad)
        assert got.value.field == plain.value.field
        assert (got.value.field or "").startswith(field)
    too_big = _msg(3)
    too_big.credits.slots = 10**9
    with pytest.raises(InvalidArgument) as got:
        decode(too_big)
    assert got.value.field == "lease.credits.slots"
    assert decode(_msg(4)).version == 4  # the refused credits were not remembered
