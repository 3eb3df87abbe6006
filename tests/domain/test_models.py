"""Domain models refuse bad input with the field named, and credit arithmetic is exact."""

from __future__ import annotations

import copy
import math
from functools import cached_property
from typing import Any

import pytest
from pydantic import ValidationError

from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.models import (
    _FIELDS,
    MAX_BYTES,
    MAX_SLOTS,
    MAX_TOKENS,
    Credits,
    Frozen,
    Lease,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    ReservationState,
    StoredLease,
    ZeroReason,
    validated,
)
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.store.base import DebitOutcome


def lease(**overrides: object) -> Lease:
    fields: dict[str, object] = {"node_id": "d0", "epoch": 1, "version": 1, "ttl_ms": 1000}
    fields.update(overrides)
    return validated(Lease, **fields)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"credits": {"compute_tokens": -1}}, "credits.compute_tokens"),
        ({"credits": {"kv_tokens": MAX_TOKENS + 1}}, "credits.kv_tokens"),
        ({"credits": {"slots": 10**9}}, "credits.slots"),
        ({"queue_wait_ms": math.nan}, "queue_wait_ms"),
        ({"borrowed_prefill_rate_tps": math.inf}, "borrowed_prefill_rate_tps"),
        ({"node_id": ""}, "node_id"),
        ({"node_id": "x" * 129}, "node_id"),
        ({"node_id": "bad id/with slash"}, "node_id"),
        ({"epoch": 0}, "epoch"),
        ({"version": -3}, "version"),
        ({"ttl_ms": 0}, "ttl_ms"),
    ],
)
def test_bad_lease_fields_are_named(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        lease(**overrides)
    assert info.value.field == field


def test_zero_lease_must_carry_zero_credit() -> None:
    with pytest.raises(InvalidArgument, match="zero lease"):
        lease(zero_reason=ZeroReason.ITL_OVER_SLO, credits={"compute_tokens": 5})
    assert lease(zero_reason=ZeroReason.ITL_OVER_SLO).is_zero


def test_lease_ordering_is_epoch_then_version() -> None:
    newer = lease(epoch=2, version=1)
    assert newer.is_newer_than(1, 99)
    assert not newer.is_newer_than(2, 1)
    assert lease(epoch=2, version=2).is_newer_than(2, 1)


def test_expired_or_zero_stored_lease_counts_as_zero() -> None:
    live = lease(credits={"compute_tokens": 100, "slots": 2})
    stored = StoredLease(lease=live, received_at_ms=1000, expires_at_ms=2000)
    assert stored.effective_credits(1999).compute_tokens == 100
    assert stored.effective_credits(2000).is_zero()
    zero = StoredLease(
        lease=lease(zero_reason=ZeroReason.CORDONED), received_at_ms=0, expires_at_ms=10**9
    )
    assert zero.effective_credits(5).is_zero()


def test_pool_wait_is_outstanding_over_rate() -> None:
    reports = (
        PoolLoad(
            node_id="p0", outstanding_uncached_tokens=30_000, processing_rate_tps=10_000, ttl_ms=1
        ),
        PoolLoad(
            node_id="p1", outstanding_uncached_tokens=10_000, processing_rate_tps=10_000, ttl_ms=1
        ),
    )
    assert PoolSnapshot(pool="default", reports=reports).estimated_wait_ms() == pytest.approx(
        2000.0
    )
    assert PoolSnapshot(pool="default").estimated_wait_ms() is None


def test_policy_updates_are_validated_and_named() -> None:
    policy = PolicySettings()
    assert policy.updated({"demand_threshold_ms": "50"}).demand_threshold_ms == 50.0
    with pytest.raises(InvalidArgument) as info:
        policy.updated({"borrow_share": "1.5"})
    assert info.value.field == "borrow_share"
    with pytest.raises(InvalidArgument) as info:
        policy.updated({"no_such_knob": "1"})
    assert info.value.field == "no_such_knob"
    with pytest.raises(InvalidArgument, match="commit_ttl_ms"):
        policy.updated({"commit_ttl_ms": 100, "borrow_horizon_ms": 5000})


def test_default_horizons_agree_and_the_commit_ttl_outlasts_them_with_margin() -> None:
    """The agent's local horizon stands until a broker's Welcome sends its own, so the two
    defaults must agree; a committed reservation must outlast the longest borrowed prefill the
    horizon allows (DESIGN.md §4), with room for queueing behind it on the node."""
    policy = PolicySettings()
    assert LeaseSettings().horizon_ms == policy.borrow_horizon_ms
    assert policy.commit_ttl_ms >= 2 * policy.borrow_horizon_ms


def test_trusted_builds_what_model_construct_builds() -> None:
    full = {
        "compute_tokens": 5,
        "kv_tokens": 4,
        "kv_transfer_bytes": 3,
        "output_tokens": 2,
        "slots": 1,
    }
    fast = Credits.trusted(**full)
    assert fast == Credits.model_construct(**full) == Credits(**full)
    assert fast.model_fields_set == set(full)
    assert Credits.trusted(**full).model_fields_set is not fast.model_fields_set  # its own
    assert fast.model_dump_json() == Credits(**full).model_dump_json()
    # a partial or reordered set takes pydantic's path: defaults filled, fields in order
    partial = Credits.trusted(slots=2, kv_tokens=7)
    assert partial == Credits(kv_tokens=7, slots=2)
    assert list(partial.model_dump()) == list(full)


def test_replaced_is_model_copy_with_the_update_and_leaves_the_original() -> None:
    base = Credits(compute_tokens=5, kv_tokens=4, kv_transfer_bytes=3, output_tokens=2, slots=1)
    copy = base.replaced(kv_tokens=9, slots=0)
    assert copy == base.model_copy(update={"kv_tokens": 9, "slots": 0})
    assert list(copy.model_dump()) == list(base.model_dump())  # fields in order
    assert base.kv_tokens == 4 and copy.__dict__ is not base.__dict__


def _every_frozen_model() -> list[type[Frozen]]:
    found: list[type[Frozen]] = []
    todo: list[type[Frozen]] = [Frozen]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_each_model_has_its_own_trusted_over_its_own_fields() -> None:
    """Each model class's generated ``trusted`` builds from that class's fields (not an
    ancestor's), and classes whose ``model_construct`` does more than set fields take it."""
    models = [m for m in _every_frozen_model() if m.__module__.startswith("crossflow_")]
    assert len(models) >= 20
    for model in models:
        order, names = _FIELDS[model]
        if model.__pydantic_post_init__:
            assert order == ()
        else:
            assert order == tuple(model.model_fields) and names == set(order), model
            assert "trusted" in vars(model) and model.trusted._generated, model


def test_a_models_own_trusted_stands_and_its_subclasses_inherit_it() -> None:
    class Own(Frozen):
        a: int = 0

        @classmethod
        def trusted(cls, **values: object) -> Own:  # type: ignore[override]
            return cls(a=41 + len(values))

    class Sub(Own):
        b: int = 0

    assert Own.trusted(a=5).a == 42
    assert Sub.trusted(a=5, b=6).a == 43  # inherited, as any classmethod is
    assert Own(a=1).replaced(a=2).a == 42 and Sub(a=1).replaced(b=2).a == 43  # through it


def test_a_subclass_of_a_model_gets_a_trusted_of_its_own_fields() -> None:
    class Base(Frozen):
        a: int = 0

    class Sub(Base):
        b: int = 0

    assert Base.trusted(a=1).__dict__ == {"a": 1}
    assert Sub.trusted(b=2, a=1).__dict__ == {"a": 1, "b": 2}
    assert Sub.trusted(b=2, a=1).model_fields_set == {"a", "b"}


def test_trusted_with_every_field_in_any_order_is_model_construct() -> None:
    values = {
        "reservation_id": "r1",
        "node_id": "d1",
        "state": ReservationState.HELD,
        "debit": Credits(compute_tokens=5),
        "compute_us": 7,
        "lease_epoch": 2,
        "lease_version": 3,
        "created_at_ms": 10,
        "expires_at_ms": 20,
        "grant_seq": 4,
        "release_seq": 0,
        "request_id": "q",
        "owner": "",
    }
    assert list(values) == list(Reservation.model_fields)
    reference = Reservation.model_construct(**values)
    for given in (values, dict(reversed(values.items()))):
        fast = Reservation.trusted(**given)
        assert type(fast) is Reservation
        assert fast.__dict__ == reference.__dict__
        assert list(fast.__dict__) == list(Reservation.model_fields)  # fields in order
        assert fast.model_fields_set == reference.model_fields_set == set(values)
        assert fast.__pydantic_extra__ is None and fast.__pydantic_private__ is None
        assert fast == reference and hash(fast) == hash(reference)
        assert fast.model_dump() == reference.model_dump()
        assert fast.model_dump_json() == Reservation(**values).model_dump_json()
        assert fast.model_copy(update={"grant_seq": 9}) == reference.model_copy(
            update={"grant_seq": 9}
        )
        assert copy.copy(fast) == fast and copy.deepcopy(fast) == fast
    # each model owns its fields set: changing one's leaves the next one's alone
    one, two = Reservation.trusted(**values), Reservation.trusted(**values)
    assert one.model_fields_set is not two.model_fields_set


def test_trusted_with_a_field_left_out_or_an_unknown_name_is_model_construct() -> None:
    partial = DebitOutcome.trusted(granted=False, refusal="short", lease_epoch=3)
    reference = DebitOutcome.model_construct(granted=False, refusal="short", lease_epoch=3)
    assert partial.__dict__ == reference.__dict__  # defaults filled, in field order
    assert list(partial.__dict__) == list(DebitOutcome.model_fields)
    assert partial.model_fields_set == {"granted", "refusal", "lease_epoch"}
    full = {**DebitOutcome(granted=True).__dict__, "no_such_field": 1}
    unknown = DebitOutcome.trusted(**full)
    assert unknown.__dict__ == DebitOutcome.model_construct(**full).__dict__
    assert "no_such_field" not in unknown.__dict__


def test_replaced_with_an_unknown_name_is_what_model_construct_builds() -> None:
    base = Credits(compute_tokens=5, kv_tokens=4, kv_transfer_bytes=3, output_tokens=2, slots=1)
    odd = base.replaced(slots=3, no_such_field=1)
    assert odd.__dict__ == Credits.model_construct(**{**base.__dict__, "slots": 3}).__dict__
    assert odd.model_fields_set == set(Credits.model_fields)
    assert base.replaced().model_fields_set is not base.model_fields_set


def test_odd_models_keep_what_they_had_before_trusted_was_generated() -> None:
    """Review rB: a field named ``set``, a static ``trusted`` of a model's own, a field name no
    parameter can take, and ``replaced`` of a model whose dict holds other keys (a field left
    out, a cached value) each behave as before generated ``trusted`` functions."""

    class Named(Frozen):
        set: int
        b: int = 2

    assert Named.trusted(set=1, b=3).__dict__ == {"set": 1, "b": 3}

    class Static(Frozen):
        a: int

        @staticmethod
        def trusted(**_values: Any) -> Any:
            return "its own"

    assert Static.trusted(a=1) == "its own"
    dashed: Any = type("Dashed", (Frozen,), {"__annotations__": {"a-b": int}})
    assert dashed.trusted(**{"a-b": 1}).__dict__ == {"a-b": 1}

    class Cached(Frozen):
        a: int
        b: int = 0

        @cached_property
        def doubled(self) -> int:
            return 2 * self.b

    partial = Cached.model_construct(b=3)
    assert partial.doubled == 6
    again = partial.replaced(b=4)
    assert again.doubled == 8 and again.model_fields_set == {"b"}
    assert Frozen().replaced() == Frozen()


def test_from_tuple_floors_at_zero_and_still_refuses_amounts_out_of_bounds() -> None:
    floored = Credits.from_tuple((5, -4, 3.9, 2, 1))  # type: ignore[arg-type]
    built = Credits(compute_tokens=5, kv_tokens=0, kv_transfer_bytes=3, output_tokens=2, slots=1)
    assert floored == built and floored.model_fields_set == built.model_fields_set
    assert Credits.from_tuple(floored.as_tuple()) == floored
    top = Credits.from_tuple((MAX_TOKENS, MAX_TOKENS, MAX_BYTES, MAX_TOKENS, MAX_SLOTS))
    assert top.as_tuple() == (MAX_TOKENS, MAX_TOKENS, MAX_BYTES, MAX_TOKENS, MAX_SLOTS)
    for over in range(5):
        amounts = list(top.as_tuple())
        amounts[over] += 1
        with pytest.raises(ValidationError):
            Credits.from_tuple(amounts)


def test_a_total_past_a_bound_is_capped_at_it() -> None:
    """A node's open debits can total more than a credit's bound; reading them must not raise."""
    total = Credits.saturated([MAX_TOKENS + 1, -3, MAX_BYTES * 2, 7, MAX_SLOTS + 5])
    assert total.as_tuple() == (MAX_TOKENS, 0, MAX_BYTES, 7, MAX_SLOTS)
