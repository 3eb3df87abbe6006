"""Traces the demo replays: a bundled synthetic agentic trace, and readers for trace files.

Everything is turned into sessions of turns. A session starts at ``start_s`` (open-loop traces),
at its parent's start + ``offset_s`` (sub-agents), or at a time drawn here (top-level sessions
of session traces: :func:`first_releases`). Turn k is released when turn k-1 has finished plus
``think_s`` (closed loop), so bursts come from the traffic itself.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossflow_ctl.domain.errors import InvalidArgument

BLOCK_TOKENS = 512
"""Mooncake ``hash_ids`` granularity."""
MAX_TURNS = 12
"""Turns kept per session of a session trace, so a short demo sees many sessions."""
SESSION_RATE_PER_S = 2.0
"""Start rate of top-level sessions that carry no start time (session traces)."""


@dataclass(frozen=True)
class Turn:
    uncached_tokens: int
    cached_tokens: int
    output_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    start_s: float | None = None
    parent_id: str | None = None
    offset_s: float = 0.0


@dataclass(frozen=True)
class Trace:
    name: str
    sessions: tuple[Session, ...]

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def summary(self) -> dict[str, Any]:
        turns = [t for s in self.sessions for t in s.turns]
        out = sum(t.output_tokens for t in turns) or 1
        return {
            "name": self.name,
            "sessions": len(self.sessions),
            "requests": len(turns),
            "uncached_tokens": sum(t.uncached_tokens for t in turns),
            "cached_tokens": sum(t.cached_tokens for t in turns),
            "output_tokens": sum(t.output_tokens for t in turns),
            "r_uncached_over_output": sum(t.uncached_tokens for t in turns) / out,
        }


def synthetic_agentic(
    sessions: int = 24, seed: int = 7, duration_s: float = 20.0, scale: float = 1.0
) -> Trace:
    """A small agentic trace: sessions arrive (Poisson, drifting rate), turns grow a cached
    prefix, tool results release the next turn after a short think time, and some turns spawn
    parallel sub-agents, so prompt work comes in bursts."""
    rng = random.Random(seed)
    out: list[Session] = []
    t = 0.0
    mean_gap = duration_s / max(1, sessions) * 0.6
    for i in range(sessions):
        # The arrival rate drifts: quiet, then a rush in the middle, then quiet again.
        phase = math.sin(math.pi * i / max(1, sessions - 1))
        t += rng.expovariate(1.0 / (mean_gap * (1.4 - phase)))
        sid = f"s{i:03d}"
        turns = _turns(rng, scale, first_cached=4096)
        out.append(Session(sid, turns, start_s=round(t, 3)))
        if rng.random() < 0.35:  # a tool call fans out to sub-agents
            spawn_at = rng.uniform(0.5, 2.5)
            for j in range(rng.randint(2, 4)):
                sub = _turns(rng, scale, first_cached=0, max_turns=3)
                out.append(Session(f"{sid}.{j}", sub, parent_id=sid, offset_s=round(spawn_at, 3)))
    return Trace(name=f"synthetic-agentic(seed={seed})", sessions=tuple(out))


def _turns(
    rng: random.Random, scale: float, first_cached: int, max_turns: int = 7
) -> tuple[Turn, ...]:
    turns = []
    context = first_cached
    for k in range(rng.randint(2, max_turns)):
        if k == 0:
            uncached = int(rng.uniform(3000, 9000) * scale)
        else:  # a tool result: mostly small, sometimes a whole file
            uncached = int(min(16000, rng.paretovariate(1.3) * 900) * scale)
        output = int(rng.uniform(40, 300))
        think = 0.0 if k == 0 else rng.uniform(0.2, 1.5)
        turns.append(Turn(uncached, context, output, round(think, 3)))
        context += uncached + output
    return tuple(turns)


def fit_prompts(trace: Trace, max_prompt_tokens: int) -> Trace:
    """The trace with every prompt scaled by one factor so the longest has at most
    ``max_prompt_tokens`` (cached and uncached alike, at least 1 token a turn); output tokens
    and times unchanged. For engines with a short context (the real-engine demo's tiny model
    takes 2048 tokens)."""
    longest = max((t.cached_tokens + t.uncached_tokens for s in trace.sessions for t in s.turns),
                  default=0)  # fmt: skip
    if longest <= max_prompt_tokens:
        return trace
    k = max_prompt_tokens / longest

    def turn(t: Turn) -> Turn:
        return Turn(max(1, int(t.uncached_tokens * k)), int(t.cached_tokens * k),
                    t.output_tokens, t.think_s)  # fmt: skip

    sessions = tuple(
        Session(s.session_id, tuple(map(turn, s.turns)), s.start_s, s.parent_id, s.offset_s)
        for s in trace.sessions
    )
    return Trace(f"{trace.name} x{k:.3g} tokens", sessions)


@dataclass(frozen=True)
class Release:
    """Turn ``index`` of ``session`` becoming ready at ``at_s`` (seconds into the replay)."""

    at_s: float
    session: Session
    index: int

    @property
    def turn(self) -> Turn:
        return self.session.turns[self.index]

    @property
    def key(self) -> tuple[str, int]:
        """(session id, turn index): the same request in every replay of the trace."""
        return (self.session.session_id, self.index)

    def next(self, finished_s: float, speed: float = 1.0) -> Release | None:
        """The session's next turn, released ``think_s`` (/ ``speed``) after this one
        finished at ``finished_s``; None after the last turn."""
        if self.index + 1 >= len(self.session.turns):
            return None
        think = self.session.turns[self.index + 1].think_s
        return Release(finished_s + think / speed, self.session, self.index + 1)


def first_releases(
    trace: Trace, speed: float = 1.0, session_rate_per_s: float = SESSION_RATE_PER_S
) -> list[Release]:
    """Start times of sessions: their own, their parent's + offset, or a Poisson draw (seeded:
    every replay of a trace starts its sessions at the same times); all divided by ``speed``
    (time compression: more load on the same servers)."""
    rng = random.Random(1)
    starts: dict[str, float] = {}
    t = 0.0
    out = []
    for s in trace.sessions:
        if s.start_s is not None:
            start = s.start_s
        elif s.parent_id is not None and s.parent_id in starts:
            start = starts[s.parent_id] + s.offset_s
        else:
            t += rng.expovariate(session_rate_per_s)
            start = t
        starts[s.session_id] = start
        out.append(Release(start, s, 0))
    base = min((r.at_s for r in out), default=0.0)
    return [Release((r.at_s - base) / speed, r.session, 0) for r in out]


# -- readers ---------------------------------------------------------------------------------


def load_trace(path: Path, max_requests: int = 2000) -> Trace:
    """Read a trace file (Mooncake, Azure or sessions) by its format: its first ``max_requests``."""
    if not path.is_file():
        raise InvalidArgument(f"no trace file at {path}", field="trace")
    if path.suffix == ".csv":
        return _azure(path, max_requests)
    with path.open() as fh:
        first = fh.readline()
    try:
        head = json.loads(first)
    except ValueError:
        raise InvalidArgument(f"{path}:1: not JSON", field="trace") from None
    if "session_id" in head:
        return _sessions(path, max_requests)
    return _mooncake(path, max_requests)


def _field(row: dict[str, Any], name: str, where: str, kind: type = int) -> Any:
    if name not in row or row[name] is None:
        raise InvalidArgument(f"{where}: missing field", field=name)
    try:
        value = kind(row[name])
    except (TypeError, ValueError):
        raise InvalidArgument(f"{where}: not a number: {row[name]!r}", field=name) from None
    if value < 0:
        raise InvalidArgument(f"{where}: negative value {value}", field=name)
    return value


def _sessions(path: Path, max_requests: int) -> Trace:
    by_id: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
    with path.open() as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path.name}:{n}"
            try:
                row = json.loads(line)
            except ValueError:
                raise InvalidArgument(f"{where}: not JSON", field="line") from None
            seq = _field(row, "seq", where)
            if _field(row, "cached_prefix_tokens", where) > _field(row, "input_length", where):
                raise InvalidArgument(f"{where}: cached > input", field="cached_prefix_tokens")
            rows = by_id.setdefault(str(row.get("session_id")), [])
            if seq != len(rows):
                raise InvalidArgument(f"{where}: seq {seq}, expected {len(rows)}", field="seq")
            rows.append(row | {"_where": where})
    sessions: list[Session] = []
    count = 0
    for sid, rows in by_id.items():
        if count >= max_requests:
            break
        rows = rows[: min(MAX_TURNS, max_requests - count)]
        count += len(rows)
        turns = tuple(
            Turn(
                uncached_tokens=int(r["input_length"]) - int(r["cached_prefix_tokens"]),
                cached_tokens=int(r["cached_prefix_tokens"]),
                output_tokens=_field(r, "output_length", r["_where"]),
                think_s=_field(r, "think_time_s", r["_where"], float),
            )
            for r in rows
        )
        parent = rows[0].get("parent_session_id")
        offset = rows[0].get("offset_s")
        sessions.append(Session(sid, turns, parent_id=parent, offset_s=float(offset or 0.0)))
    known = {s.session_id for s in sessions}
    sessions = [s if s.parent_id in known else _orphan(s) for s in sessions]
    return Trace(name=path.name, sessions=tuple(sessions))


def _orphan(s: Session) -> Session:
    return Session(s.session_id, s.turns)


def _mooncake(path: Path, max_requests: int) -> Trace:
    """Open loop; uncached tokens from an unbounded prefix cache over ``hash_ids``."""
    seen: set[int] = set()
    sessions: list[Session] = []
    with path.open() as fh:
        for n, line in enumerate(fh, 1):
            if len(sessions) >= max_requests:
                break
            where = f"{path.name}:{n}"
            row = json.loads(line)
            ts = _field(row, "timestamp", where, float) / 1000.0
            length = _field(row, "input_length", where)
            hits = 0
            for h in row.get("hash_ids", []):
                if h not in seen:
                    break
                hits += 1
            seen.update(row.get("hash_ids", []))
            cached = min(length, hits * BLOCK_TOKENS)
            turn = Turn(length - cached, cached, _field(row, "output_length", where))
            sessions.append(Session(f"r{n}", (turn,), start_s=ts))
    return Trace(name=path.name, sessions=tuple(sessions))


def _azure(path: Path, max_requests: int) -> Trace:
    sessions: list[Session] = []
    t0: float | None = None
    with path.open() as fh:
        for n, row in enumerate(csv.DictReader(fh), 2):
            if len(sessions) >= max_requests:
                break
            where = f"{path.name}:{n}"
            stamp = _azure_time(row.get("TIMESTAMP", ""), where)
            t0 = stamp if t0 is None else t0
            turn = Turn(
                _field(row, "ContextTokens", where), 0, _field(row, "GeneratedTokens", where)
            )
            sessions.append(Session(f"r{n}", (turn,), start_s=stamp - t0))
    return Trace(name=path.name, sessions=tuple(sessions))


def _azure_time(text: str, where: str) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(text.strip()[:26]).timestamp()
    except ValueError:
        raise InvalidArgument(f"{where}: bad timestamp {text!r}", field="TIMESTAMP") from None
