"""Label selectors: one grammar for the broker, the CLI and the client (kubectl's).

``zone=a,gpu!=h100,spot,!draining,tier in (gold,silver),region notin (eu)``: terms are ANDed.
``k=v`` and ``k==v`` need the label equal; ``k!=v`` needs it absent or different; ``k`` needs it
present; ``!k`` absent; ``k in (a,b)`` one of the values; ``k notin (a,b)`` absent or none of them.
Anything else is refused with :class:`InvalidArgument` naming ``selector``, so a typo never
silently selects nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from crossflow_ctl.domain.errors import InvalidArgument

MAX_SELECTOR_LEN = 1024
_KEY = r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?"
_KEY_RE = re.compile(_KEY)
_VALUE_RE = re.compile(_VALUE)
_SET_RE = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_EQ_RE = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})$")


class Op(StrEnum):
    EQ = "="
    NE = "!="
    IN = "in"
    NOTIN = "notin"
    EXISTS = "exists"
    ABSENT = "!"


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    op: Op
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        match self.op:
            case Op.EQ | Op.IN:
                return value is not None and value in self.values
            case Op.NE | Op.NOTIN:
                return value is None or value not in self.values
            case Op.EXISTS:
                return value is not None
            case Op.ABSENT:
                return value is None


@dataclass(frozen=True, slots=True)
class Selector:
    requirements: tuple[Requirement, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Selector:
        if len(text) > MAX_SELECTOR_LEN:
            raise InvalidArgument(f"longer than {MAX_SELECTOR_LEN} characters", field="selector")
        return cls(tuple(_requirement(term) for term in _terms(text)))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


def _terms(text: str) -> list[str]:
    """Split on commas outside parentheses; empty terms are skipped."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise InvalidArgument(f"unbalanced ')' at {i}", field="selector")
        elif ch == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    if depth:
        raise InvalidArgument("unbalanced '('", field="selector")
    terms.append(text[start:])
    return [t.strip() for t in terms if t.strip()]


def _requirement(term: str) -> Requirement:
    if m := _SET_RE.match(term):
        values = [v.strip() for v in m["values"].split(",") if v.strip()]
        if not values or not all(_VALUE_RE.fullmatch(v) for v in values):
            raise InvalidArgument(f"bad value list in {term!r}", field="selector")
        return Requirement(m["key"], Op(m["op"]), frozenset(values))
    if m := _EQ_RE.match(term):
        op = Op.NE if m["op"] == "!=" else Op.EQ
        return Requirement(m["key"], op, frozenset({m["value"]}))
    if term.startswith("!") and _KEY_RE.fullmatch(term[1:].strip()):
        return Requirement(term[1:].strip(), Op.ABSENT)
    if _KEY_RE.fullmatch(term):
        return Requirement(term, Op.EXISTS)
    raise InvalidArgument(
        f"cannot parse {term!r}: expected k=v, k!=v, k, !k, 'k in (a,b)' or 'k notin (a,b)'",
        field="selector",
    )
