"""Trace loaders, the prefix-cache model, load scaling and the synthetic agentic generator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.sim.prefix_cache import (
    BLOCK_TOKENS,
    CacheScope,
    LruBlockCache,
    PrefixCacheModel,
    cached_tokens,
)
from crossflow_ctl.sim.synthetic import AgenticSpec, generate_agentic
from crossflow_ctl.sim.traces import load_azure, load_mooncake, load_sessions, load_trace


def _line(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "session_id": "s1",
        "seq": 0,
        "parent_session_id": None,
        "offset_s": None,
        "think_time_s": 0.0,
        "input_length": 100,
        "cached_prefix_tokens": 0,
        "output_length": 10,
    }
    base.update(over)
    return base


def _write(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sessions_replay_closed_loop(tmp_path: Path) -> None:
    rows = [
        _line(),
        _line(seq=1, think_time_s=5.0, input_length=150, cached_prefix_tokens=110),
        _line(session_id="sub", parent_session_id="s1", offset_s=2.0),
    ]
    trace = load_sessions(_write(tmp_path, rows))
    first, second, sub = trace.requests
    assert trace.closed_loop
    assert first.arrival_s == 0.0 and first.after_finish is None
    assert second.after_finish == 0 and second.delay_s == 5.0 and second.cached_tokens == 110
    assert sub.after_release == 0 and sub.delay_s == 2.0
    assert trace.scaled(4).requests[1].delay_s == 1.25


@pytest.mark.parametrize(
    ("rows", "line", "field"),
    [
        ([_line(), _line(seq=1, output_length=-3)], 2, "output_length"),
        (
            [_line(), {k: v for k, v in _line(seq=1).items() if k != "input_length"}],
            2,
            "input_length",
        ),
        ([_line(input_length=10, cached_prefix_tokens=11)], 1, "cached_prefix_tokens"),
        ([_line(), _line(seq=2)], 2, "seq"),
        (
            [_line(), _line(session_id="x", parent_session_id="nope", offset_s=1.0)],
            2,
            "parent_session_id",
        ),
        ([_line(), _line(session_id="x", parent_session_id="s1")], 2, "offset_s"),
    ],
)
def test_malformed_session_file_is_refused_with_line_and_field(
    tmp_path: Path, rows: list[dict[str, Any]], line: int, field: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        load_sessions(_write(tmp_path, rows))
    assert err.value.field == field
    assert f"line {line}:" in str(err.value)


def test_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_line()) + "\n{oops\n")
    with pytest.raises(InvalidArgument, match="line 2"):
        load_sessions(path)


def test_lru_keeps_leading_prefix_and_evicts_oldest() -> None:
    cache = LruBlockCache(3)
    cache.insert([1, 2, 3])
    assert cache.hit_blocks([1, 2, 9]) == 2
    assert cache.hit_blocks([2, 3]) == 2
    assert cache.hit_blocks([9, 1]) == 0  # the first miss ends the prefix
    cache.insert([4])  # evicts 1, the least recently used
    assert cache.hit_blocks([1, 2]) == 0 and cache.evictions == 1
    assert cached_tokens(2, 5000) == 2 * BLOCK_TOKENS
    assert cached_tokens(3, 1024) == 1023  # the last token is always computed


def test_per_node_cache_depends_on_routing() -> None:
    model = PrefixCacheModel(CacheScope.NODE, capacity_tokens=100 * BLOCK_TOKENS, prefill_nodes=2)
    assert model.admit([1, 2, 3], 1536, 0) == 0
    assert model.best_node([1, 2, 7]) == (0, 2)
    assert model.admit([1, 2, 7], 1536, 1) == 0  # node 1 never saw the prefix
    assert model.admit([1, 2, 7], 1536, 0) == 2 * BLOCK_TOKENS
    shared = PrefixCacheModel(CacheScope.CLUSTER, 100 * BLOCK_TOKENS, 2)
    shared.admit([1, 2, 3], 1536, 0)
    assert shared.admit([1, 2, 7], 1536, 1) == 2 * BLOCK_TOKENS


def test_mooncake_slice(mooncake_sample: Path) -> None:
    trace = load_mooncake(mooncake_sample, limit=200)
    assert len(trace.requests) == 200
    assert all(r.cached_tokens is None and r.hash_ids for r in trace.requests)
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    assert trace.scaled(16).requests[-1].arrival_s == pytest.approx(
        trace.requests[-1].arrival_s / 16
    )


def test_azure_slice(azure_conv_sample: Path) -> None:
    trace = load_azure(azure_conv_sample, limit=100)
    assert len(trace.requests) == 100
    assert trace.requests[0].arrival_s == 0.0
    assert trace.requests[1].arrival_s == pytest.approx(4.3145788, abs=1e-3)
    assert all(r.cached_tokens == 0 for r in trace.requests)


def test_agent_sessions_file_loads(sessions_sample: Path) -> None:
    trace = load_trace(sessions_sample)
    assert len(trace.requests) == 483
    assert trace.closed_loop
    # trace_0003 spawns two sub-agents: the first request of each is released after one of it
    subs = {r.session: r.after_release for r in trace.requests if r.after_release is not None}
    assert sorted(subs) == ["trace_0003/agent_001", "trace_0003/agent_002"]
    assert {trace.requests[i].session for i in subs.values()} == {"trace_0003"}


def test_synthetic_generator_is_seeded_and_agentic() -> None:
    spec = AgenticSpec(duration_s=600, sessions_per_min=10)
    a, b = generate_agentic(spec, seed=3), generate_agentic(spec, seed=3)
    assert a == b
    assert a != generate_agentic(spec, seed=4)
    reqs = a.requests
    assert all((r.cached_tokens or 0) < r.input_tokens for r in reqs)
    follow = [(r, r.after_finish) for r in reqs if r.after_finish is not None]
    assert follow, "sessions must have dependent turns"
    # Growing cached prefixes: a turn caches at least its parent's whole prompt.
    assert all((r.cached_tokens or 0) >= reqs[parent].input_tokens for r, parent in follow)
    # Tool-result bursts: several requests released by the same finished request.
    parents = [parent for _, parent in follow]
    assert max(parents.count(p) for p in set(parents)) >= 2
