#!/usr/bin/env bash
# GPU check for the kernels (issue 6): one prepared command for a machine with a CUDA GPU.
#
#   bash kernels/gpu_check.sh [RESULTS_DIR]   # results go to $OUT if set, else RESULTS_DIR,
#                                             # else ./gpu-check-results
#   bash kernels/gpu_check.sh --fetch-wheels  # on a machine WITH a package index: download into
#                                             # .whl/ the pure-Python wheels a bare GPU image may
#                                             # lack (pydantic and its parts, for Python 3.12)
#
# Needs python3 with torch (CUDA build), triton and pytest; installs nothing from the network.
# The repository is used in place (PYTHONPATH), so no `pip install -e` is needed. If .whl/ exists
# its wheels are installed into a temporary folder first (no index, no dependencies).
#
# Steps, each with its own time limit (sized to end well inside 5 minutes on one H200; a normal
# run takes about two); every step's log and result lands in the results folder:
#   1. env.txt          python, torch, triton, GPU name and driver
#   2. tests.log        the kernel correctness tests COMPILED on the GPU (TRITON_INTERPRET=0)
#   3. bench.{log,json} each Triton kernel timed against its PyTorch reference; achieved GB/s
#                       and TFLOP/s as shares of the H200's 4.8 TB/s and ~990 dense bf16 TFLOP/s
#   4. timings.json     a small calibration sweep (crossflow_kernels.sweep, quick plan) and
#      profile.json     the least-squares fit of the capacity model's constants (needs pydantic;
#                       without it, run the printed `crossflow-agent calibrate --from-timings`
#                       elsewhere)
# Exit status: 0 when every step passed, 1 otherwise (later steps still run).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p .whl
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2
fi

RESULTS="${OUT:-${1:-$ROOT/gpu-check-results}}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$ROOT:$ROOT/agents:$ROOT/kernels${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/crossflow-site .whl/*.whl && export PYTHONPATH="/tmp/crossflow-site:$PYTHONPATH"
fi

failed=()
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $RESULTS/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  if timeout "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"; then
    echo "== $name passed in $((SECONDS - start))s"
  else
    echo "== $name FAILED after $((SECONDS - start))s"
    failed+=("$name")
  fi
}

{
  date -u
  "$PY" - <<'EOF'
import platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "sms", p.multi_processor_count, "memory_gib", round(p.total_memory / 2**30, 1))
EOF
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
} | tee "$RESULTS/env.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible: this check needs a GPU (the CPU tests run in CI instead)"
  exit 1
fi

# 2. kernel tests, compiled. A minimal ini and --confcutdir keep the repository's pytest settings
# and the Redis fixtures of tests/conftest.py (which need packages a GPU image lacks) out of it.
ini="$(mktemp -d)/pytest.ini"
printf '[pytest]\nmarkers =\n    kernels: needs torch and triton\n' >"$ini"
step tests 150 env TRITON_INTERPRET=0 "$PY" -m pytest -c "$ini" --rootdir "$ROOT" \
  --confcutdir "$ROOT/tests/kernels" -p no:cacheprovider -q -rs \
  tests/kernels/test_attention.py tests/kernels/test_gemm_and_mixed.py \
  tests/kernels/test_bench.py

# 3. Triton vs PyTorch reference, at serving-like shapes.
step bench 90 env TRITON_INTERPRET=0 "$PY" -m crossflow_kernels.bench --out "$RESULTS/bench.json"

# 4. a small calibration: measure (needs only torch/triton), then fit (needs pydantic).
step sweep 90 env TRITON_INTERPRET=0 "$PY" -m crossflow_kernels.sweep --device cuda \
  --sweep quick --out "$RESULTS/timings.json"
fit=("$PY" -c "from crossflow_agent.calibrate import calibrate; calibrate.main()" \
  --from-timings "$RESULTS/timings.json" --out "$RESULTS/profile.json" --name gpu-check)
if [[ -f "$RESULTS/timings.json" ]]; then
  if "$PY" -c "import pydantic" 2>/dev/null; then
    step fit 30 "${fit[@]}"
  else
    echo "== fit skipped: pydantic is missing here (bash kernels/gpu_check.sh --fetch-wheels"
    echo "   fetches it into .whl/). Fit the timings anywhere with:"
    echo "   crossflow-agent calibrate --from-timings timings.json --out profile.json"
  fi
fi

echo "== results in $RESULTS: $(cd "$RESULTS" && ls | tr '\n' ' ')"
if ((${#failed[@]})); then
  echo "== FAILED steps: ${failed[*]}"
  exit 1
fi
echo "== all steps passed"
