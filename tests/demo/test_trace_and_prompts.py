"""The demo's trace readers, its release times and the prompts it sends, on hand-checkable
cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crossflow_ctl.demo.prompts import MARK_WORDS, Prompts
from crossflow_ctl.demo.trace import (
    Release,
    Session,
    Trace,
    Turn,
    first_releases,
    load_trace,
    synthetic_agentic,
)
from crossflow_ctl.domain.errors import InvalidArgument


def test_synthetic_trace_is_deterministic_agentic_and_bursty() -> None:
    a, b = synthetic_agentic(seed=3), synthetic_agentic(seed=3)
    assert a == b and a != synthetic_agentic(seed=4)
    subs = [s for s in a.sessions if s.parent_id is not None]
    assert subs, "some tool calls fan out to sub-agents"
    for s in a.sessions:
        # every turn after the first re-reads the whole context so far as cached prefix
        for prev, turn in zip(s.turns, s.turns[1:], strict=False):
            assert (
                turn.cached_tokens == prev.cached_tokens + prev.uncached_tokens + prev.output_tokens
            )
    assert (
        synthetic_agentic(seed=3, scale=2.0).summary()["uncached_tokens"]
        > a.summary()["uncached_tokens"]
    )


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROW = {
    "session_id": "s",
    "seq": 0,
    "parent_session_id": None,
    "offset_s": None,
    "think_time_s": 0.0,
    "input_length": 100,
    "cached_prefix_tokens": 40,
    "output_length": 7,
}


def test_session_trace_reader_and_its_refusals(tmp_path: Path) -> None:
    trace = load_trace(_write(tmp_path / "ok.jsonl", [ROW, {**ROW, "seq": 1, "think_time_s": 2}]))
    assert trace.sessions[0].turns == (Turn(60, 40, 7, 0.0), Turn(60, 40, 7, 2.0))
    bad = [
        ({**ROW, "seq": 1}, "seq"),
        ({**ROW, "cached_prefix_tokens": 101}, "cached_prefix_tokens"),
        ({**ROW, "output_length": -1}, "output_length"),
        ({k: v for k, v in ROW.items() if k != "input_length"}, "input_length"),
    ]
    for row, field in bad:
        with pytest.raises(InvalidArgument) as err:
            load_trace(_write(tmp_path / "bad.jsonl", [row]))
        assert err.value.field == field and "bad.jsonl:1" in err.value.message


def test_mooncake_prefix_cache_and_azure_reader(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]},
    ]
    trace = load_trace(_write(tmp_path / "m.jsonl", rows))
    assert [s.turns[0] for s in trace.sessions] == [Turn(1000, 0, 5), Turn(176, 1024, 5)]
    assert [s.start_s for s in trace.sessions] == [0.0, 1.5]
    csv = tmp_path / "a.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.4799600,31,2\n"
    )
    azure = load_trace(csv)
    assert [s.turns[0].uncached_tokens for s in azure.sessions] == [4808, 31]
    assert azure.sessions[1].start_s == pytest.approx(1.5)
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n")
    with pytest.raises(InvalidArgument, match=r"a\.csv:2"):
        load_trace(csv)


def test_releases_are_closed_loop_and_the_same_every_replay() -> None:
    s = Session("s", (Turn(10, 0, 5), Turn(10, 15, 5, think_s=1.0)), start_s=0.0)
    sub = Session("s.0", (Turn(1, 0, 1),), parent_id="s", offset_s=2.0)
    top = Session("t", (Turn(1, 0, 1),))  # no start time: drawn, the same draw every time
    trace = Trace("t", (s, sub, top))
    first = first_releases(trace)
    assert [r.at_s for r in first[:2]] == [0.0, 2.0]
    assert first == first_releases(trace)
    assert [r.at_s for r in first_releases(trace, speed=2.0)[:2]] == [0.0, 1.0]
    # turn 1 comes its think time after turn 0 finished (at 3 s), compressed by speed
    nxt = first[0].next(finished_s=3.0, speed=2.0)
    assert nxt == Release(3.5, s, 1) and nxt.key == ("s", 1) and nxt.turn.cached_tokens == 15
    assert nxt.next(finished_s=9.0) is None


def test_prompts_have_the_turns_lengths_and_share_the_sessions_prefix() -> None:
    """One word a token (the fake engines' tokenizer); turn k+1 starts with turn k's prompt,
    top-level sessions share their first turn's cached words (a system prompt) and part after
    it; another replay's salt shares nothing."""
    a = Session("a", (Turn(100, 64, 5), Turn(40, 169, 5)), start_s=0.0)
    b = Session("b b", (Turn(50, 64, 5),), start_s=0.0)
    sub = Session("a.0", (Turn(30, 0, 5),), parent_id="a")
    prompts = Prompts("x")
    a0, a1 = prompts.text(a, 0).split(), prompts.text(a, 1).split()
    b0, sub0 = prompts.text(b, 0).split(), prompts.text(sub, 0).split()
    assert (len(a0), len(a1), len(b0), len(sub0)) == (164, 209, 114, 30)
    assert a1[: len(a0)] == a0
    assert a0[:64] == b0[:64] and a0[64] != b0[64]  # the system prompt, then each its own
    assert len(set(a0[64 : 64 + MARK_WORDS]) & set(b0)) == 0
    assert all(" " not in w for w in b0)  # a session id with a space stays one word each
    assert sub0[0] != a0[0]
    other = Prompts("y").text(a, 0).split()
    assert len(other) == 164 and other[0] != a0[0]
    prompts.forget(a)
    assert prompts.text(a, 1).split() == a1  # rebuilt the same


def test_default_log_dir_is_new_and_left_in_place(tmp_path) -> None:
    from crossflow_ctl.demo.run import demo_log_dir

    first, second = demo_log_dir(None), demo_log_dir(None)
    try:
        assert first != second and first.is_dir() and first.name.startswith("crossflow-demo-")
        chosen = demo_log_dir(tmp_path / "a" / "b")
        assert chosen.is_dir()
    finally:
        first.rmdir()
        second.rmdir()


def test_a_bad_demo_trace_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """`crossflow demo --trace` refusals said the reader's field ("error: trace: no trace
    file ...", "error: line: t.jsonl:1: not JSON"), not the flag; they name --trace, exit 2,
    and still say which field of the trace is at fault."""
    import subprocess
    import sys

    bad = tmp_path / "t.jsonl"
    bad.write_text('{"session_id": "a", "seq": 0}\nnot json\n')
    main = "from crossflow_ctl.cli.crossflow import main; main()"
    for path, said in (
        (tmp_path / "missing.jsonl", "error: --trace: no trace file at "),
        (bad, "error: --trace: t.jsonl:1: missing field (cached_prefix_tokens)"),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", main, "demo", "--trace", str(path), "--no-sim"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(said), proc.stderr
