"""Label selectors: kubectl's grammar, one parser for the broker and every client."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.selectors import Selector

LABELS = {"zone": "a", "gpu": "h200", "tier": "gold"}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("", True),
        ("zone=a", True),
        ("zone==a", True),
        ("zone=b", False),
        ("zone!=a", False),
        ("zone!=b", True),
        ("missing!=x", True),
        ("gpu", True),
        ("missing", False),
        ("!missing", True),
        ("!zone", False),
        ("zone=a,gpu=h200", True),
        ("zone=a, gpu!=h200", False),
        ("tier in (gold,silver)", True),
        ("tier in (silver)", False),
        ("tier notin (silver, bronze),zone=a", True),
        ("missing notin (x)", True),
        ("missing in (x)", False),
    ],
)
def test_selector_terms(selector: str, expected: bool) -> None:
    assert Selector.parse(selector).matches(LABELS) is expected


@pytest.mark.parametrize(
    "selector", ["zone=(a", "zone in a,b", "=a", "zone in ()", "zone=a)", "a b", "zone===a"]
)
def test_bad_selectors_are_refused_naming_the_field(selector: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        Selector.parse(selector)
    assert err.value.field == "selector"


def test_oversized_selector_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        Selector.parse("k=v," * 400)
