"""``crossflow-broker serve [--config FILE] [--listen ADDR] [--redis-url URL [--redis-cluster] |
--embedded-store] [--workers N]`` and ``crossflow-broker hash-token ROLE/NAME`` (a token-file
line for the token on stdin).

The entry point: the only place that configures logging and installs signal handlers (which
only set the stop event). Prints ``listening on HOST:PORT`` once serving, so a supervisor or a
test can read the bound port when ``--listen`` asks for port 0. A refused setting exits 2 (a
usage error) naming the field.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import click

from crossflow_ctl.broker.gc_policy import tune_for_fleet
from crossflow_ctl.broker.server import BrokerServer, make_store
from crossflow_ctl.broker.workers import METRICS_ON, supervise, worker_count
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.observability import (
    BrokerMetrics,
    parse_listen,
    setup_logging,
    setup_metrics,
    setup_tracing,
)
from crossflow_ctl.security import hash_token
from crossflow_ctl.security.identity import parse_identity_uri
from crossflow_ctl.service.config import BrokerSettings, load_settings

DEFAULTS = BrokerSettings.model_construct()
"""The settings' defaults, for the flags' help (not validated: no file or environment read)."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Crossflow broker: admission over the decode servers' leases."""


def overrides_from(
    *,
    listen: str | None,
    redis_url: str | None,
    embedded_store: bool,
    redis_namespace: str | None,
    redis_cluster: bool = False,
    insecure: bool = False,
    workers: int | None = None,
) -> dict[str, Any]:
    """The settings the flags given override (flags beat env, file and defaults)."""
    if redis_url and embedded_store:
        raise click.UsageError("--redis-url and --embedded-store are mutually exclusive")
    out: dict[str, Any] = {}
    if listen:
        out["listen"] = listen
    if redis_url:
        out["redis_url"] = redis_url
    if embedded_store:  # the settings file's Redis, a Cluster too, set aside for a local try
        out["redis_url"] = None
        out["redis_cluster"] = False
    if redis_namespace:
        out["redis_namespace"] = redis_namespace
    if redis_cluster:
        out["redis_cluster"] = True
    if insecure:
        out["auth"] = {"insecure": True}
    if workers is not None:
        out["workers"] = workers
    return out


@cli.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="YAML settings file (below env CROSSFLOW_* and flags).",
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    help=f"Where to serve gRPC (port 0 picks a free one); default {DEFAULTS.listen}. Beyond "
    "loopback callers must be authenticated (auth in --config), or --insecure given.",
)
@click.option(
    "--redis-url",
    metavar="URL",
    help="Shared Redis store (redis:// or rediss://); without it (or redis_url in the config "
    "or environment) the broker uses the embedded store.",
)
@click.option(
    "--embedded-store", is_flag=True, help="In-process store (one replica only, lost on exit)."
)
@click.option(
    "--redis-namespace", help=f"Key prefix in Redis; default {DEFAULTS.redis_namespace!r}."
)
@click.option("--redis-cluster", is_flag=True, help="--redis-url names a Redis Cluster node.")
@click.option(
    "--insecure",
    is_flag=True,
    help="Serve beyond loopback without authenticating callers (or with bearer tokens over "
    "plaintext): only when something else guards the port (auth.insecure).",
)
@click.option(
    "--workers",
    type=int,
    help="Worker processes sharing the port (SO_REUSEPORT), each a replica; default the "
    "pod's CPUs (cgroup quota), 1 on the embedded store.",
)
@click.option("--worker-index", type=int, hidden=True)
def serve(config_file: Path | None, worker_index: int | None, **flags: Any) -> None:
    """Run the broker (one replica per worker process) until SIGINT/SIGTERM."""
    try:
        settings = load_settings(config_file, overrides_from(**flags))
        count = worker_count(settings)
    except ConfigError as exc:
        raise click.UsageError(f"invalid configuration: {exc}") from None
    setup_logging(json=settings.log_json, level=settings.log_level)
    try:
        if worker_index is None and count > 1:
            sys.exit(asyncio.run(supervise(settings, count, worker_argv(config_file, flags))))
        asyncio.run(_serve(settings, worker_index))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def worker_argv(config_file: Path | None, flags: dict[str, Any]) -> list[str]:
    """``serve``'s flags as given, for its workers (:mod:`.workers` adds ``--listen`` and
    ``--worker-index``); ``--workers 1``: a worker never starts workers of its own."""
    argv = ["--config", str(config_file)] if config_file is not None else []
    for name in ("redis_url", "redis_namespace"):
        if flags.get(name):
            argv += [f"--{name.replace('_', '-')}", str(flags[name])]
    for name in ("embedded_store", "redis_cluster", "insecure"):
        if flags.get(name):
            argv.append(f"--{name.replace('_', '-')}")
    return [*argv, "--workers", "1"]


@cli.command("hash-token")
@click.argument("identity")
@click.option("--trust-domain", default="crossflow", show_default=True)
def hash_token_cmd(identity: str, trust_domain: str) -> None:
    """Read a bearer token on stdin; print its token-file line for IDENTITY (role/name).

    \b
    e.g.  head -c 32 /dev/urandom | base64 | tee router-a.token \\
            | crossflow-broker hash-token router/router-a >> tokens
    """
    who = parse_identity_uri(f"spiffe://{trust_domain}/{identity}", trust_domain)
    if who is None:
        raise click.UsageError(f"IDENTITY must be <node|router|admin>/<name>, got {identity!r}")
    token = sys.stdin.read().strip()  # click.get_text_stream is deprecated in click 8.5
    if not token or any(ch.isspace() for ch in token):
        raise click.UsageError("stdin must hold one token (no spaces)")
    click.echo(f"{hash_token(token)} {who.uri(trust_domain)}")


@cli.command()
def schema() -> None:
    """Print the JSON schema of the broker's settings (for the Helm chart)."""
    click.echo(json.dumps(BrokerSettings.model_json_schema(), indent=2))


async def _serve(settings: BrokerSettings, worker: int | None = None) -> None:
    """One replica; as worker ``worker`` of ``serve --workers N`` (:mod:`.workers`) it shares
    the port, names itself apart from its siblings, and serves its metrics on a loopback port
    of its own that it prints (the supervisor merges them on ``metrics_listen``)."""
    if worker is not None:
        changes: dict[str, Any] = {}
        if settings.broker_id:
            changes["broker_id"] = f"{settings.broker_id}-w{worker}"
        if settings.metrics_listen:
            changes["metrics_listen"] = "127.0.0.1:0"
        settings = settings.model_copy(update=changes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tracer = setup_tracing(settings.otlp_endpoint, service_name="crossflow-broker")
    endpoint = None
    if settings.metrics_listen:
        host, port = parse_listen(settings.metrics_listen)
        endpoint = await setup_metrics(
            host, port, service_name="crossflow-broker", announce=worker is None
        )
        if worker is not None:
            click.echo(f"{METRICS_ON}{endpoint.host}:{endpoint.port}")
    try:
        metrics = BrokerMetrics(endpoint.meter_provider) if endpoint else None
        server = BrokerServer(
            settings,
            make_store(settings),
            metrics=metrics,
            reuse_port=worker is not None,
            node_gauges=not worker,  # the store's node state: from one worker of the pod
        )
        await server.start()
        tune_for_fleet()
        host = settings.listen.rpartition(":")[0]
        click.echo(f"listening on {host}:{server.port}")
        try:
            await stop.wait()
        finally:
            await server.stop()
    finally:
        if endpoint is not None:
            await endpoint.close()
        if tracer is not None:
            await asyncio.to_thread(tracer.shutdown)  # flushes the last spans


def main() -> None:
    cli(prog_name="crossflow-broker")


if __name__ == "__main__":
    main()
