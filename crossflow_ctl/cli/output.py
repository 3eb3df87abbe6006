"""Output formats shared by every command: table (default), wide, json and yaml.

Commands build plain data (lists of dicts with JSON-able values) once; this module renders it.
Tables are kubectl-style: upper-case headers, columns padded with three spaces, no borders.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any

import yaml


class OutputFormat(StrEnum):
    TABLE = "table"
    WIDE = "wide"
    JSON = "json"
    YAML = "yaml"


FORMATS = [f.value for f in OutputFormat]


class Column:
    """One table column: header, the key it reads from a row, and whether only -o wide shows it."""

    def __init__(
        self,
        header: str,
        key: str,
        *,
        wide: bool = False,
        empty: str = "<none>",
        unset: Any = None,
        text: Callable[[Mapping[str, Any]], Any] | None = None,
    ) -> None:
        self.header = header
        self.key = key
        self.wide = wide
        self.empty = empty
        """What a missing value shows as (a mark column such as CURRENT shows blank)."""
        self.unset = unset
        """A value that means "not measured" in this column (an ITL of 0), shown as missing;
        json and yaml keep it as it is."""
        self.text = text
        """The cell's text made from the whole row (a version as ``v7``, an age as ``3m``), so
        that json and yaml carry the numbers and only the table the display."""

    def value(self, row: Mapping[str, Any]) -> Any:
        value = self.text(row) if self.text is not None else row.get(self.key)
        return None if self.unset is not None and value == self.unset else value


def cell(value: Any, empty: str = "<none>") -> str:
    if value is None or value == "":
        return empty
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items())) or "<none>"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "<none>"
    return str(value)


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], *, wide: bool) -> str:
    shown = [c for c in columns if wide or not c.wide]
    grid = [[c.header for c in shown]]
    grid += [[cell(c.value(row), c.empty) for c in shown] for row in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(shown))]
    lines = [
        "   ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in grid
    ]
    return "\n".join(lines)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str)


def to_yaml(data: Any) -> str:
    return yaml.safe_dump(json.loads(to_json(data)), sort_keys=False, default_flow_style=False)


def render_list(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column],
    fmt: OutputFormat,
    *,
    kind: str,
    empty: str = "No resources found.",
) -> str:
    """A list of resources in the chosen format (json/yaml wrap it kubectl-style)."""
    if fmt is OutputFormat.JSON:
        return to_json({"kind": kind, "items": list(rows)})
    if fmt is OutputFormat.YAML:
        return to_yaml({"kind": kind, "items": list(rows)}).rstrip("\n")
    if not rows:
        return empty
    return table(rows, columns, wide=fmt is OutputFormat.WIDE)


def render_object(data: Mapping[str, Any], fmt: OutputFormat, text: str) -> str:
    """One object: ``text`` (already human-formatted) for table/wide, else json/yaml."""
    if fmt is OutputFormat.JSON:
        return to_json(data)
    if fmt is OutputFormat.YAML:
        return to_yaml(data).rstrip("\n")
    return text


def key_values(pairs: Sequence[tuple[str, Any]], indent: int = 0) -> str:
    """Aligned ``Key:  value`` lines, as kubectl describe prints them."""
    if not pairs:
        return ""
    width = max(len(k) for k, _ in pairs) + 2
    pad = " " * indent
    return "\n".join(f"{pad}{(k + ':').ljust(width)}{cell(v)}" for k, v in pairs)
