"""Calibrated node profiles on disk.

Format (version 1), written by ``crossflow-agent calibrate`` and read by ``--profile FILE``::

    {
      "version": 1,
      "profile": {"name": "...", "flops_per_s": ..., "hbm_bytes_per_s": ...,
                  "step_overhead_s": ..., "overlap_penalty": ..., "network_bytes_per_s": ...},
      ...   # anything else (fit residuals, device name, date) is kept by the writer, ignored here
    }

``profile`` holds exactly the fields of :class:`crossflow_ctl.domain.capacity.NodeProfile`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from crossflow_ctl.domain.capacity import NodeProfile
from crossflow_ctl.domain.errors import ConfigError

PROFILE_FORMAT_VERSION = 1


def load_profile(path: Path | str) -> NodeProfile:
    """Read a version-1 profile file; ConfigError (field ``profile_file``) says what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read profile {path}: {exc}", field="profile_file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"profile {path} must hold a JSON object", field="profile_file")
    version = data.get("version")
    if version != PROFILE_FORMAT_VERSION:
        raise ConfigError(
            f"profile {path} has version {version!r}; this agent reads version"
            f" {PROFILE_FORMAT_VERSION}",
            field="profile_file",
        )
    try:
        return NodeProfile.model_validate(data.get("profile"))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "profile"
        raise ConfigError(
            f"profile {path}: profile.{where}: {err['msg']}", field="profile_file"
        ) from None


def profile_document(profile: NodeProfile, **extra: Any) -> dict[str, Any]:
    """The version-1 document for ``profile`` (writers add their own keys in ``extra``)."""
    return {"version": PROFILE_FORMAT_VERSION, "profile": profile.model_dump(), **extra}


def save_profile(path: Path | str, profile: NodeProfile, **extra: Any) -> None:
    Path(path).write_text(json.dumps(profile_document(profile, **extra), indent=2) + "\n")
