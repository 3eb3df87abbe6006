"""``crossflow-gateway serve [--config FILE] [--listen ADDR] [--broker ADDR | --no-broker]
[--protocol vllm|sglang] [--prefill ID=URL ...] [--decode ID=URL ...] [--model NAME]``.

The entry point: the only place that configures logging and installs signal handlers (which
only set the stop event). Prints ``listening on HOST:PORT`` once serving. A refused setting
exits 2 naming the field.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import click

from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.gateway.app import serve as serve_app
from crossflow_ctl.gateway.settings import GatewaySettings, load_settings
from crossflow_ctl.observability import setup_logging, setup_tracing

DEFAULTS = GatewaySettings.model_construct()


def _engines(values: tuple[str, ...], option: str) -> list[dict[str, Any]]:
    out = []
    for value in values:
        node_id, sep, url = value.partition("=")
        if not sep:
            raise click.BadParameter(f"must be ID=URL, got {value!r}", param_hint=option)
        engine: dict[str, Any] = {"node_id": node_id, "url": url}
        base, _, boot = url.partition("#bootstrap=")
        if boot:
            engine.update(url=base, bootstrap_port=boot)
        out.append(engine)
    return out


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Crossflow gateway: OpenAI-compatible HTTP in front of a prefill/decode cluster."""


@cli.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="YAML settings file (below env CROSSFLOW_GATEWAY_* and flags).",
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    help=f"Where to serve HTTP (port 0 picks one); default {DEFAULTS.listen}.",
)
@click.option("--broker", metavar="HOST:PORT", help="The lease broker to ask Admit.")
@click.option("--no-broker", is_flag=True, help="No admission: a plain static P/D router.")
@click.option(
    "--protocol",
    type=click.Choice(["vllm", "sglang"]),
    help="The engines' P/D protocol for the normal path.",
)
@click.option("--model", help="Served model name (default: what the engines list).")
@click.option("--pool", help="The prefill pool's name at the broker.")
@click.option(
    "--prefill",
    multiple=True,
    metavar="ID=URL[#bootstrap=PORT]",
    help="A prefill engine (repeat); replaces the file's list.",
)
@click.option(
    "--decode",
    multiple=True,
    metavar="ID=URL",
    help="A decode engine, ID as its agent leases (repeat); replaces the file's list.",
)
@click.option("--max-hold-ms", type=int, help="Late binding: longest hold (0: none).")
def serve(config_file: Path | None, **flags: Any) -> None:
    """Serve until SIGINT/SIGTERM."""  # fmt: skip
    if flags.pop("no_broker"):
        if flags["broker"]:
            raise click.UsageError("--broker and --no-broker are mutually exclusive")
        flags["broker"] = None
        overrides: dict[str, Any] = {"broker": None}
    else:
        overrides = {}
    prefill, decode = flags.pop("prefill"), flags.pop("decode")
    if prefill:
        overrides["prefill"] = _engines(prefill, "--prefill")
    if decode:
        overrides["decode"] = _engines(decode, "--decode")
    overrides.update({k: v for k, v in flags.items() if v is not None})
    try:
        settings = load_settings(config_file, overrides)
    except ConfigError as exc:
        raise click.UsageError(f"invalid configuration: {exc}") from None
    setup_logging(json=settings.log_json, level=settings.log_level)
    try:
        setup_tracing(settings.otlp_endpoint, service_name="crossflow-gateway")
        asyncio.run(_main(settings))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


async def _main(settings: GatewaySettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve_app(settings, stop)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
