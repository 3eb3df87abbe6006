"""A second opinion for the demo's summary: the project's simulator on the same trace.

``crossflow_ctl.sim`` runs the real admission policy, store and lease rules on a modelled
cluster; the demo asks it for the same split on static P/D and with leases, so the summary shows
the model's like-for-like comparison (TTFT, ITL, borrowed share, over-commits) next to the two
measured runs.
"""

from __future__ import annotations

from dataclasses import replace

from crossflow_ctl.demo.trace import Trace, first_releases
from crossflow_ctl.sim.cluster import simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import Summary, summarize
from crossflow_ctl.sim.traces import Trace as SimTrace
from crossflow_ctl.sim.traces import TraceRequest


def to_sim_trace(
    trace: Trace, speed: float = 1.0, max_output_tokens: int | None = None
) -> SimTrace:
    """Sessions as the simulator's closed-loop requests (same start times and output caps as
    the demo's)."""
    cap = max_output_tokens or 2**31
    starts = {r.session.session_id: r.at_s for r in first_releases(trace, speed)}
    reqs: list[TraceRequest] = []
    for session in trace.sessions:
        for i, turn in enumerate(session.turns):
            prompt = max(1, turn.uncached_tokens + turn.cached_tokens)
            base = TraceRequest(
                input_tokens=prompt,
                output_tokens=max(1, min(cap, turn.output_tokens)),
                cached_tokens=min(turn.cached_tokens, prompt - 1),
                session=session.session_id,
            )
            if i == 0:
                reqs.append(replace(base, arrival_s=starts[session.session_id]))
            else:
                reqs.append(replace(base, after_finish=len(reqs) - 1, delay_s=turn.think_s / speed))
    return SimTrace(name=trace.name, requests=tuple(reqs))


async def simulate_both(
    trace: Trace,
    prefill: int,
    decode: int,
    model: str,
    hardware: str,
    speed: float = 1.0,
    max_output_tokens: int | None = None,
) -> dict[str, Summary]:
    """Static and leases on the demo's split, same trace."""
    sim_trace = to_sim_trace(trace, speed, max_output_tokens)
    out = {}
    for policy in (PolicyKind.STATIC, PolicyKind.LEASES):
        config = SimConfig(
            model=model,
            hardware=hardware,
            prefill_nodes=prefill,
            decode_nodes=decode,
            policy=policy,
        )
        out[policy.value] = summarize(await simulate(sim_trace, config))
    return out


def sim_lines(results: dict[str, Summary], split: str) -> list[str]:
    static, leases = results["static"], results["leases"]

    def change(new: float, old: float) -> str:
        return f"{100.0 * (new - old) / old:+.1f}%" if old > 0 else "n/a"

    rows = [
        ("", f"leases {split}", f"static {split}", "change"),
        (
            "TTFT mean (ms)",
            f"{leases.ttft_mean_ms:.0f}",
            f"{static.ttft_mean_ms:.0f}",
            change(leases.ttft_mean_ms, static.ttft_mean_ms),
        ),
        (
            "TTFT p99 (ms)",
            f"{leases.ttft_p99_ms:.0f}",
            f"{static.ttft_p99_ms:.0f}",
            change(leases.ttft_p99_ms, static.ttft_p99_ms),
        ),
        (
            "ITL mean (ms)",
            f"{leases.itl_mean_ms:.1f}",
            f"{static.itl_mean_ms:.1f}",
            change(leases.itl_mean_ms, static.itl_mean_ms),
        ),
        ("borrowed", f"{100.0 * leases.borrowed_share:.1f}%", "0", ""),
        ("over-commits", str(leases.overcommits), str(static.overcommits), ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return [
        "  " + "   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
