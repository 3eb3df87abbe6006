"""Online calibration: how close the fit gets to a known truth, how many periods it takes, and what
it buys a cluster whose agents start from the wrong hardware.

    python benchmarks/calibration.py [--seeds 5] [--windows 24] [--noise 0.03]
                                     [--sim-duration 600] [--load 8] [--no-sim]

1. **Fit error against truth** on synthetic telemetry (pure, seeded): windows of varied decode
   batch, context and chunk share whose mean step time is the truth's times (1 + noise), fitted
   from the h200 preset. Per truth: each rate's error, the error of held-out predictions (a
   decode step and a 1536-token chunk at shapes no window had), the fit's error over its windows
   beside the floor (the truth's own error on the same windows: the noise) and the prior's, and
   the fit's CPU time.
2. **Periods to converge**: the windows fed one a period to the agent's OnlineCalibrator
   (default guards: 3 windows before a fit, constants move at most 2x a period); the period the
   fit is first accepted, and the first from which the held-out predictions stay within 10% of
   the truth's.
3. **Simulator** (unless ``--no-sim``): a seeded agentic trace on 2P4D H200 servers under leases,
   with agents given the true profile (the reference, same run), agents given a wrong preset
   (gb300: faster than the servers; h100: slower), and the same wrong presets calibrating online
   from their servers' step counters: TTFT and ITL (mean, p99), share borrowed, SLO attainment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import statistics
import time

import structlog

from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, NodeProfile, roofline
from crossflow_ctl.domain.online_calibration import CalibrationSettings, OnlineCalibrator, Using
from crossflow_ctl.domain.step_fit import fit_step_constants, predicted_step_s
from crossflow_ctl.domain.step_windows import StepWindow

MODEL = MODEL_PRESETS["gpt-oss-120b"]
PRIOR = NODE_PRESETS["h200"]
TRUTHS: dict[str, NodeProfile] = {
    "slower GPU (2.8x FLOP/s, 2.6x HBM)": PRIOR.model_copy(
        update={"name": "slow", "flops_per_s": 2.5e14, "hbm_bytes_per_s": 1.6e12,
                "host_step_s": 0.009, "step_overhead_s": 0.002}
    ),
    "CPU-like (1000x FLOP/s)": PRIOR.model_copy(
        update={"name": "cpu", "flops_per_s": 6e11, "hbm_bytes_per_s": 4e9, "host_step_s": 0.05}
    ),
    "h100 (1.4x HBM)": NODE_PRESETS["h100"],
    "gb300 (faster)": NODE_PRESETS["gb300"],
}  # fmt: skip
HELD_OUT = {"decode B=8 C=32K": (8, 8 * 4096, 0), "chunk 1536 at B=8": (8, 8 * 4096, 1536)}


def windows(truth: NodeProfile, seed: int, n: int, noise: float) -> list[StepWindow]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        batch = rng.choice([1, 2, 4, 8, 16, 32, 64, 128])
        share = rng.choice([0.0, 0.0, 0.05, 0.1, 0.2, 0.5])
        chunk = float(rng.choice([64, 256, 1024, 2048]))
        mix = ((1.0, 0.0),) if share == 0 else ((1 - share, 0.0), (share, chunk))
        w = StepWindow(
            window_s=5.0, steps=200.0, decode_tokens=200.0 * batch,
            prefill_tokens=200.0 * share * chunk, mix=mix,
            context_tokens=batch * rng.choice([512, 2048, 8192, 32768]),
            prefix_tokens=rng.choice([0, 1000, 8000]), itl_s=1.0, itl_count=200.0 * batch,
        )  # fmt: skip
        y = predicted_step_s(MODEL, truth, w) * (1 + noise * rng.gauss(0, 1))
        out.append(w.model_copy(update={"itl_s": y}))
    return out


def held_out_error(node: NodeProfile, truth: NodeProfile) -> dict[str, float]:
    fitted, true = roofline(MODEL, node), roofline(MODEL, truth)
    return {
        name: abs(fitted.step_s(*shape) / true.step_s(*shape) - 1)
        for name, shape in HELD_OUT.items()
    }


def floor_error(truth: NodeProfile, wins: list[StepWindow]) -> float:
    rel = [(predicted_step_s(MODEL, truth, w) - w.itl_s) / w.itl_s for w in wins]
    return math.sqrt(sum(r * r for r in rel) / len(rel))


def fit_accuracy(seeds: int, n: int, noise: float) -> None:
    print(f"1. fit error against truth: {n} windows, noise {noise:.0%}, prior h200, {seeds} seeds")
    print(
        f"   {'truth':36} {'flops err':>10} {'hbm err':>9} {'decode err':>10} {'chunk err':>9}"
        f" {'fit err':>8} {'floor':>6} {'prior':>7} {'cpu ms':>7}"
    )
    for label, truth in TRUTHS.items():
        rows = []
        for seed in range(seeds):
            wins = windows(truth, seed, n, noise)
            t0 = time.process_time()
            fit = fit_step_constants(MODEL, PRIOR, wins)
            cpu = time.process_time() - t0
            held = held_out_error(fit.profile, truth)
            rows.append((
                abs(fit.profile.flops_per_s / truth.flops_per_s - 1),
                abs(fit.profile.hbm_bytes_per_s / truth.hbm_bytes_per_s - 1),
                held["decode B=8 C=32K"], held["chunk 1536 at B=8"],
                fit.error, floor_error(truth, wins), fit.prior_error, cpu * 1000,
            ))  # fmt: skip
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        worst = [max(col) for col in zip(*rows, strict=True)]
        for name, v in (("median", med), ("worst", worst)):
            print(
                f"   {label if name == 'median' else '':36} {v[0]:>9.1%} {v[1]:>9.1%}"
                f" {v[2]:>10.1%} {v[3]:>9.1%} {v[4]:>8.1%} {v[5]:>6.1%} {v[6]:>7.0%}"
                f" {v[7]:>7.0f}  ({name})"
            )


def periods_to_converge(seeds: int, n: int, noise: float) -> None:
    print("\n2. periods to converge (one window a period, default guards)")
    print(f"   {'truth':36} {'first fit':>10} {'held-out within 10%':>20} {'of periods':>10}")
    for label, truth in TRUTHS.items():
        firsts, closes = [], []
        for seed in range(seeds):
            cal = OnlineCalibrator(MODEL, PRIOR, CalibrationSettings())
            first = close = None
            for period, w in enumerate(windows(truth, seed, n, noise), start=1):
                cal.add(w, at_s=5.0 * period)
                cal.update(5.0 * period)
                if first is None and cal.state().using is not Using.PRIOR:
                    first = period
                ok = max(held_out_error(cal.profile, truth).values()) <= 0.10
                close = (close or period) if ok else None
            firsts.append(first or math.inf)
            closes.append(close or math.inf)
        print(
            f"   {label:36} {statistics.median(firsts):>10} {statistics.median(closes):>20}"
            f" {n:>10}   (median; worst {max(firsts)}, {max(closes)})"
        )


async def simulate(duration_s: float, load: float) -> None:
    from crossflow_ctl.sim.cluster import Simulation
    from crossflow_ctl.sim.config import PolicyKind, SimConfig
    from crossflow_ctl.sim.metrics import summarize
    from crossflow_ctl.sim.synthetic import AgenticSpec, generate_agentic

    trace = generate_agentic(AgenticSpec(duration_s=duration_s), seed=1).scaled(load)
    print(
        f"\n3. simulator: agentic trace, {duration_s:g} s at {load:g}x, 2P4D h200 servers,"
        " leases; agents priced with:"
    )
    print(
        f"   {'agents':30} {'TTFT mean':>10} {'p99':>8} {'ITL mean':>9} {'p99':>7}"
        f" {'borrowed':>9} {'SLO ok':>7} {'cpu s':>6}  fitted (flops, hbm, host / truth)"
    )
    on = CalibrationSettings(enabled=True)
    truth = NODE_PRESETS["h200"]
    for label, kw in (
        ("the truth (h200)", {}),
        ("gb300 preset", {"agent_hardware": "gb300"}),
        ("gb300 preset + calibration", {"agent_hardware": "gb300", "agent_calibration": on}),
        ("h100 preset", {"agent_hardware": "h100"}),
        ("h100 preset + calibration", {"agent_hardware": "h100", "agent_calibration": on}),
    ):
        cfg = SimConfig(policy=PolicyKind.LEASES, hardware="h200", **kw)
        t0 = time.process_time()
        sim = Simulation(trace, cfg)
        s = summarize(await sim.run())
        cpu = time.process_time() - t0
        fitted = ""
        agents = [a for a in sim.decode_agents if a.calibrator is not None]
        if agents:
            r = [
                statistics.median(getattr(a.node, f) / getattr(truth, f) for a in agents)
                for f in ("flops_per_s", "hbm_bytes_per_s", "host_step_s")
            ]
            fitted = f"{r[0]:.2f}, {r[1]:.2f}, {r[2]:.2f}"
        print(
            f"   {label:30} {s.ttft_mean_ms:>8.0f}ms {s.ttft_p99_ms:>6.0f}ms"
            f" {s.itl_mean_ms:>7.1f}ms {s.itl_p99_ms:>5.1f}ms {s.borrowed_share:>9.1%}"
            f" {s.slo_attainment:>7.1%} {cpu:>6.1f}  {fitted}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--windows", type=int, default=24)
    parser.add_argument("--noise", type=float, default=0.03)
    parser.add_argument("--sim-duration", type=float, default=600.0)
    parser.add_argument("--load", type=float, default=8.0)
    parser.add_argument("--no-sim", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    fit_accuracy(args.seeds, args.windows, args.noise)
    periods_to_converge(args.seeds, args.windows, args.noise)
    if not args.no_sim:
        asyncio.run(simulate(args.sim_duration, args.load))


if __name__ == "__main__":
    main()
