#!/usr/bin/env bash
# kvjax checks for the GPU machine (jax, flax, chex, numpy, pytest preinstalled; no network).
#
# Each step runs under its own `timeout`, writes its log to $OUT_DIR/<step>.log, and the
# script carries on when a step fails; $OUT_DIR/status.tsv records every step's exit status
# (124 = timed out) and seconds. The whole script stays within 5 minutes: keep the sum of the
# limits below 300 s when appending steps (later issues: add a `step` line, trim a limit).
#
#   bash experiments/gpu_check.sh            # results in $OUT when set, else experiments/results/gpu_check
#
# Steps
#   env           versions and devices
#   kernel_tests  tests/test_pallas_decode.py compiled (KVJAX_INTERPRET=0: Triton, no interpreter)
#   kernel_bench  experiments/kernel_bench.py on the GPU shapes, target shapes first, with a time budget
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/experiments/results/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STATUS=$OUT_DIR/status.tsv
printf 'step\texit\tseconds\n' > "$STATUS"
FAILED=0

step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$STATUS"
  tail -n 25 "$OUT_DIR/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" -eq 0 ] || FAILED=1
}

step env 30 "$PY" -c "import jax, jaxlib, sys; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
step kernel_tests 140 env KVJAX_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider tests/test_pallas_decode.py \
  --junitxml="$OUT_DIR/kernel_tests.xml"
step kernel_bench 125 "$PY" -m experiments.kernel_bench --out "$OUT_DIR" --time-budget 100

echo "=== status"
cat "$STATUS"
exit $FAILED
