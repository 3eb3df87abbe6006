"""The relay's fast notice path (the store's ``redis_codec.notice_rows``, then the transport's
``wire.convert.notice_rows_to_proto``) against the path it replaces,
``notice_to_proto(notice_from(...))``: for any stream entry, the same message field for field
and byte for byte, or a refusal where that path refuses (issue 13)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.api.v1 import lease_pb2
from crossflow_ctl.domain.models import MAX_TOKENS, NoticeKind
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.wire.convert import notice_rows_to_proto, notice_to_proto

# Hypothesis's failure report touches mypy_extensions.TypedDict; with warnings as errors that
# warning would replace the falsifying example by an INTERNALERROR.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
)

INT64 = 2**63 - 1
debits = st.builds(
    lambda xs: ",".join(map(str, xs)),
    st.lists(st.integers(-5, 10**6) | st.integers(0, 10**15), min_size=5, max_size=5),
)
valid: dict[str, st.SearchStrategy[str]] = {
    "k": st.sampled_from([k.value for k in NoticeKind]),
    "r": st.text(max_size=24),
    "d": debits,
    "t": st.integers(-(2**63), INT64).map(str),
    "p": st.integers(0, MAX_TOKENS).map(str),
}
corrupt: dict[str, st.SearchStrategy[str]] = {
    "k": st.sampled_from(["", "bogus", "GRANT"]),
    "d": st.sampled_from([f"{MAX_TOKENS + 1},0,0,0,0", "1,2,3", "a,b,c,d,e"]),
    "t": st.sampled_from([str(2**64), "x"]),
    "p": st.sampled_from(["-1", str(MAX_TOKENS + 1), "x"]),
}


@st.composite
def field_sets(draw: st.DrawFn) -> dict[str, str]:
    """Mostly what ``cf_notice`` writes (``p`` and the others sometimes missing), now and then
    one field missing or corrupt."""
    fields = {name: draw(s) for name, s in valid.items() if name == "k" or draw(st.booleans())}
    if draw(st.integers(0, 4)) == 0:
        name = draw(st.sampled_from(sorted(valid)))
        if name in corrupt and draw(st.booleans()):
            fields[name] = draw(corrupt[name])
        else:
            fields.pop(name, None)
    return fields


@st.composite
def entries(draw: st.DrawFn) -> tuple[Any, dict[Any, Any]]:
    """One entry as XRANGE returns it, from a client with or without decode_responses."""
    seq = draw(st.integers(1, INT64))
    fields = draw(field_sets())
    if draw(st.booleans()):
        return f"{seq}-0", fields
    return f"{seq}-0".encode(), {k.encode(): v.encode() for k, v in fields.items()}


def old_way(entry: tuple[Any, dict[Any, Any]]) -> lease_pb2.Notice | type[Exception]:
    try:
        return notice_to_proto(codec.notice_from("d1", *entry))
    except ValueError as exc:  # pydantic's ValidationError is one
        return ValueError if isinstance(exc, ValueError) else type(exc)


def new_way(entry: tuple[Any, dict[Any, Any]]) -> lease_pb2.Notice | type[Exception]:
    try:
        batch = notice_rows_to_proto(codec.notice_rows("d1", [entry]))
    except ValueError:
        return ValueError
    (notice,) = batch.notices
    return notice


@settings(max_examples=400, deadline=None)
@given(entries())
def test_the_fast_conversion_equals_the_notice_path(entry: tuple[Any, dict[Any, Any]]) -> None:
    old, new = old_way(entry), new_way(entry)
    if isinstance(old, type):
        assert new is old
        return
    assert isinstance(new, lease_pb2.Notice)
    assert new == old
    assert new.HasField("debit") and new.HasField("pulled_tokens") == old.HasField("pulled_tokens")
    assert new.SerializeToString(deterministic=True) == old.SerializeToString(deterministic=True)


@settings(max_examples=50, deadline=None)
@given(st.lists(entries(), max_size=20))
def test_a_batch_keeps_the_entries_order(batch_entries: list[tuple[Any, Any]]) -> None:
    olds = [old_way(e) for e in batch_entries]
    if any(isinstance(o, type) for o in olds):
        return  # a refused entry refuses the read: covered entry by entry above
    batch = notice_rows_to_proto(codec.notice_rows("d1", batch_entries))
    assert list(batch.notices) == olds


def test_a_debit_message_is_shared_never_modified() -> None:
    """The memoized debit message is copied into each notice: changing one notice's debit
    changes neither the memo nor the next notice."""
    entry: tuple[Any, dict[Any, Any]] = (
        b"1-0",
        {b"k": b"grant", b"r": b"r1", b"d": b"1,2,3,4,5", b"t": b"7"},
    )
    batch = notice_rows_to_proto(codec.notice_rows("d1", [entry, entry]))
    batch.notices[0].debit.slots = 99
    assert batch.notices[1].debit.slots == 5
    again = notice_rows_to_proto(codec.notice_rows("d1", [entry]))
    assert again.notices[0].debit.slots == 5
