"""The demo's trace readers and its router model, on hand-checkable cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crossflow_ctl.demo.model import ClusterModel, ModelParams, first_releases, replay_static
from crossflow_ctl.demo.trace import Session, Trace, Turn, load_trace, synthetic_agentic
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


def test_model_normal_and_borrowed_paths_by_hand() -> None:
    p = ModelParams(
        prefill_servers=1,
        prefill_rate_tps=10_000.0,
        kv_bytes_per_token=1000,
        kv_transfer_bytes_per_s=1e9,
    )
    model = ClusterModel(p)
    # 5000 tokens at 10k/s = 0.5 s, + 5000 x 1000 B / 1 GB/s = 5 ms of transfer
    assert model.normal(0.0, Turn(5000, 0, 10))[1] == pytest.approx(0.505)
    # the next prompt queues behind it
    assert model.normal(0.1, Turn(1000, 0, 10))[1] == pytest.approx(0.4 + 0.1 + 0.001)
    assert model.borrowed(0.0, "d1", 0.2, queue_wait_s=0.05) == pytest.approx(0.25)
    assert model.borrowed(0.0, "d1", 0.2) == pytest.approx(0.45)


def test_model_prices_the_normal_path_on_the_engines_roofline() -> None:
    """The router's model priced a prompt's prefill at a flat rate, its cached prefix free,
    while the fake prefill engines (and so the agents' reports the broker judged Demand and
    Benefit by) paid for the prefix: the broker borrowed prompts it expected to wait ~1.2 s on
    the normal path that the model put at ~0.1 s, and the demo's TTFT p50 came out worse with
    leases than static. The model now takes the engines' own time."""
    from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, prefill_time_s, roofline

    roof = roofline(MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"])
    p = ModelParams(prefill_servers=1, roof=roof, prefill_chunk_tokens=8192, prefill_slowdown=2.0)
    short, long = Turn(2000, 0, 10), Turn(2000, 30_000, 10)
    assert p.prefill_s(long) == pytest.approx(2.0 * prefill_time_s(roof, 2000, 30_000, 8192))
    assert p.prefill_s(long) > 1.5 * p.prefill_s(short)
    done = ClusterModel(p).normal(0.0, long)[1]
    transfer = 32_000 * p.kv_bytes_per_token / p.kv_transfer_bytes_per_s
    assert done == pytest.approx(p.prefill_s(long) + transfer)


def test_static_replay_is_closed_loop() -> None:
    s = Session("s", (Turn(10_000, 0, 100), Turn(10_000, 0, 100, think_s=1.0)), start_s=0.0)
    p = ModelParams(
        prefill_servers=1, prefill_rate_tps=10_000.0, kv_transfer_bytes_per_s=1e13, itl_ms=10.0
    )
    result = replay_static(Trace("t", (s,)), p)
    # turn 0: TTFT 1 s, decode 1 s, think 1 s -> turn 1 released at 3 s, TTFT 1 s, done at 5 s
    assert result.requests == 2
    assert result.ttft_ms == pytest.approx([1000.0, 1000.0], rel=1e-3)
    assert result.makespan_s == pytest.approx(5.0, rel=1e-3)
    sub = Session("s.0", (Turn(1, 0, 1),), parent_id="s", offset_s=2.0)
    starts = [r.at_s for r in first_releases(Trace("t", (s, sub)), p)]
    assert starts == [0.0, 2.0]


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
