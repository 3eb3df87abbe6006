"""``crossflowctl``: the kubectl-style operator CLI (Admin and Admission APIs, simulator, planner).

Exit codes are documented in :mod:`crossflow_ctl.cli.exit_codes`; every error prints one line.
"""

from __future__ import annotations

import sys

import click

from crossflow_ctl.cli.cmd_admit import admit, policy
from crossflow_ctl.cli.cmd_config import completion, config
from crossflow_ctl.cli.cmd_get import get
from crossflow_ctl.cli.cmd_node import cordon, describe, drain, uncordon
from crossflow_ctl.cli.common import CtlState, run_cli
from crossflow_ctl.cli.sim_cmds import plan, sim

EPILOG = """\b
Exit codes: 0 ok, 1 error, 2 usage or invalid value, 3 not found,
4 broker unavailable, 5 timed out (drain --timeout),
6 refused: unauthenticated or not permitted."""

FILE = click.Path(dir_okay=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.option("--server", "-s", metavar="HOST:PORT", help="Broker address (overrides the context).")
@click.option(
    "--context", "context_name", metavar="NAME", help="Context of the config file to use."
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


cli.add_command(get)
cli.add_command(describe)
cli.add_command(cordon)
cli.add_command(uncordon)
cli.add_command(drain)
cli.add_command(admit)
cli.add_command(policy)
cli.add_command(config)
cli.add_command(completion)
cli.add_command(sim)
cli.add_command(plan)


def main() -> None:
    sys.exit(run_cli(cli, prog_name="crossflowctl"))
