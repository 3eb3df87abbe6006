"""``crossflowctl``: the kubectl-style operator CLI (Admin and Admission APIs, simulator, planner).

Exit codes are documented in :mod:`crossflow_ctl.cli.exit_codes`; every error prints one line.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from crossflow_ctl.cli.common import CtlState, complete_context, run_cli

EPILOG = """\b
Exit codes: 0 ok, 1 error, 2 usage or invalid value, 3 not found,
4 broker unavailable, 5 timed out (drain --timeout),
6 refused: unauthenticated or not permitted."""

FILE = click.Path(dir_okay=False)


COMMANDS: dict[str, tuple[str, str]] = {
    "get": ("crossflow_ctl.cli.cmd_get", "List nodes, leases, reservations or pools."),
    "describe": ("crossflow_ctl.cli.cmd_node", "Show everything known about one resource."),
    "delete": ("crossflow_ctl.cli.cmd_node", "Remove a resource."),
    "cordon": ("crossflow_ctl.cli.cmd_node", "Stop lending from NAME: its lease counts..."),
    "uncordon": ("crossflow_ctl.cli.cmd_node", "Let NAME lend again."),
    "drain": ("crossflow_ctl.cli.cmd_node", "Cordon NAME (its lease counts as zero),..."),
    "admit": ("crossflow_ctl.cli.cmd_admit", "Ask the broker whether a request would..."),
    "policy": ("crossflow_ctl.cli.cmd_admit", "Show or change the admission policy shared..."),
    "config": ("crossflow_ctl.cli.cmd_config", "Contexts: which broker to talk to, with..."),
    "completion": ("crossflow_ctl.cli.cmd_config", "Print a shell completion script: eval..."),
    "sim": ("crossflow_ctl.cli.sim_cmds", "Replay traces through a simulated P/D..."),
    "plan": ("crossflow_ctl.cli.sim_cmds", "Size prefill and decode pools, static and..."),
}
SHORT_HELP_LIMIT = 45
"""Subcommand -> (module, short help). Modules are imported only when their command runs, so
``crossflowctl --help`` or ``get nodes`` do not pay for the simulator's imports; a test holds
each short help to the command's own docstring."""


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        command = getattr(importlib.import_module(entry[0]), cmd_name)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, short) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.option("--server", "-s", metavar="HOST:PORT", help="Broker address (overrides the context).")
@click.option(
    "--context",
    "context_name",
    metavar="NAME",
    shell_complete=complete_context,
    help="Context of the config file to use.",
)
@click.option(
    "--config",
    "config_path",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Config file (default $CROSSFLOWCTL_CONFIG or ~/.config/crossflow/config.yaml).",
)
@click.option("--ca-file", type=FILE, help="CA bundle of the broker; turns TLS on.")
@click.option("--cert-file", type=FILE, help="Client certificate (mutual TLS).")
@click.option("--key-file", type=FILE, help="Client key (mutual TLS).")
@click.option("--server-name", help="Name to check the broker's certificate against.")
@click.option("--token-file", type=FILE, help="Bearer token file.")
@click.pass_context
def cli(
    ctx: click.Context,
    /,
    server: str | None,
    context_name: str | None,
    config_path: str | None,
    **credential_flags: str | None,
) -> None:
    """Operate a Crossflow control plane."""
    ctx.obj = CtlState.create(
        server=server, context=context_name, config_path=config_path, **credential_flags
    )


def main() -> None:
    # gRPC's C core logs TLS handshake failures at info on stderr: every error is one line
    # (unless gRPC tracing is asked for: its output is logged at info too)
    if "GRPC_TRACE" not in os.environ:
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.exit(run_cli(cli, prog_name="crossflowctl"))
