#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA GPU and its own torch (no network): the wheels that
# scripts/gpu_wheels.sh put in .whl/ are installed beside that torch (scripts/gpu_bringup.sh), then the tests marked
# `gpu` (tests/gpu) run, then benchmarks/gpu_vs_trl.py (ours against TRL's GRPOTrainer on the same GPU).
# Logs and results go to $OUT (default ./gpu_out). Each stage has its own time limit, and a failing stage does not
# stop the next one: the exit status says whether all passed.
#   here:  scripts/gpu_wheels.sh          there: scripts/gpu_checks.sh [TEST_S BENCH_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
TEST_S="${1:-270}"
BENCH_S="${2:-240}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# shellcheck source=/dev/null
source scripts/gpu_bringup.sh > "$OUT/bringup.log" 2>&1 || { cat "$OUT/bringup.log"; exit 1; }
cat "$OUT/bringup.log"

status=0
echo "== tests/gpu ($TEST_S s at most)"
timeout -k 10 "$TEST_S" python3 -m pytest -p no:cacheprovider -n 0 -q -s -rA tests/gpu/test_cuda.py \
    --junitxml "$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1 || status=1
grep -E "^\[gpu\]|passed|failed|error|skipped" "$OUT/gpu_tests.log" | tail -80

echo "== benchmarks/gpu_vs_trl.py ($BENCH_S s at most)"
# --budget_s: a trainer that would not finish in time is skipped (named in the log) rather than cut off
timeout -k 10 "$BENCH_S" python3 benchmarks/gpu_vs_trl.py --json "$OUT/gpu_vs_trl.json" --budget_s $((BENCH_S - 15)) \
    > "$OUT/gpu_vs_trl.log" 2>&1 || status=1
tail -40 "$OUT/gpu_vs_trl.log"
exit $status
