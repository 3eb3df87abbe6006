"""Checks of the identifiers and selectors the service accepts; InvalidArgument naming the field."""

from __future__ import annotations

import re

from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import ID_PATTERN, MAX_ID_LEN
from crossflow_ctl.store.keys import node_of_reservation

MAX_RESERVATION_ID_LEN = 256
_ID_RE = re.compile(ID_PATTERN)


def check_node_id(node_id: str, field: str = "node_id") -> str:
    if not node_id:
        raise InvalidArgument("must not be empty", field=field)
    if len(node_id) > MAX_ID_LEN:
        raise InvalidArgument(f"longer than {MAX_ID_LEN} characters", field=field)
    if not _ID_RE.fullmatch(node_id):
        raise InvalidArgument(f"must match {ID_PATTERN}", field=field)
    return node_id


def check_reservation_id(reservation_id: str) -> str:
    if not reservation_id:
        raise InvalidArgument("must not be empty", field="reservation_id")
    if len(reservation_id) > MAX_RESERVATION_ID_LEN:
        raise InvalidArgument(
            f"longer than {MAX_RESERVATION_ID_LEN} characters", field="reservation_id"
        )
    node_of_reservation(reservation_id)  # well formed, before any record is claimed for it
    return reservation_id


def check_request_id(request_id: str) -> str:
    if len(request_id) > MAX_RESERVATION_ID_LEN:
        raise InvalidArgument(
            f"longer than {MAX_RESERVATION_ID_LEN} characters", field="request_id"
        )
    return request_id
