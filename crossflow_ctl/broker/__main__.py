"""``crossflow-broker serve [--config FILE] [--listen ADDR] [--redis-url URL | --embedded-store]``.

The entry point: the only place that configures structlog and installs signal handlers (which
only set the stop event). Prints ``listening on HOST:PORT`` once serving, so a supervisor or a
test can read the bound port when ``--listen`` asks for port 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

from crossflow_ctl.broker.config import BrokerSettings, load_settings
from crossflow_ctl.broker.server import BrokerServer, make_store
from crossflow_ctl.domain.errors import ConfigError


def configure_logging(settings: BrokerSettings) -> None:
    level = getattr(logging, settings.log_level.upper())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="crossflow-broker")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one broker replica")
    serve.add_argument("--config", type=Path, help="YAML settings file")
    serve.add_argument("--listen", help="host:port (port 0 picks a free one)")
    store = serve.add_mutually_exclusive_group()
    store.add_argument("--redis-url", help="shared Redis store")
    store.add_argument(
        "--embedded-store", action="store_true", help="in-process store (one replica only)"
    )
    serve.add_argument("--redis-namespace", help="key prefix in Redis")
    sub.add_parser("schema", help="print the settings JSON schema")
    return parser.parse_args(argv)


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.listen:
        out["listen"] = args.listen
    if args.redis_url:
        out["redis_url"] = args.redis_url
    if args.embedded_store:
        out["redis_url"] = None
    if args.redis_namespace:
        out["redis_namespace"] = args.redis_namespace
    return out


async def serve(settings: BrokerSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = BrokerServer(settings, make_store(settings))
    await server.start()
    host = settings.listen.rpartition(":")[0]
    print(f"listening on {host}:{server.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "schema":
        import json

        print(json.dumps(BrokerSettings.model_json_schema(), indent=2))
        return
    try:
        settings = load_settings(args.config, overrides_from(args))
    except ConfigError as exc:
        print(f"crossflow-broker: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(settings)
    try:
        asyncio.run(serve(settings))
    except ConfigError as exc:
        print(f"crossflow-broker: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
