"""The simulator's report: markdown tables and PNG plots in one folder.

matplotlib is imported lazily (``sim`` or ``dev`` extra); without it the report has its tables
and says the plots were skipped. Nothing here reads the clock: the same records give the same
report, byte for byte (wall times are shown only when ``show_wall`` is set).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from crossflow_ctl.sim.config import SimConfig
from crossflow_ctl.sim.metrics import RunRecord, Summary, summarize
from crossflow_ctl.sim.sweep import Comparison, rel, sweep_failures


def _f(x: float, digits: int = 0) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:,.{digits}f}"


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x * 100:+.1f} %"


def runs_table(summaries: Sequence[Summary], show_wall: bool = False) -> list[str]:
    head = (
        "| trace | load | config | TTFT mean / p50 / p99 (ms) | ITL mean / p99 (ms) "
        "| in tok/s | out tok/s | steady in / out tok/s | SLO ok | stranded | borrowed "
        "| KV waits | over-commit |"
    )
    lines = [head + (" wall s |" if show_wall else "")]
    lines.append("|---" * (13 + show_wall) + "|")
    for s in summaries:
        row = (
            f"| {s.trace} | {s.scale:g}x | {s.label} "
            f"| {_f(s.ttft_mean_ms)} / {_f(s.ttft_p50_ms)} / {_f(s.ttft_p99_ms)} "
            f"| {_f(s.itl_mean_ms, 1)} / {_f(s.itl_p99_ms, 1)} "
            f"| {_f(s.input_tps)} | {_f(s.output_tps)} "
            f"| {_f(s.steady_input_tps)} / {_f(s.steady_output_tps)} "
            f"| {s.slo_attainment * 100:.1f} % "
            f"| {s.stranded * 100:.1f} % | {s.borrowed_share * 100:.1f} % | {s.borrow_kv_waits} "
            f"| {s.overcommits} |"
        )
        lines.append(row + (f" {s.wall_s:.1f} |" if show_wall else ""))
    return lines


def key_table(summaries: Sequence[Summary]) -> list[str]:
    """Leases and the heuristic on 2P4D / 4P2D against the best static split."""
    cmp = Comparison(summaries)
    lines = [
        "| trace | load | best static | config | in tok/s vs best | out tok/s vs best "
        "| steady in / out vs best | TTFT mean vs best | ITL mean vs best "
        "| SLO ok (best static) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for trace, load in cmp.groups():
        best = cmp.best_static(trace, load)
        if best is None:
            continue
        for label in ("2P4D/leases", "4P2D/leases", "2P4D/threshold", "4P2D/threshold"):
            s = cmp.find(trace, load, label)
            if s is None:
                continue
            lines.append(
                f"| {trace} | {load:g}x | {best.label} | {label} "
                f"| {_pct(rel(s.input_tps, best.input_tps))} "
                f"| {_pct(rel(s.output_tps, best.output_tps))} "
                f"| {_pct(rel(s.steady_input_tps, best.steady_input_tps))} / "
                f"{_pct(rel(s.steady_output_tps, best.steady_output_tps))} "
                f"| {_pct(rel(s.ttft_mean_ms, best.ttft_mean_ms))} "
                f"| {_pct(rel(s.itl_mean_ms, best.itl_mean_ms))} "
                f"| {s.slo_attainment * 100:.1f} % ({best.slo_attainment * 100:.1f} %) |"
            )
    return lines


def verdict(summaries: Sequence[Summary]) -> list[str]:
    """One line a reader can act on: where 2P4D with leases beat the best static split in
    drain-inclusive input tokens/s, by how much, and where it lost."""
    cmp = Comparison(summaries)
    cells: list[tuple[float, str]] = []
    for trace, load in cmp.groups():
        best, leases = cmp.best_static(trace, load), cmp.find(trace, load, "2P4D/leases")
        if best is None or leases is None or best.label == leases.label:
            continue
        cells.append((rel(leases.input_tps, best.input_tps), f"{trace} {load:g}x"))
    if not cells:
        return []
    won = sorted((c for c in cells if c[0] > 0), reverse=True)
    lost = sorted(c for c in cells if c[0] < 0)
    text = (
        f"**Verdict**: 2P4D with leases beat the best static split in input tokens/s on "
        f"{len(won)} of {len(cells)} trace/load cells"
    )
    if won:
        text += f" (best {_pct(won[0][0])} at {won[0][1]})"
    if lost:
        text += f"; it lost on {len(lost)} (worst {_pct(lost[0][0])} at {lost[0][1]})"
    return [text + ".", ""]


def checks_section(failures: Sequence[str]) -> list[str]:
    """The sweep's checks (:func:`~crossflow_ctl.sim.sweep.sweep_failures`): held, or each
    failure on its own line."""
    lines = ["## Checks", ""]
    if not failures:
        return [
            *lines,
            "Every check held: leases' ITL p99 within the SLO, no over-commit, and no leases run"
            " worse than static on its own split in mean TTFT or drain-inclusive tokens/s.",
            "",
        ]
    return [*lines, f"**{len(failures)} FAILED**:", "", *(f"- {f}" for f in failures), ""]


def targets_table(summaries: Sequence[Summary]) -> list[str]:
    """Per trace and load: the best static split, then leases and the heuristic on 2P4D and
    4P2D, in absolute figures (the issue's targets are read off this table)."""
    cmp = Comparison(summaries)
    lines = [
        "| trace | load | config | in tok/s | out tok/s | steady in / out tok/s "
        "| TTFT mean / p99 (ms) | ITL p99 (ms) | borrowed | over-commit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for trace, load in cmp.groups():
        best = cmp.best_static(trace, load)
        rows = [best] if best is not None else []
        for label in ("2P4D/leases", "2P4D/threshold", "4P2D/leases", "4P2D/threshold"):
            found = cmp.find(trace, load, label)
            if found is not None:
                rows.append(found)
        for s in rows:
            name = f"{s.label} (best static)" if s is best else s.label
            lines.append(
                f"| {trace} | {load:g}x | {name} | {_f(s.input_tps)} | {_f(s.output_tps)} "
                f"| {_f(s.steady_input_tps)} / {_f(s.steady_output_tps)} "
                f"| {_f(s.ttft_mean_ms)} / {_f(s.ttft_p99_ms)} | {_f(s.itl_p99_ms, 1)} "
                f"| {s.borrowed_share * 100:.1f} % | {s.overcommits} |"
            )
    return lines


def _mean(sums: dict[str, float], name: str, count: int, digits: int = 0) -> str:
    return _f(sums.get(name, 0.0) / count, digits) if count else "n/a"


def lease_table(records: Sequence[RunRecord]) -> list[str]:
    """Per leases run: the share of zero leases by reason, and the mean non-zero lease."""
    lines = [
        "| trace | load | config | leases | zero | zero reasons | mean non-zero lease: compute "
        "/ output / kv tokens, slots, chunk |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if not r.leases:
            continue
        zero = sum(r.zero_reasons.values())
        why = ", ".join(
            f"{k} {v / r.leases * 100:.1f} %"
            for k, v in sorted(r.zero_reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        live = r.leases - zero
        sums = r.lease_credit_sums
        chunk = _f(r.lease_chunk_sum / live) if live else "n/a"
        lines.append(
            f"| {r.trace} | {r.scale:g}x | {r.label} | {r.leases:,} "
            f"| {zero / r.leases * 100:.1f} % | {why or '-'} "
            f"| {_mean(sums, 'compute_tokens', live)} / {_mean(sums, 'output_tokens', live)} "
            f"/ {_mean(sums, 'kv_tokens', live)}, {_mean(sums, 'slots', live, 1)}, {chunk} |"
        )
    return lines


def phase_table(records: Sequence[RunRecord]) -> list[str]:
    """Per run and path: where the TTFT of a measured request goes, mean seconds."""
    lines = [
        "| trace | load | config | path | requests | hold | queue | prefill | transfer "
        "| KV wait | TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        for path in ("normal", "borrowed"):
            sums = r.phase_sums.get(path)
            if not sums or not sums[0]:
                continue
            n = sums[0]
            parts = " | ".join(_f(v / n, 2) for v in sums[1:])
            lines.append(
                f"| {r.trace} | {r.scale:g}x | {r.label} | {path} | {int(n):,} | {parts} "
                f"| {_f(sum(sums[1:]) / n, 2)} |"
            )
    return lines


DEFINITIONS = """\
Definitions: TTFT is release to first token (the request joins a decode batch); ITL is per
token (step times weighted by the batch), after the warm-up; throughput is tokens of measured
requests over the span from the first measured release to the last measured finish (the drain
included); steady is the tokens worked through between the end of the warm-up and the last
release (input of prompts prefilled in it, output decoded in it, whichever requests they belong
to), over that window (offered load still arriving, no drain); SLO ok is
the share of requests with TTFT <= the TTFT SLO and mean ITL <= the ITL SLO; stranded is the
share of server-seconds not spent stepping; borrowed is the share of prompts prefilled on a
decode node; KV waits counts borrowed prompts that waited for KV room on their node, in the
queue it shares with transferred requests (the lease had promised room); over-commit counts
granted debits after which a node's open debits exceeded its lease x borrow shares (must be 0).
Best static: highest output throughput, then lowest mean TTFT among splits within 1 % of it."""


def queue_words(config: SimConfig) -> str:
    """How the leases runs' router queue orders held prompts (client QueueConfig)."""
    if not config.late_binding:
        return "off (no late binding)"
    q = config.queue
    words = f"{q.order}, hold up to {q.max_hold_ms:,} ms"
    if q.fresh_first_ms is None or q.max_hold_ms < q.fresh_first_ms:
        return words
    return f"{words}, fresh-first ({q.fresh_order}) once behind {q.fresh_first_ms:,} ms"


def write_report(
    out_dir: Path,
    records: Sequence[RunRecord],
    config: SimConfig,
    *,
    title: str = "Crossflow simulation",
    command: str = "",
    show_wall: bool = False,
    plots: bool = True,
    notes: Sequence[str] = (),
) -> Path:
    """Write ``report.md`` (and PNGs) into ``out_dir``; returns the report's path. ``notes``:
    markdown lines placed before the verdict (how ``--load auto`` chose its loads)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in records]
    lines = [f"# {title}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [
        f"Model {config.model} on {config.node_profile.name}; decode KV "
        f"{config.kv_capacity_tokens:,} tokens per server; ITL SLO "
        f"{config.lease.itl_slo_ms:g} ms, TTFT SLO "
        f"{config.ttft_slo_ms:g} ms; agent period {config.agent_period_ms} ms; "
        f"borrow horizon {config.lease.horizon_ms} ms, borrow share "
        f"{config.broker_policy.borrow_share:g} (KV {config.broker_policy.borrow_kv_share:g}); "
        f"prefix cache {config.cache_scope.value} ({config.cache_capacity_tokens:,} tokens); "
        f"router queue {queue_words(config)}; seed {config.seed}.",
        "",
        *notes,
        *verdict(summaries),
        "## Leases and the heuristic against the best static split",
        "",
        *key_table(summaries),
        "",
        "## Targets: best static, leases and the heuristic",
        "",
        *targets_table(summaries),
        "",
        "## Every run",
        "",
        *runs_table(summaries, show_wall),
        "",
        DEFINITIONS,
        "",
    ]
    total_oc = sum(s.overcommits for s in summaries)
    lines += [f"Over-commit count over all runs: **{total_oc}** (must be 0).", ""]
    lines += checks_section(sweep_failures(summaries, config.lease.itl_slo_ms))
    reasons = [r for r in records if r.admit_reasons]
    if reasons:
        lines += ["## Admission reasons (leases runs)", ""]
        for r in reasons:
            parts = ", ".join(f"{k} {v}" for k, v in sorted(r.admit_reasons.items()))
            short = ", ".join(f"{k} {v}" for k, v in sorted(r.short_credits.items()))
            extra = f" (short credits on candidate nodes: {short})" if short else ""
            queue = ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items()))
            late = f"; router queue: held {r.held}, re-offers {r.reoffers}" if r.held else ""
            late += f"; outcomes: {queue}" if queue else ""
            lines.append(f"- {r.trace} {r.scale:g}x {r.label}: {parts}{extra}{late}")
        lines += ["", "## Decode agents' leases (leases runs)", "", *lease_table(reasons), ""]
    lines += [
        "## Where TTFT goes (mean seconds per measured request)",
        "",
        "hold: in the router (late binding); queue: for its prefill to start (prefill pool, or"
        " on its decode node); transfer: KV to decode, or the cached prefix to the decode node;"
        " KV wait: for KV room on the decode node.",
        "",
        *phase_table(records),
        "",
    ]
    if plots:
        lines += _plots(out_dir, records, summaries, config.lease.itl_slo_ms)
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _plots(
    out_dir: Path, records: Sequence[RunRecord], summaries: Sequence[Summary], slo_ms: float
) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots skipped: matplotlib is not installed; pip install 'crossflow[sim]')", ""]
    out = ["## Plots", ""]
    for name, drawer in (
        ("timeseries.png", _timeseries),
        ("ttft_cdf.png", _ttft_cdf),
        ("itl_cdf.png", partial(_itl_cdf, slo_ms=slo_ms)),
        ("sweep.png", _sweep),
    ):
        fig = drawer(plt, records, summaries)
        if fig is None:
            continue
        fig.savefig(out_dir / name, dpi=90, metadata={"Software": None})
        plt.close(fig)
        out += [f"![{name}]({name})", ""]
    return out


def _leases_records(records: Sequence[RunRecord]) -> list[RunRecord]:
    return [r for r in records if r.label.endswith("/leases")] or list(records)


def _timeseries(plt: Any, records: Sequence[RunRecord], _s: Sequence[Summary]) -> Any:
    chosen = _leases_records(records)[:6]
    if not chosen or not chosen[0].windows:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=False)
    drawn: set[str] = set()
    for r in chosen:
        xs, rs, shares = _broken_at_gaps(r.windows, r.scale)
        if r.trace not in drawn:  # R per trace minute is the trace's, whatever the load or policy
            drawn.add(r.trace)
            ax1.plot(xs, rs, label=r.trace)
        ax2.plot(xs, shares, label=f"{r.trace} {r.scale:g}x {r.label}")
    ax1.set_ylabel("R = uncached in / out")
    ax2.set_ylabel("borrowed share (%)")
    ax2.set_xlabel("trace minute")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _broken_at_gaps(
    windows: Sequence[Sequence[float]], scale: float
) -> tuple[list[float], list[float], list[float]]:
    """(trace minute, R, borrowed %) per window, with a NaN point where the trace has no
    window for a while (an idle stretch), so a line is not drawn across it."""
    xs: list[float] = []
    rs: list[float] = []
    shares: list[float] = []
    starts = [w[0] for w in windows]
    steps = sorted(b - a for a, b in itertools.pairwise(starts) if b > a)
    usual = steps[len(steps) // 2] if steps else 0.0
    for i, w in enumerate(windows):
        if i and usual and w[0] - windows[i - 1][0] > 1.5 * usual:
            xs.append(float("nan"))
            rs.append(float("nan"))
            shares.append(float("nan"))
        xs.append(w[0] * scale / 60.0)
        rs.append(w[1])
        shares.append(w[2] * 100)
    return xs, rs, shares


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def _ttft_cdf(plt: Any, records: Sequence[RunRecord], _s: Sequence[Summary]) -> Any:
    loads = sorted({r.scale for r in records})
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        for r in records:
            if r.scale == load and r.ttft_s and r.trace == records[0].trace:
                xs, ys = _cdf([t * 1000 for t in r.ttft_s])
                ax.plot(xs, ys, label=r.label)
        _log_ms_axis(ax, subs=(1.0,))  # TTFT spans decades: a label per decade
        ax.set_title(f"TTFT CDF\n{records[0].trace} {load:g}x", fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def _log_ms_axis(ax: Any, subs: tuple[float, ...] = (1.0, 2.0, 5.0)) -> None:
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("ms (log scale)")


def _itl_cdf(
    plt: Any, records: Sequence[RunRecord], _s: Sequence[Summary], slo_ms: float = 0.0
) -> Any:
    loads = sorted({r.scale for r in records})
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        for r in records:
            if r.scale == load and r.itl_hist and r.trace == records[0].trace:
                keys = sorted(r.itl_hist)
                total = sum(r.itl_hist.values())
                acc, ys = 0, []
                for k in keys:
                    acc += r.itl_hist[k]
                    ys.append(acc / total)
                ax.plot([k * 1000 for k in keys], ys, label=r.label)
        _log_ms_axis(ax)  # the tail past the SLO is what matters; a linear axis squashed it
        if slo_ms:
            ax.axvline(slo_ms, color="black", linestyle="--", linewidth=0.8, label="ITL SLO")
        ax.set_title(f"ITL CDF (per token)\n{records[0].trace} {load:g}x", fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def _sweep(plt: Any, _r: Sequence[RunRecord], summaries: Sequence[Summary]) -> Any:
    groups = Comparison(summaries).groups()
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 4), squeeze=False)
    for ax, (trace, load) in zip(axes[0], groups, strict=True):
        rows = [s for s in summaries if s.trace == trace and s.scale == load]
        for policy in ("static", "threshold", "leases"):
            pts = sorted(
                (int(s.label.split("P")[0]), s.input_tps)
                for s in rows
                if s.label.endswith("/" + policy)
            )
            if pts:
                ax.plot([p for p, _ in pts], [v for _, v in pts], "o-", label=policy)
        # From zero and with no offset: a 0.01% spread must look like one, not like a loss.
        ax.set_ylim(bottom=0)
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
        ax.set_title(f"{trace}\n{load:g}x load", fontsize=8, wrap=True)
        ax.set_xlabel("prefill servers (the rest decode)")
        ax.set_ylabel("input tok/s (drain-inclusive)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig
