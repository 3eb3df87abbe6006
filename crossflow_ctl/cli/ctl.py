"""``crossflowctl``: the kubectl-style operator CLI (Admin and Admission APIs, simulator)."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Operate a Crossflow control plane."""


def main() -> None:
    cli()
