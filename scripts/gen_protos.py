"""Regenerate the Python code for proto/crossflow/v1 into crossflow_ctl/api/v1.

One script, one output package. Run it after any change to the .proto files:

    python scripts/gen_protos.py            # write the generated files
    python scripts/gen_protos.py --check    # exit 1 if the committed files differ

The generated modules import each other as ``crossflow.v1``; they are rewritten to
``crossflow_ctl.api.v1`` so that the package needs no top-level ``crossflow`` module.

Version stamps. protoc and grpcio-tools write their own release into the code as the runtime
floor it checks at import (``GRPC_GENERATED_VERSION``, ``ValidateProtobufRuntimeVersion``). Left as
they are, regenerating with a newer generator would silently raise the grpcio/protobuf a user must
have. So the stamps are rewritten to the floors ``pyproject.toml`` declares for ``grpcio`` and
``protobuf`` (one source), and ``--check`` compares everything else: a newer generator that writes
the same code passes, a changed ``.proto`` fails.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = ROOT / "crossflow_ctl" / "api" / "v1"
IMPORT_RE = re.compile(r"^from crossflow\.v1 import", re.MULTILINE)
GRPC_STAMP_RE = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE)
PROTOBUF_COMMENT_RE = re.compile(r"^# Protobuf Python Version: \S+$", re.MULTILINE)
PROTOBUF_CHECK_RE = re.compile(
    r"(ValidateProtobufRuntimeVersion\(\n\s*_runtime_version\.Domain\.PUBLIC,\n)"
    r"\s*\d+,\n\s*\d+,\n\s*\d+,\n"
)
INIT = '"""Generated gRPC code for crossflow.v1 (scripts/gen_protos.py). Do not edit."""\n'


def declared_floor(package: str) -> tuple[int, int, int]:
    """The ``>=`` floor pyproject.toml declares for ``package`` (major, minor, patch)."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(rf'"{re.escape(package)}>=(\d+)\.(\d+)\.(\d+)', text)
    if match is None:
        raise SystemExit(f"pyproject.toml declares no {package}>=X.Y.Z floor")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def stamp_floors(text: str) -> str:
    """Rewrite the generators' own version stamps to the declared runtime floors."""
    grpc = ".".join(map(str, declared_floor("grpcio")))
    major, minor, patch = declared_floor("protobuf")
    text = GRPC_STAMP_RE.sub(f"GRPC_GENERATED_VERSION = '{grpc}'", text)
    text = PROTOBUF_COMMENT_RE.sub(f"# Protobuf Python Version: {major}.{minor}.{patch}", text)
    return PROTOBUF_CHECK_RE.sub(
        lambda m: f"{m.group(1)}    {major},\n    {minor},\n    {patch},\n", text
    )


def generate(dest: Path) -> None:
    from grpc_tools import protoc  # dev dependency, imported only here

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={raw}",
            f"--grpc_python_out={raw}",
            f"--mypy_out={raw}",
            f"--mypy_grpc_out={raw}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        dest.mkdir(parents=True, exist_ok=True)
        for path in sorted((Path(raw) / "crossflow" / "v1").iterdir()):
            text = stamp_floors(IMPORT_RE.sub("from crossflow_ctl.api.v1 import", path.read_text()))
            (dest / path.name).write_text(text)
        (dest / "__init__.py").write_text(INIT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        if OUT_PACKAGE.exists():
            shutil.rmtree(OUT_PACKAGE)
        generate(OUT_PACKAGE)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "v1"
        generate(fresh)
        cmp = filecmp.dircmp(fresh, OUT_PACKAGE, ignore=["__pycache__"])
        drift = cmp.left_only + cmp.right_only + cmp.diff_files
        if drift:
            print(f"generated code is out of date: {sorted(drift)}", file=sys.stderr)
            print(
                "a .proto changed without regenerating: run python scripts/gen_protos.py "
                "(version stamps are not compared; they follow pyproject.toml's floors)",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
