"""What every crossflowctl command shares: resolved settings, the broker session, error handling."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.shell_completion import CompletionItem

from crossflow_ctl.cli.config import (
    CREDENTIAL_FIELDS,
    Context,
    CtlConfig,
    CtlSettings,
    load_config,
)
from crossflow_ctl.cli.exit_codes import CliError, ExitCode, exit_code_for, one_line
from crossflow_ctl.cli.output import FORMATS, OutputFormat
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.settings_sources import host_port

if TYPE_CHECKING:  # the client is imported by the commands that call the broker, not by --help
    from crossflow_ctl.cli.api import BrokerSession, Target

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class CtlState:
    """Resolved once per invocation: flags > environment (CROSSFLOWCTL_*) > config file."""

    settings: CtlSettings
    config_path: Path
    server_override: str | None
    context_override: str | None
    credential_flags: dict[str, Any] = field(default_factory=dict)
    """``--ca-file`` and friends given on the command line (they win over the context)."""
    config_named: bool = False
    """``--config`` was given: a missing file is then an error for commands that use it."""

    @classmethod
    def create(
        cls,
        *,
        server: str | None,
        context: str | None,
        config_path: str | None,
        **credential_flags: Any,
    ) -> CtlState:
        settings = CtlSettings()
        path = Path(config_path).expanduser() if config_path else settings.config_path()
        return cls(
            settings=settings,
            config_path=path,
            server_override=server or settings.server,
            context_override=context or settings.context,
            credential_flags=credential_flags,
            config_named=bool(config_path),
        )

    def load(self) -> CtlConfig:
        return load_config(self.config_path)

    def context(self) -> tuple[str, Context]:
        if self.config_named and not self.config_path.exists():
            # A mistyped --config would otherwise talk to the default broker, unseen.
            raise ConfigError(
                f"no such file {self.config_path} (`crossflowctl --config {self.config_path} "
                "config set-context NAME --server HOST:PORT` creates it)",
                field="--config",
            )
        return self.load().context(self.context_override)

    def target(self) -> Target:
        _, ctx = self.context()
        server = self.server_override or ctx.server
        try:
            host_port(server)
        except ValueError as exc:
            # gRPC would quietly default a bare host to port 443
            host, sep, _ = server.rpartition(":")  # a bad port is replaced, a missing one added
            hint = f"{host or '127.0.0.1'}:50051" if sep else f"{server}:50051"
            raise CliError(f"--server {exc} (e.g. {hint})", ExitCode.USAGE) from None
        from crossflow_ctl.cli.api import Target

        return Target(
            server=server,
            credentials=ctx.credentials(**self.credential_flags),
            timeout_s=ctx.defaults.timeout_s,
        )

    def output(self, chosen: str | None) -> OutputFormat:
        if chosen:
            return OutputFormat(chosen)
        return self.context()[1].defaults.output

    def pool(self, chosen: str | None) -> str:
        return chosen or self.context()[1].defaults.pool

    def session(self) -> BrokerSession:
        from crossflow_ctl.cli.api import BrokerSession

        return BrokerSession(self.target())


def output_option() -> Callable[[F], F]:
    """``-o/--output table|wide|json|yaml``: the same flag on every command."""
    return click.option(
        "-o",
        "--output",
        type=click.Choice(FORMATS),
        default=None,
        help="Output format: table, wide, json or yaml (default: the context's, else table).",
    )


def state(ctx: click.Context) -> CtlState:
    obj = ctx.find_root().obj
    assert isinstance(obj, CtlState)
    return obj


def complete_node(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Shell completion of node names: asks the broker, quietly gives nothing on any failure."""
    params = ctx.find_root().params
    try:
        st = CtlState.create(
            server=params.get("server"),
            context=params.get("context_name"),
            config_path=params.get("config_path"),
            **{k: params.get(k) for k in CREDENTIAL_FIELDS},
        )

        async def names() -> list[str]:
            async with st.session() as session:
                return [n.state.info.node_id for n in await session.list_nodes(None, "")]

        found = asyncio.run(asyncio.wait_for(names(), timeout=1.0))
    except Exception:
        return []
    return [CompletionItem(n) for n in found if n.startswith(incomplete)]


def complete_context(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Shell completion of context names from the config file; nothing on any failure."""
    path = ctx.find_root().params.get("config_path")
    try:
        cfg = load_config(Path(path).expanduser() if path else CtlSettings().config_path())
    except Exception:
        return []
    return [CompletionItem(n) for n in cfg.contexts if n.startswith(incomplete)]


def run(coro: Awaitable[T]) -> T:
    async def _main() -> T:
        return await coro

    return asyncio.run(_main())


def run_cli(group: click.Group, prog_name: str) -> int:
    """Run a click group; turn every failure into one stderr line and a documented exit code."""
    try:
        # Outside standalone mode click returns an Exit's code (and a command's return value)
        result = group.main(prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        return 130
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:
        # a group run without a command: its help, as click prints it (not as a one-line error)
        click.echo(exc.format_message(), err=True)
        return ExitCode.USAGE
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx else prog_name
        click.echo(f"error: {exc.format_message()} (see '{where} --help')", err=True)
        return ExitCode.USAGE
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return ExitCode.ERROR
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return 130
    except Exception as exc:
        click.echo(one_line(exc), err=True)
        return int(exit_code_for(exc))
    if isinstance(result, int) and not isinstance(result, bool):
        return result  # click.exceptions.Exit(code) raised by a command
    return ExitCode.OK
