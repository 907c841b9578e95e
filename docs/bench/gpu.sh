#!/usr/bin/env bash
# ticketq on one GPU, in under 8 minutes: the engine tests on CUDA, `ticketq bench` (sequential,
# sorted, ticketq in float32 and in bfloat16) on the full-size stand-in, and a short load test.
# Every figure goes to $OUT (default out/gpu): bench JSON/Markdown, the load test's report, and
# gpu.txt (nvidia-smi, torch and CUDA versions, each step's exit status).
#
#   bash docs/bench/gpu.sh            # needs a CUDA build of torch in .venv (or PYTHON=...)
#
# Each step runs under its own time limit and a failed step does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-out/gpu}
MODEL=${TICKETQ_MODEL:-models/qwen2.5-0.5b-standin}
mkdir -p "$OUT"
log="$OUT/gpu.txt"
: >"$log"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA device visible to $PY (torch without CUDA, or no GPU): nothing to run" | tee -a "$log"
  exit 2
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  lscpu | grep -m1 'Model name'; } >>"$log"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - started)) s" | tee -a "$log"
}

[ -f "$MODEL/config.json" ] || step standin 120 "$PY" -m ticketq_cli.cli standin --out "$MODEL"
export TICKETQ_MODEL="$MODEL" TICKETQ_DEVICE=cuda
step engine-tests 120 env TICKETQ_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_engine.py tests/unit/test_labels.py -m "not integration"
step bench-float32 150 "$PY" -m ticketq_cli.cli bench --dtype float32 --tickets 600 \
  --modes sequential,sorted,ticketq --json "$OUT/bench-float32.json" --markdown "$OUT/bench-float32.md"
step bench-bfloat16 120 "$PY" -m ticketq_cli.cli bench --dtype bfloat16 --tickets 600 \
  --modes sequential,ticketq --json "$OUT/bench-bfloat16.json" --markdown "$OUT/bench-bfloat16.md"
if redis-cli ping >/dev/null 2>&1 || { redis-server --daemonize yes --port 6379 --save "" >/dev/null 2>&1 && sleep 1; }; then
  step loadtest 120 "$PY" -m ticketq_cli.cli loadtest --rates 0.5,1.0 --duration 15 \
    --json "$OUT/loadtest.json" --markdown "$OUT/loadtest.md"
else
  echo "loadtest: skipped (no redis-server)" | tee -a "$log"
fi
cat "$log"
