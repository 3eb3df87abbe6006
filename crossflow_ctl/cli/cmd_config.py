"""``config view|get-contexts|use-context|set-context`` and ``completion bash|zsh|fish``."""

from __future__ import annotations

from pathlib import Path

import click
from click.shell_completion import get_completion_class
from pydantic import ValidationError

from crossflow_ctl.cli.common import complete_context, output_option, state
from crossflow_ctl.cli.config import Context, ContextDefaults, save_config
from crossflow_ctl.cli.exit_codes import CliError, ExitCode
from crossflow_ctl.cli.output import Column, OutputFormat, render_list, to_json, to_yaml
from crossflow_ctl.settings_sources import refusal_text

CONTEXT_COLUMNS = [
    # kubectl: * or blank; json and yaml say true or false
    Column("CURRENT", "current", empty="", text=lambda row: "*" if row["current"] else None),
    Column("NAME", "name"),
    Column("SERVER", "server"),
    Column("TLS", "tls"),
    Column("OUTPUT", "output"),
    Column("POOL", "pool"),
]


@click.group()
def config() -> None:
    """Contexts: which broker to talk to, with which TLS files and defaults."""


@config.command("view")
@output_option()
@click.pass_context
def config_view(ctx: click.Context, output: str | None) -> None:
    """Print the config file as crossflowctl reads it (defaults filled in)."""
    st = state(ctx)
    data = {"path": str(st.config_path), **st.load().dump()}
    fmt = OutputFormat(output) if output else OutputFormat.YAML
    click.echo(to_json(data) if fmt is OutputFormat.JSON else to_yaml(data).rstrip("\n"))


@config.command("get-contexts")
@output_option()
@click.pass_context
def config_get_contexts(ctx: click.Context, output: str | None) -> None:
    """List the contexts; * marks the current one."""
    st = state(ctx)
    cfg = st.load()
    current = st.context_override or cfg.current_context
    rows = [
        {
            "current": name == current,
            "name": name,
            "server": c.server,
            "tls": c.tls,
            "output": c.defaults.output.value,
            "pool": c.defaults.pool,
        }
        for name, c in sorted(cfg.contexts.items())
    ]
    fmt = OutputFormat(output) if output else OutputFormat.TABLE
    click.echo(render_list(rows, CONTEXT_COLUMNS, fmt, kind="ContextList"))


@config.command("use-context")
@click.argument("name", shell_complete=complete_context)
@click.pass_context
def config_use_context(ctx: click.Context, name: str) -> None:
    """Make NAME the current context."""
    st = state(ctx)
    cfg = st.load()
    if name not in cfg.contexts:
        known = ", ".join(sorted(cfg.contexts)) or "none"
        raise CliError(
            f"no context named {name!r} in {st.config_path} (known: {known})", ExitCode.NOT_FOUND
        )
    save_config(st.config_path, cfg.model_copy(update={"current_context": name}))
    click.echo(f'Switched to context "{name}".')


@config.command("set-context")
@click.argument("name", shell_complete=complete_context)
@click.option("--server", default=None, help="Broker address, host:port.")
@click.option(
    "--ca-file", type=click.Path(dir_okay=False), default=None, help="CA bundle; turns TLS on."
)
@click.option(
    "--cert-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Client certificate (mutual TLS).",
)
@click.option(
    "--key-file", type=click.Path(dir_okay=False), default=None, help="Client key (mutual TLS)."
)
@click.option("--server-name", default=None, help="Name to check the broker's certificate against.")
@click.option(
    "--token-file", type=click.Path(dir_okay=False), default=None, help="Bearer token file."
)
@click.option(
    "--default-output",
    type=click.Choice([f.value for f in OutputFormat]),
    default=None,
    help="Default -o for this context.",
)
@click.option("--pool", default=None, help="Default prefill pool.")
@click.option(
    "--timeout-s",
    type=click.FloatRange(min=0.001, max=3600.0),
    default=None,
    help="Deadline of each broker call, seconds.",
)
@click.option("--use", "use_it", is_flag=True, help="Also make it the current context.")
@click.pass_context
def config_set_context(
    ctx: click.Context,
    name: str,
    server: str | None,
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    server_name: str | None,
    token_file: str | None,
    default_output: str | None,
    pool: str | None,
    timeout_s: float | None,
    use_it: bool,
) -> None:
    """Create or change context NAME (only the given fields change)."""
    st = state(ctx)
    cfg = st.load()
    old = cfg.contexts.get(name, Context())
    defaults = old.defaults.model_dump()
    if default_output:
        defaults["output"] = default_output
    if pool:
        defaults["pool"] = pool
    if timeout_s is not None:
        defaults["timeout_s"] = timeout_s
    try:
        new = Context(
            server=server or old.server,
            ca_file=Path(ca_file) if ca_file else old.ca_file,
            cert_file=Path(cert_file) if cert_file else old.cert_file,
            key_file=Path(key_file) if key_file else old.key_file,
            server_name=server_name or old.server_name,
            token_file=Path(token_file) if token_file else old.token_file,
            defaults=ContextDefaults.model_validate(defaults),
        )
    except ValidationError as exc:  # said the model's field ("server: ..."), not the flag
        err = exc.errors()[0]
        flag = "--" + str(err["loc"][-1]).replace("_", "-") if err["loc"] else "set-context"
        raise CliError(f"{flag}: {refusal_text(err)}", ExitCode.USAGE) from None
    update: dict[str, object] = {"contexts": {**cfg.contexts, name: new}}
    if use_it or not st.config_path.exists():
        update["current_context"] = name
    save_config(st.config_path, cfg.model_copy(update=update))
    click.echo(f'Context "{name}" {"modified" if name in cfg.contexts else "created"}.')


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print a shell completion script: eval "$(crossflowctl completion bash)"."""
    root = ctx.find_root()
    prog = root.info_name or "crossflowctl"
    cls = get_completion_class(shell)
    if cls is None:  # pragma: no cover - click ships all three
        raise CliError(f"no completion for {shell}", ExitCode.USAGE)
    var = "_" + prog.replace("-", "_").upper() + "_COMPLETE"
    assert isinstance(root.command, click.Command)
    click.echo(cls(root.command, {}, prog, var).source())
