"""Every ``Model.trusted(...)`` call in the packages names every field of its model, in order.

``Frozen.trusted`` skips validation and defaults: a call that leaves a field out falls back to
``model_construct``, which fills the default silently. So a field added to a model later would
be dropped by every call site that rebuilds it field by field (as a prompt's Demand once lost the
prefill server it was judged on). This test reads the calls from the source (AST) and holds each
one to the model's field list. Calls that spread ``**values`` (or that are made on ``cls``) are
not checked here: what they spread is known only when they run."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import crossflow_agent
import crossflow_ctl
from crossflow_ctl.domain.models import Frozen


def _frozen_models() -> dict[str, type[Frozen]]:
    found: dict[str, type[Frozen]] = {}
    for package in (crossflow_ctl, crossflow_agent):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if ".api." in info.name or info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, Frozen) and value is not Frozen:
                    found.setdefault(value.__name__, value)
    return found


def _calls() -> list[tuple[str, int, str, list[str]]]:
    out = []
    for package in (crossflow_ctl, crossflow_agent):
        for path in Path(package.__path__[0]).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "trusted"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id != "cls"
                    and all(k.arg is not None for k in node.keywords)
                ):
                    continue
                names = [k.arg for k in node.keywords if k.arg is not None]
                out.append((str(path), node.lineno, node.func.value.id, names))
    return out


def test_every_trusted_call_names_every_field_in_order() -> None:
    models = _frozen_models()
    calls = _calls()
    assert len(calls) >= 15, "the AST scan found the calls"
    wrong = [
        f"{path}:{line}: {name}.trusted gives {names}, fields are {list(models[name].model_fields)}"
        for path, line, name, names in calls
        if name in models and names != list(models[name].model_fields)
    ]
    assert not wrong, "\n".join(wrong)
