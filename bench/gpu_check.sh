#!/usr/bin/env bash
# On a CUDA machine, from anywhere: the GPU-marked raygpt.ops tests, then the ops benchmark.
# Prints the pytest summary, then the benchmark's table last. Extra arguments go to the
# benchmark (e.g. --sweep). Exit status: non-zero if the tests or the benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
LOG=${OUT:-/tmp}

$PY -m pytest tests/ops -q -m gpu -p no:cacheprovider >"$LOG/ops_gpu_tests.log" 2>&1
tests_rc=$?
grep -E "^(FAILED|ERROR)" "$LOG/ops_gpu_tests.log"
echo "gpu tests (exit $tests_rc): $(tail -n 1 "$LOG/ops_gpu_tests.log")   log: $LOG/ops_gpu_tests.log"

$PY bench/ops.py "$@" 2>&1 | tee "$LOG/ops_bench.log"
bench_rc=${PIPESTATUS[0]}

[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
