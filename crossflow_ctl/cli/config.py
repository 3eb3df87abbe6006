"""crossflowctl's configuration: one settings model (env ``CROSSFLOWCTL_*``) and the contexts file.

The contexts file (``~/.config/crossflow/config.yaml``, or ``$CROSSFLOWCTL_CONFIG``) is kubeconfig
shaped::

    current-context: local
    contexts:
      local:
        server: 127.0.0.1:50051
        ca-file: null          # TLS: a CA bundle turns TLS on
        cert-file: null        # client certificate and key (mutual TLS)
        key-file: null
        server-name: null      # name to check the broker's certificate against
        token-file: null       # bearer token (authorization metadata on every call)
        defaults:              # default settings for commands run in this context
          output: table
          pool: default
          timeout-s: 5.0

``--server``, ``--context`` and the TLS flags (``--ca-file``, ``--cert-file``, ``--key-file``,
``--server-name``, ``--token-file``) on the command line win over the file; the file wins over
defaults. ``crossflow demo`` adds a ``demo`` context for its broker while it runs
(:class:`DemoContext`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from crossflow_ctl.cli.output import OutputFormat
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.settings_sources import host_port, read_error_text, refusal_text

DEFAULT_SERVER = "127.0.0.1:50051"
DEFAULT_CONTEXT = "default"
DEFAULT_CONFIG_PATH = Path("~/.config/crossflow/config.yaml")
CREDENTIAL_FIELDS = ("ca_file", "cert_file", "key_file", "server_name", "token_file")


class CtlSettings(BaseSettings):
    """Process settings: where the contexts file is, and overrides from the environment."""

    model_config = SettingsConfigDict(env_prefix="CROSSFLOWCTL_", extra="ignore")

    config: Path = DEFAULT_CONFIG_PATH
    server: str | None = None
    context: str | None = None

    def config_path(self) -> Path:
        return self.config.expanduser()


class _Kebab(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        alias_generator=lambda name: name.replace("_", "-"),
    )


class ContextDefaults(_Kebab):
    output: OutputFormat = OutputFormat.TABLE
    pool: Annotated[str, Field(min_length=1, max_length=64)] = "default"
    timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 5.0
    """Deadline of each call to the broker."""


class Context(_Kebab):
    server: Annotated[str, Field(min_length=1)] = DEFAULT_SERVER
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    token_file: Path | None = None
    defaults: ContextDefaults = ContextDefaults()

    @field_validator("server")
    @classmethod
    def _server_has_a_port(cls, value: str) -> str:
        return host_port(value)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    def credentials(self, **flags: Any) -> ClientCredentials:
        """This context's credentials, with the given (non-None) flags overriding them."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in CREDENTIAL_FIELDS}
        fields.update({k: v for k, v in flags.items() if v is not None})
        try:
            return ClientCredentials(**fields)
        except ValidationError as exc:
            text = refusal_text(exc.errors()[0])  # the validator's words, no "Value error, "
            for name in CREDENTIAL_FIELDS:  # the flags (and context keys) they are set by
                text = text.replace(name, "--" + name.replace("_", "-"))
            raise ConfigError(text, field="credentials") from None


class CtlConfig(_Kebab):
    current_context: str = DEFAULT_CONTEXT
    contexts: dict[str, Context] = Field(default_factory=lambda: {DEFAULT_CONTEXT: Context()})

    def context(self, name: str | None = None) -> tuple[str, Context]:
        chosen = name or self.current_context
        if chosen not in self.contexts:
            known = ", ".join(sorted(self.contexts)) or "none"
            raise ConfigError(f"no context named {chosen!r} (known: {known})", field="context")
        return chosen, self.contexts[chosen]

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


def load_config(path: Path) -> CtlConfig:
    """The contexts file, or the built-in default when it does not exist."""
    if not path.exists():
        return CtlConfig()
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {read_error_text(exc)}") from None
    try:
        return CtlConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{path}: {where}: {refusal_text(err)}") from None


def save_config(path: Path, config: CtlConfig) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(config.dump(), sort_keys=False))
    tmp.replace(path)


class DemoContext:
    """The context ``crossflow demo`` writes while it runs: its broker's address under ``name``
    (made the current context when the demo created the file: a first try needs no flag).

    :meth:`remove` takes it out again at exit, unless the context now says another server (a
    second demo's, or the user's), and deletes a file the demo created that holds nothing
    else. A demo killed outright leaves it behind: the next demo overwrites it."""

    def __init__(self, path: Path, name: str = "demo") -> None:
        self.path = path
        self.name = name
        self.server: str | None = None
        self.created = False
        self.previous_current: str | None = None

    def write(self, server: str) -> str:
        """Write the context for ``server``; the crossflowctl command that uses it."""
        self.created = not self.path.exists()
        config = load_config(self.path)
        config.contexts[self.name] = Context(server=server)
        if self.created:
            self.previous_current = config.current_context
            config.current_context = self.name
        save_config(self.path, config)
        self.server = server
        flag = "" if config.current_context == self.name else f" --context {self.name}"
        return f"crossflowctl{flag} get nodes -w"

    def remove(self) -> None:
        if self.server is None or not self.path.exists():
            return
        config = load_config(self.path)
        ours = config.contexts.get(self.name)
        if ours is None or ours.server != self.server:
            return  # another demo's by now, or the user's
        del config.contexts[self.name]
        if config.current_context == self.name:
            config.current_context = self.previous_current or DEFAULT_CONTEXT
        if self.created and config == CtlConfig():
            self.path.unlink()
        else:
            save_config(self.path, config)
        self.server = None
