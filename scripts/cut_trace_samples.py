"""Cut the small trace samples in tests/data/traces from the full public traces.

Usage: ``python scripts/cut_trace_samples.py FULL_TRACES_DIR [--out DIR] [--check]``.
``FULL_TRACES_DIR`` holds the full files (where to get them: tests/data/traces/README.md).

Each sample is the head of its source, byte for byte: the first ``lines`` lines (for the CSV, its
header and then that many rows). That is exactly what the tests read (``load_mooncake(...,
limit=600)`` and a sample give the same requests), so a result pinned on a head of a full trace
stays the same on its sample. ``--check`` writes nothing: it exits 1 when a sample in ``--out``
differs from a fresh cut.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "traces"


class Sample(NamedTuple):
    source: str
    """File name of the full trace."""
    name: str
    """File name of the sample."""
    lines: int
    """Lines kept from the top of the source (data rows; a CSV header is kept besides)."""
    header: bool = False


SAMPLES = (
    # tests read at most 600 requests of it (test_cluster, limit=600; test_pinned, 400)
    Sample("mooncake_conversation_trace.jsonl", "mooncake_conversation_trace_head600.jsonl", 600),
    # test_traces reads 100 rows
    Sample("AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_conv_head100.csv", 100, True),
    # the first three top-level sessions with all their sub-agents (trace_0003 has two): the
    # file keeps each session family on contiguous lines, and the fourth starts at line 484
    Sample("agent_sessions_sample.jsonl", "agent_sessions_sample_head483.jsonl", 483),
)


def cut(source: Path, sample: Sample) -> bytes:
    """The first ``sample.lines`` lines of ``source`` (plus a header), as bytes."""
    keep = sample.lines + (1 if sample.header else 0)
    out: list[bytes] = []
    with source.open("rb") as fh:
        for raw in fh:
            if len(out) == keep:
                break
            out.append(raw)
    if len(out) < keep:
        raise SystemExit(f"{source}: {len(out)} lines, fewer than the {keep} to keep")
    return b"".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("full", type=Path, help="folder holding the full traces")
    parser.add_argument("--out", type=Path, default=SAMPLES_DIR, help="where the samples go")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a change")
    args = parser.parse_args(argv)
    stale = []
    for sample in SAMPLES:
        data = cut(args.full / sample.source, sample)
        target = args.out / sample.name
        if args.check:
            if not target.is_file() or target.read_bytes() != data:
                stale.append(sample.name)
            continue
        target.write_bytes(data)
        print(f"{target}: {len(data):,} bytes from {sample.source}")
    if stale:
        print(f"differ from a fresh cut of {args.full}: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
