"""``crossflow-agent``: run the node agent, inspect what it would publish, serve a fake engine."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from crossflow_agent.calibrate import calibrate
from crossflow_agent.settings import AgentSettings, SourceKind, json_schema, load_settings
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.domain.models import NodeRole

AUTH_FLAGS = ("ca_file", "cert_file", "key_file", "server_name", "token_file")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Crossflow node agent: engine telemetry -> capacity model -> leases."""


_D = AgentSettings.model_construct()
"""The settings' defaults, for the flags' help (not validated: no file or environment read).
A flag not given leaves its setting to the --config file, CROSSFLOW_AGENT_* or this default."""


def _settings_options(f: Any) -> Any:
    """The flags ``run`` and ``inspect`` share; each overrides its setting when given."""
    options = [
        click.option(
            "--config",
            "config_file",
            type=click.Path(path_type=Path, dir_okay=False),
            help="YAML settings file (below env CROSSFLOW_AGENT_* and flags).",
        ),
        click.option("--node-id", help="This node's id."),
        click.option(
            "--role",
            type=click.Choice([r.value for r in NodeRole]),
            help=f"Decode nodes lend; prefill nodes report pool load. [{_D.role.value}]",
        ),
        click.option("--pool", help=f"Prefill pool this node belongs to or feeds. [{_D.pool}]"),
        click.option(
            "--source",
            type=click.Choice([s.value for s in SourceKind]),
            help=f"Engine kind behind --metrics-url. [{_D.source.value}]",
        ),
        click.option(
            "--metrics-url", help=f"The engine's Prometheus /metrics URL. [{_D.metrics_url}]"
        ),
        click.option(
            "--model",
            type=click.Choice(sorted(MODEL_PRESETS)),
            help=f"Model preset of the capacity model. [{_D.model}]",
        ),
        click.option(
            "--node",
            "node_preset",
            type=click.Choice(sorted(NODE_PRESETS)),
            help=f"Hardware preset (or --profile). [{_D.node_preset}]",
        ),
        click.option(
            "--profile",
            "profile_file",
            type=click.Path(path_type=Path, dir_okay=False),
            help="Calibrated NodeProfile JSON file (version 1).",
        ),
        click.option(
            "--slo-ms", "itl_slo_ms", type=float, help=f"Decode ITL SLO. [{_D.lease.itl_slo_ms:g}]"
        ),
        click.option(
            "--horizon-ms",
            type=int,
            help=f"Borrow horizon until a broker's Welcome sends its own. [{_D.lease.horizon_ms}]",
        ),
        click.option("--period-ms", type=int, help=f"Lease period. [{_D.period_ms}]"),
        click.option(
            "--calibrate/--no-calibrate",
            "calibrate",
            default=None,
            help="Fit the step-time constants to the engine's own telemetry, starting from"
            " --node/--profile (the prior); --no-calibrate prices every lease with the prior."
            f" [{'calibrate' if _D.calibration.enabled else 'no-calibrate'}]",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _load(config_file: Path | None, flags: dict[str, Any]) -> AgentSettings:
    lease = {k: flags.pop(k) for k in ("itl_slo_ms", "horizon_ms") if k in flags}
    calibrate = flags.pop("calibrate", None)
    overrides = {k: v for k, v in flags.items() if v is not None and v != ()}
    lease = {k: v for k, v in lease.items() if v is not None}
    if lease:
        overrides["lease"] = lease
    if calibrate is not None:
        overrides["calibration"] = {"enabled": calibrate}
    try:
        return load_settings(config_file, overrides)
    except ConfigError as exc:
        raise click.UsageError(_where(exc)) from None


def _where(exc: ConfigError) -> str:
    """The refused setting with the flag and environment variable that set it, so the message
    names what the operator typed (``--slo-ms``, not only ``lease.itl_slo_ms``)."""
    if not exc.field or exc.field in ("config", "settings"):
        return str(exc)
    params = click.get_current_context().command.params
    flags = {p.name: p.opts[0] for p in params if isinstance(p, click.Option) and p.name}
    head, _, tail = exc.field.partition(".")
    flag = flags.get(tail if head in ("lease", "broker_auth") and tail else head)
    env = "CROSSFLOW_AGENT_" + exc.field.upper().replace(".", "__")
    via = f"{flag} or {env}" if flag else env
    return f"{exc.field} ({via}): {exc.message}"


@cli.command()
@_settings_options
@click.option(
    "--broker",
    "brokers",
    multiple=True,
    help=f"Broker host:port (repeatable). [{','.join(_D.brokers)}]",
)
@click.option("--ca-file", type=click.Path(dir_okay=False), help="CA bundle; turns TLS on.")
@click.option("--cert-file", type=click.Path(dir_okay=False), help="Node certificate (mTLS).")
@click.option("--key-file", type=click.Path(dir_okay=False), help="Node key (mTLS).")
@click.option("--server-name", help="Name to check the broker's certificate against.")
@click.option("--token-file", type=click.Path(dir_okay=False), help="Bearer token file.")
@click.option(
    "--metrics-listen", help="host:port of the agent's own /metrics and /healthz. [none served]"
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    help=f"Log level: info says state changes, debug every decision. [{_D.log_level}]",
)
@click.option(
    "--log-json/--log-text",
    "log_json",
    default=None,
    help=f"JSON log lines, or console text. [{'json' if _D.log_json else 'text'}]",
)
def run(config_file: Path | None, **flags: Any) -> None:
    """Publish leases (decode) or pool load (prefill) to the brokers until SIGINT/SIGTERM."""
    from crossflow_agent.runner import run_agent
    from crossflow_ctl.observability import setup_logging

    flags["brokers"] = list(flags["brokers"]) or None
    auth = {k: flags.pop(k) for k in AUTH_FLAGS}
    if any(v is not None for v in auth.values()):
        flags["broker_auth"] = {k: v for k, v in auth.items() if v is not None}
    settings = _load(config_file, flags)
    setup_logging(json=settings.log_json, level=settings.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape is noise
    try:
        asyncio.run(run_agent(settings))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


@cli.command()
@_settings_options
@click.option(
    "--window-ms",
    type=click.IntRange(0, 60_000),
    default=1000,
    show_default=True,
    help="Scrape twice this far apart, so rates and ITL quantiles have a window.",
)
@click.option(
    "--calibration-windows",
    type=click.IntRange(0, 1000),
    default=0,
    show_default=True,
    help="First watch this many --window-ms windows, fit the step-time constants to them, show"
    " them beside the prior's and price the lease with the fit (when accepted).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def inspect(
    config_file: Path | None,
    window_ms: int,
    calibration_windows: int,
    as_json: bool,
    **flags: Any,
) -> None:
    """Scrape once; print the snapshot, step-time predictions and the lease, arithmetic shown.

    Exits 1 when the scrape failed (the zero lease the agent would publish is still shown)."""
    from crossflow_agent.inspect import inspect_once, render_text

    if flags.get("node_id") is None:
        flags["node_id"] = "inspect"
    settings = _load(config_file, flags)
    try:
        report = asyncio.run(
            inspect_once(
                settings, window_s=window_ms / 1000, calibration_windows=calibration_windows
            )
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo(render_text(report))
    if report["failure"]:  # the zero lease is shown; the exit says the setup does not work
        sys.exit(1)


@cli.command("fake-engine")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="0 picks a free port (printed, and written to --port-file).",
)
@click.option(
    "--port-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the bound port here once serving.",
)
@click.option(
    "--protocol",
    type=click.Choice(["sglang", "vllm"]),
    default="sglang",
    show_default=True,
    help="Which engine to be: its metrics format and its P/D protocol.",
)
@click.option(
    "--pd-role",
    type=click.Choice(["prefill", "decode", "both"]),
    default="both",
    show_default=True,
    help="P/D role: prefill exports KV, decode imports it, both does either.",
)
@click.option(
    "--bootstrap-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="SGLang prefill: the bootstrap server's port (0: a free one, printed).",
)
@click.option(
    "--advertise-host",
    help="Host decode engines reach this one at (vLLM remote_host). [--host, or 127.0.0.1]",
)
@click.option(
    "--served-model-name",
    default="fake-model",
    show_default=True,
    help="The model id the OpenAI API serves (GET /v1/models).",
)
@click.option(
    "--max-model-len", type=click.IntRange(2, 1_000_000), default=32_768, show_default=True
)
@click.option(
    "--model", type=click.Choice(sorted(MODEL_PRESETS)), default="gpt-oss-120b", show_default=True
)
@click.option(
    "--node",
    "node_preset",
    type=click.Choice(sorted(NODE_PRESETS)),
    default="h200",
    show_default=True,
)
@click.option(
    "--model-name", default="synthetic", show_default=True, help="model_name label on the metrics."
)
@click.option("--kv-total-tokens", type=int, default=400_000, show_default=True)
@click.option("--max-running", type=int, default=256, show_default=True)
@click.option("--chunk-tokens", type=int, default=2048, show_default=True)
@click.option(
    "--kv-transfer-gb-s",
    type=float,
    default=0.0,
    show_default=True,
    help="KV transfer speed into this engine (0: transfers take no time).",
)
@click.option(
    "--background-rps",
    type=float,
    default=0.0,
    show_default=True,
    help="Steady background arrivals per second.",
)
@click.option("--background-prompt-tokens", type=int, default=2000, show_default=True)
@click.option("--background-cached-tokens", type=int, default=0, show_default=True)
@click.option("--background-output-tokens", type=int, default=300, show_default=True)
@click.option(
    "--itl-budget-ms",
    type=float,
    default=None,
    help="A decode engine that lends: size each prefill chunk so the step stays within this "
    "(the agent's itl_slo_ms x slo_margin). Default: --chunk-tokens a step (a prefill server).",
)
@click.option(
    "--itl-buckets-ms",
    default=None,
    metavar="MS,MS,...",
    help="Upper bounds of the ITL histogram in ms (SGLang's --bucket-inter-token-latency); "
    "default SGLang's. Give one at the agent's SLO: p99 is read inside a bucket.",
)
def fake_engine(
    host: str,
    port: int,
    port_file: Path | None,
    protocol: str,
    pd_role: str,
    bootstrap_port: int,
    advertise_host: str | None,
    served_model_name: str,
    max_model_len: int,
    model: str,
    node_preset: str,
    model_name: str,
    kv_total_tokens: int,
    max_running: int,
    chunk_tokens: int,
    kv_transfer_gb_s: float,
    background_rps: float,
    background_prompt_tokens: int,
    background_cached_tokens: int,
    background_output_tokens: int,
    itl_budget_ms: float | None,
    itl_buckets_ms: str | None,
) -> None:
    """Serve a synthetic engine as vLLM or SGLang would: the OpenAI API, P/D, /metrics.

    Also POST /requests (load with no client) and POST /control (slowdown, down, fail_next).
    The contract is in crossflow_agent.fake_engine's docstring."""
    from pydantic import ValidationError

    from crossflow_agent.fake_engine import FakeEngineServer
    from crossflow_agent.sources.synthetic import EngineRequest, EngineScript, SyntheticEngine
    from crossflow_ctl.observability import setup_logging

    extra: dict[str, Any] = {}
    if itl_buckets_ms is not None:
        try:
            extra["itl_buckets_s"] = tuple(float(x) / 1000.0 for x in itl_buckets_ms.split(","))
        except ValueError:
            raise click.UsageError(f"--itl-buckets-ms: not numbers: {itl_buckets_ms!r}") from None
    try:
        script = EngineScript(
            kv_total_tokens=kv_total_tokens,
            max_running=max_running,
            chunk_tokens=chunk_tokens,
            kv_transfer_gb_s=kv_transfer_gb_s,
            background_rps=background_rps,
            background=EngineRequest(
                prompt_tokens=background_prompt_tokens,
                cached_tokens=background_cached_tokens,
                output_tokens=background_output_tokens,
            ),
            itl_budget_ms=itl_budget_ms,
            **extra,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        raise click.UsageError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    setup_logging(json=True, level="warning")
    engine = SyntheticEngine(
        MODEL_PRESETS[model], NODE_PRESETS[node_preset], script, model_name=model_name
    )
    server = FakeEngineServer(
        engine,
        host,
        port,
        protocol=protocol,
        pd_role=pd_role,
        model=served_model_name,
        max_model_len=max_model_len,
        bootstrap_port=bootstrap_port,
        advertise_host=advertise_host,
    )
    asyncio.run(_serve_fake_engine(server, port_file))


async def _serve_fake_engine(server: Any, port_file: Path | None) -> None:
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except OSError as exc:
        raise click.UsageError(f"cannot listen: {exc}") from None
    try:
        if port_file is not None:
            tmp = port_file.with_name(port_file.name + ".tmp")
            tmp.write_text(f"{server.port}\n")
            tmp.replace(port_file)
        click.echo(f"fake engine serving {server.url}/metrics", file=sys.stdout)
        if server.bootstrap_port is not None:
            click.echo(f"fake engine bootstrap port {server.bootstrap_port}", file=sys.stdout)
        sys.stdout.flush()
        await stop.wait()
    finally:
        await server.close()


@cli.command()
def schema() -> None:
    """Print the JSON schema of the agent's settings (for the Helm chart)."""
    click.echo(json.dumps(json_schema(), indent=2))


# Further commands register below, one line each (``calibrate`` lives in calibrate.py).
cli.add_command(calibrate)


def main() -> None:
    cli()
