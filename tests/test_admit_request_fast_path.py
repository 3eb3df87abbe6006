"""``admit_request_from_proto`` skips pydantic's validation for a plainly valid request: it must
answer exactly what the validating path answers, the same request or the same refusal (message
and field), for every message, at and across every bound."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.api.v1 import admission_pb2
from crossflow_ctl.domain.admission import (
    MAX_ATTEMPT,
    MAX_CANDIDATES,
    MAX_REQUEST_ID_LEN,
    AdmissionRequest,
)
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import MAX_ID_LEN, MAX_TOKENS, is_node_id
from crossflow_ctl.wire import convert_admission as ca

IDS = [
    "",
    "d1",
    "a",
    "A.b_c-9",
    "d1\n",
    "\nd1",
    "d 1",
    "-d1",
    ".d1",
    "d/1",
    "d\u0661",  # an Arabic-Indic digit: not [A-Za-z0-9]
    "\u00e9",
    "x" * MAX_ID_LEN,
    "x" * (MAX_ID_LEN + 1),
    "x" * 64,
    "x" * 65,
    "d1,d2",  # candidate ids are checked joined by commas: an id holding one must not split
    "d1,",
    ",d1",
    ",",
]
TOKENS = [0, 1, 512, MAX_TOKENS, MAX_TOKENS + 1, -1, -(2**63), 2**63 - 1]


def _outcome(convert: Any, msg: admission_pb2.AdmitRequest) -> tuple[str, Any]:
    try:
        return "ok", convert(msg)
    except InvalidArgument as exc:
        return "refused", (exc.message, exc.field)


def _same(msg: admission_pb2.AdmitRequest) -> None:
    fast = _outcome(ca.admit_request_from_proto, msg)
    slow = _outcome(ca.admit_request_validated, msg)
    assert fast == slow, msg
    if fast[0] == "ok":  # the same fields set, as a validated model has them
        assert fast[1].model_fields_set == slow[1].model_fields_set
        assert type(fast[1].candidate_node_ids) is tuple


@pytest.mark.parametrize("value", IDS)
def test_every_id_field_answers_as_the_model_does(value: str) -> None:
    for field in ("cached_prefix_node_id", "prefill_node_id", "pool"):
        _same(admission_pb2.AdmitRequest(uncached_prompt_tokens=5, **{field: value}))
    for ids in (["d1", value], [value], [value, "d2"], [value, value]):
        _same(admission_pb2.AdmitRequest(uncached_prompt_tokens=5, candidate_node_ids=ids))


@pytest.mark.parametrize("value", TOKENS)
def test_every_token_field_answers_as_the_model_does(value: int) -> None:
    for field in (
        "uncached_prompt_tokens",
        "cached_prefix_tokens",
        "expected_output_tokens",
        "held_ahead_tokens",
    ):
        _same(admission_pb2.AdmitRequest(**{field: value}))


@pytest.mark.parametrize("attempt", [0, 1, MAX_ATTEMPT, MAX_ATTEMPT + 1, 2**32 - 1])
def test_attempt_bounds(attempt: int) -> None:
    _same(admission_pb2.AdmitRequest(uncached_prompt_tokens=5, attempt=attempt))


@pytest.mark.parametrize("length", [0, MAX_REQUEST_ID_LEN, MAX_REQUEST_ID_LEN + 1])
def test_request_id_length(length: int) -> None:
    for char in ("r", "\u00e9"):  # characters, not bytes, as the model counts them
        _same(admission_pb2.AdmitRequest(request_id=char * length, uncached_prompt_tokens=5))


@pytest.mark.parametrize("count", [0, 1, MAX_CANDIDATES, MAX_CANDIDATES + 1])
def test_candidate_count(count: int) -> None:
    ids = [f"d{i}" for i in range(count)]
    _same(admission_pb2.AdmitRequest(uncached_prompt_tokens=5, candidate_node_ids=ids))


def test_a_plain_request_skips_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is taken (else the tests above compare the validating path with itself)."""

    def refuse(_msg: Any) -> AdmissionRequest:
        raise AssertionError("validated")

    monkeypatch.setattr(ca, "admit_request_validated", refuse)
    msg = admission_pb2.AdmitRequest(
        request_id="r1",
        uncached_prompt_tokens=512,
        cached_prefix_tokens=100,
        cached_prefix_node_id="d2",
        expected_output_tokens=64,
        candidate_node_ids=["d1", "d2"],
        dry_run=True,
        pool="p",
        attempt=2,
        held_ahead_tokens=7,
        prefill_node_id="p1",
    )
    assert ca.admit_request_from_proto(msg) == AdmissionRequest(
        request_id="r1",
        uncached_prompt_tokens=512,
        cached_prefix_tokens=100,
        cached_prefix_node_id="d2",
        expected_output_tokens=64,
        candidate_node_ids=("d1", "d2"),
        dry_run=True,
        pool="p",
        attempt=2,
        held_ahead_tokens=7,
        prefill_node_id="p1",
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.sampled_from(IDS), st.text(alphabet="ab,.-_\n9", max_size=6)), min_size=1)
)
def test_candidate_ids_checked_together_as_one_by_one(ids: list[str]) -> None:
    """The candidate list's one joined check answers as a check of each id would."""
    assert ca._all_node_ids(tuple(ids)) == all(is_node_id(i) for i in ids)


def test_many_candidates_skip_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full candidate sample takes the fast path too."""

    def refuse(_msg: Any) -> AdmissionRequest:
        raise AssertionError("validated")

    monkeypatch.setattr(ca, "admit_request_validated", refuse)
    ids = [f"decode-{i}" for i in range(MAX_CANDIDATES)]
    msg = admission_pb2.AdmitRequest(uncached_prompt_tokens=5, candidate_node_ids=ids)
    assert ca.admit_request_from_proto(msg).candidate_node_ids == tuple(ids)


_text = st.one_of(st.sampled_from(IDS), st.text(max_size=8))
_tokens = st.one_of(st.sampled_from(TOKENS), st.integers(-(2**63), 2**63 - 1))


@settings(max_examples=300, deadline=None)
@given(
    request_id=st.one_of(_text, st.sampled_from(["r" * 256, "r" * 257])),
    uncached=_tokens,
    cached=_tokens,
    cached_at=_text,
    output=_tokens,
    candidates=st.lists(_text, max_size=3),
    dry_run=st.booleans(),
    pool=_text,
    attempt=st.integers(0, 2**32 - 1),
    held=_tokens,
    prefill=_text,
)
def test_any_request_answers_as_the_model_does(
    request_id: str,
    uncached: int,
    cached: int,
    cached_at: str,
    output: int,
    candidates: list[str],
    dry_run: bool,
    pool: str,
    attempt: int,
    held: int,
    prefill: str,
) -> None:
    _same(
        admission_pb2.AdmitRequest(
            request_id=request_id,
            uncached_prompt_tokens=uncached,
            cached_prefix_tokens=cached,
            cached_prefix_node_id=cached_at,
            expected_output_tokens=output,
            candidate_node_ids=candidates,
            dry_run=dry_run,
            pool=pool,
            attempt=attempt,
            held_ahead_tokens=held,
            prefill_node_id=prefill,
        )
    )
