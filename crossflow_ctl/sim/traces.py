"""Trace loaders: Mooncake jsonl, Azure LLM inference CSV, session traces; load scaling.

Every loader returns a :class:`Trace`: requests in file order, each released either at an
absolute time (open loop) or by another request (closed loop):

* ``after_finish = i``: released ``delay_s`` after request ``i`` finishes (the next turn of a
  session after its think time; a burst of tool-driven requests);
* ``after_release = i``: released ``delay_s`` after request ``i`` is released (a sub-agent
  session starting ``offset_s`` after its parent session started);
* neither: released at ``arrival_s``.

Load scaling is time compression: every absolute time and every delay is divided by ``scale``
(1x, 4x, 16x). The warm-up window is stated in trace seconds, so it covers the same requests at
every load.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from crossflow_ctl.domain.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class TraceRequest:
    input_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    cached_tokens: int | None = None
    """Known cached prefix tokens; None means the prefix-cache model decides (Mooncake)."""
    hash_ids: tuple[int, ...] = ()
    after_finish: int | None = None
    after_release: int | None = None
    delay_s: float = 0.0
    session: str = ""


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]
    warmup_s: float = 0.0
    """Requests released before this (trace seconds) are simulated but not measured."""
    scale: float = 1.0

    @property
    def closed_loop(self) -> bool:
        return any(r.after_finish is not None for r in self.requests)

    @property
    def open_span_s(self) -> float:
        """Span of the absolute arrival times (closed-loop follow-ups not included)."""
        times = [
            r.arrival_s for r in self.requests if r.after_finish is None and r.after_release is None
        ]
        return max(times) - min(times) if times else 0.0

    def scaled(self, scale: float) -> Trace:
        """Time-compressed by ``scale`` (4.0 = four times the load)."""
        if not (math.isfinite(scale) and scale > 0):
            raise InvalidArgument("load scale must be a positive number", field="scale")
        reqs = tuple(
            replace(r, arrival_s=r.arrival_s / scale, delay_s=r.delay_s / scale)
            for r in self.requests
        )
        return Trace(
            name=self.name,
            requests=reqs,
            warmup_s=self.warmup_s / scale,
            scale=self.scale * scale,
        )

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (dependencies on later ones cannot exist: they point back)."""
        return replace(self, requests=self.requests[:n])

    def with_warmup(self, warmup_s: float) -> Trace:
        return replace(self, warmup_s=warmup_s / self.scale)


def _bad(path: Path, line: int, field: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{path.name} line {line}: {why}", field=field)


def _int_field(obj: dict[str, Any], key: str, path: Path, line: int) -> int:
    if key not in obj:
        raise _bad(path, line, key, f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(path, line, key, f"field {key!r} must be an integer, got {value!r}")
    if value < 0:
        raise _bad(path, line, key, f"field {key!r} is negative ({value})")
    return value


def _float_field(obj: dict[str, Any], key: str, path: Path, line: int) -> float:
    if key not in obj:
        raise _bad(path, line, key, f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(path, line, key, f"field {key!r} must be a finite number, got {value!r}")
    if value < 0:
        raise _bad(path, line, key, f"field {key!r} is negative ({value})")
    return float(value)


def _json_lines(path: Path, limit: int | None) -> list[tuple[int, dict[str, Any]]]:
    out: list[tuple[int, dict[str, Any]]] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _bad(path, lineno, "json", f"not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise _bad(path, lineno, "json", "each line must be a JSON object")
            out.append((lineno, obj))
    return out


def load_mooncake(path: Path, limit: int | None = None) -> Trace:
    """Mooncake jsonl: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    reqs: list[TraceRequest] = []
    for lineno, obj in _json_lines(path, limit):
        ts = _float_field(obj, "timestamp", path, lineno)
        inp = _int_field(obj, "input_length", path, lineno)
        out = _int_field(obj, "output_length", path, lineno)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in ids
        ):
            raise _bad(path, lineno, "hash_ids", "field 'hash_ids' must be a list of integers")
        if inp < 1:
            raise _bad(path, lineno, "input_length", "input_length must be at least 1")
        reqs.append(
            TraceRequest(
                input_tokens=inp,
                output_tokens=max(1, out),
                arrival_s=ts / 1000.0,
                hash_ids=tuple(ids),
            )
        )
    return Trace(name=path.stem, requests=tuple(_sorted_open(reqs)))


def _sorted_open(reqs: list[TraceRequest]) -> list[TraceRequest]:
    t0 = min((r.arrival_s for r in reqs), default=0.0)
    ordered = sorted(reqs, key=lambda r: r.arrival_s)
    return [replace(r, arrival_s=r.arrival_s - t0) for r in ordered]


def load_azure(path: Path, limit: int | None = None) -> Trace:
    """Azure LLM inference CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` (no prefix data)."""
    reqs: list[TraceRequest] = []
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        for row in reader:
            lineno = reader.line_num
            if limit is not None and len(reqs) >= limit:
                break
            for key in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
                if not row.get(key):
                    raise _bad(path, lineno, key, f"missing field {key!r}")
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26]).timestamp()
            except ValueError:
                raise _bad(path, lineno, "TIMESTAMP", "not a timestamp") from None
            try:
                inp, out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except ValueError:
                raise _bad(path, lineno, "ContextTokens", "token counts must be integers") from None
            if inp < 1 or out < 0:
                raise _bad(path, lineno, "ContextTokens", "token counts out of range")
            reqs.append(
                TraceRequest(
                    input_tokens=inp, output_tokens=max(1, out), arrival_s=ts, cached_tokens=0
                )
            )
    return Trace(name=path.stem, requests=tuple(_sorted_open(reqs)))


@dataclass(frozen=True, slots=True)
class _SessionLine:
    lineno: int
    session: str
    seq: int
    parent: str | None
    offset_s: float | None
    think_s: float
    inp: int
    cached: int
    out: int


def _parse_session_line(path: Path, lineno: int, obj: dict[str, Any]) -> _SessionLine:
    sid = obj.get("session_id")
    if not isinstance(sid, str) or not sid:
        raise _bad(path, lineno, "session_id", "missing or empty field 'session_id'")
    if "parent_session_id" not in obj:
        raise _bad(path, lineno, "parent_session_id", "missing field 'parent_session_id'")
    parent = obj["parent_session_id"]
    if parent is not None and not isinstance(parent, str):
        raise _bad(path, lineno, "parent_session_id", "must be a string or null")
    if "offset_s" not in obj:
        raise _bad(path, lineno, "offset_s", "missing field 'offset_s'")
    offset = None if obj["offset_s"] is None else _float_field(obj, "offset_s", path, lineno)
    line = _SessionLine(
        lineno=lineno,
        session=sid,
        seq=_int_field(obj, "seq", path, lineno),
        parent=parent,
        offset_s=offset,
        think_s=_float_field(obj, "think_time_s", path, lineno),
        inp=_int_field(obj, "input_length", path, lineno),
        cached=_int_field(obj, "cached_prefix_tokens", path, lineno),
        out=_int_field(obj, "output_length", path, lineno),
    )
    if line.cached > line.inp:
        raise _bad(
            path,
            lineno,
            "cached_prefix_tokens",
            f"cached_prefix_tokens ({line.cached}) > input_length ({line.inp})",
        )
    if line.inp < 1:
        raise _bad(path, lineno, "input_length", "input_length must be at least 1")
    if line.seq == 0 and parent is not None and offset is None:
        raise _bad(path, lineno, "offset_s", "a sub-agent session's seq 0 needs offset_s")
    return line


def _group_sessions(path: Path, lines: list[_SessionLine]) -> dict[str, list[_SessionLine]]:
    """Lines by session, in seq order; refuses gaps in seq and unknown parents."""
    by_session: dict[str, list[_SessionLine]] = {}
    for ln in lines:
        by_session.setdefault(ln.session, []).append(ln)
    for sid, items in by_session.items():
        items.sort(key=lambda x: (x.seq, x.lineno))
        for want, item in enumerate(items):
            if item.seq != want:
                raise _bad(
                    path, item.lineno, "seq", f"session {sid!r}: seq {item.seq}, expected {want}"
                )
        parent = items[0].parent
        if parent is not None and parent not in by_session:
            raise _bad(path, items[0].lineno, "parent_session_id", f"unknown session {parent!r}")
    return by_session


def _parents_first(path: Path, by_session: dict[str, list[_SessionLine]]) -> list[str]:
    """Session ids ordered so that every parent comes before its sub-agents."""
    order: list[str] = []
    placed: set[str] = set()
    pending = list(by_session)
    while pending:
        ready = [s for s in pending if by_session[s][0].parent in (None, *placed)]
        if not ready:
            bad = by_session[pending[0]][0]
            raise _bad(path, bad.lineno, "parent_session_id", "sub-agent sessions form a cycle")
        for sid in ready:
            order.append(sid)
            placed.add(sid)
        pending = [s for s in pending if s not in placed]
    return order


def load_sessions(
    path: Path,
    *,
    session_rate_per_s: float | None = None,
    seed: int = 0,
    limit: int | None = None,
) -> Trace:
    """Session trace (one request per line), replayed closed-loop.

    Top-level sessions start as a Poisson process of ``session_rate_per_s`` (default: the
    sessions spread over one hour), drawn with ``seed``; sub-agent sessions start ``offset_s``
    after their parent session; each later request is released ``think_time_s`` after the
    previous request of its session finished. Refuses a malformed file naming line and field.
    """
    lines = [_parse_session_line(path, n, o) for n, o in _json_lines(path, limit)]
    by_session = _group_sessions(path, lines)
    tops = [s for s, items in by_session.items() if items[0].parent is None]
    rate = session_rate_per_s or max(len(tops), 1) / 3600.0
    rng = random.Random(seed)
    start: dict[str, float] = {}
    t = 0.0
    for sid in tops:
        start[sid] = t
        t += rng.expovariate(rate)
    reqs: list[TraceRequest] = []
    first_index: dict[str, int] = {}
    for sid in _parents_first(path, by_session):
        parent = by_session[sid][0].parent
        for item in by_session[sid]:
            base = TraceRequest(
                input_tokens=item.inp,
                output_tokens=max(1, item.out),
                cached_tokens=min(item.cached, item.inp - 1),
                session=sid,
            )
            if item.seq > 0:
                req = replace(base, after_finish=len(reqs) - 1, delay_s=item.think_s)
            elif parent is not None:
                req = replace(base, after_release=first_index[parent], delay_s=item.offset_s or 0.0)
            else:
                req = replace(base, arrival_s=start[sid])
            if item.seq == 0:
                first_index[sid] = len(reqs)
            reqs.append(req)
    return Trace(name=path.stem, requests=tuple(reqs))


def load_trace(path: Path, limit: int | None = None, seed: int = 0) -> Trace:
    """Pick the loader from the file: CSV -> Azure; jsonl with ``session_id`` -> sessions;
    jsonl with ``hash_ids`` -> Mooncake."""
    if not path.is_file():
        raise InvalidArgument(f"no such trace file: {path}", field="trace")
    if path.suffix.lower() == ".csv":
        return load_azure(path, limit)
    with path.open(encoding="utf-8") as fh:
        first = fh.readline()
    try:
        obj = json.loads(first)
    except json.JSONDecodeError:
        raise _bad(path, 1, "json", "not valid JSON") from None
    if isinstance(obj, dict) and "session_id" in obj:
        return load_sessions(path, seed=seed, limit=limit)
    return load_mooncake(path, limit)
