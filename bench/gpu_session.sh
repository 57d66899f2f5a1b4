#!/usr/bin/env bash
# One call on the GPU machine: every GPU-marked test, the kernel benchmark, the throughput bench.
# Logs go to $OUT (or /tmp); the tables print last.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest tests -q -m gpu -p no:cacheprovider -x >"$LOG/gpu_tests.log" 2>&1
echo "gpu tests (exit $?): $(tail -n 1 "$LOG/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$LOG/gpu_tests.log" | head
timeout 120 python3 bench/ops.py >"$LOG/ops_bench.log" 2>&1; echo "ops bench exit $?"
timeout 300 python3 bench/throughput.py ${THROUGHPUT_ARGS:-} >"$LOG/throughput.log" 2>&1; echo "throughput exit $?"
echo "=== ops bench ==="; tail -n 25 "$LOG/ops_bench.log"
echo "=== throughput ==="; tail -n 14 "$LOG/throughput.log"
