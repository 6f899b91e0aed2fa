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
#   kernel_tests  tests/attention/test_pallas_decode.py compiled (KVJAX_INTERPRET=0: Triton, no interpreter)
#   kernel_bench  experiments/kernel_bench.py on the GPU shapes, target shapes first, with a time budget
#   memory_*      kvjax memory on a small model and on Llama-3-8B-shaped random weights (issue 7)
#   decode_sweep  the engine on Llama-3-8B-shaped random bf16 weights: bf16 vs fp8 KV, pallas vs reference (issue 8)
#   allocator_step one decode step's block allocation for 64 and 512 requests (issue 15: <= 100 us at 512)
#   offload_bandwidth host <-> device GB/s of the host tier's block loads and stores vs block size (issue 16)
#   long_context  the ragged prefill kernel: compiled temporaries (8K-128K) and time vs tiled / old, checked
#                 against the tiled form (issue 40)
#   passkey_32k   a 32K passkey prompt through the engine on random weights (preset:tiny-long): the memory bound
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

step env 15 "$PY" -c "import jax, jaxlib, sys; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
step kernel_tests 65 env KVJAX_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider tests/attention/test_pallas_decode.py \
  --junitxml="$OUT_DIR/kernel_tests.xml"
step kernel_bench 45 "$PY" -m kvjax.experiments.kernel_bench --out "$OUT_DIR" --time-budget 30

# ---- memory (issue 7) ------------------------------------------------------------------------
# `kvjax memory` on a small model and on Llama-3-8B's shapes with random weights (nothing
# downloaded): profiled non-KV bytes, the budget → blocks, and KV pages measured / analytic,
# which must be within 0.1%. JSON and table per model in $OUT_DIR/memory_<label>.{json,txt}.
# CPU smoke run (no bytes_limit there, so give a size):
#   KVJAX_MEMORY_BIG=preset:tiny KVJAX_MEMORY_ARGS="--device-memory-gib 1" bash experiments/gpu_check.sh
memory_check() {  # memory_check LABEL MODEL TOKENS
  "$PY" -m kvjax.commands.main memory --model "$2" --max-num-batched-tokens "$3" $KVJAX_MEMORY_ARGS --json \
    > "$OUT_DIR/memory_$1.json" || return
  "$PY" -c 'import json, sys
from kvjax.commands.memory import render
r = json.load(open(sys.argv[1]))
ratio = r["kv_measured_over_analytic"]
print(render(r))
print("KV measured / analytic %.6f (target within 0.1%%); profiled non-KV %d B" % (ratio, r["non_kv_bytes"]))
sys.exit(0 if abs(ratio - 1) <= 1e-3 else 1)' "$OUT_DIR/memory_$1.json" > "$OUT_DIR/memory_$1.txt"
  local rc=$?
  cat "$OUT_DIR/memory_$1.txt"
  return $rc
}
export -f memory_check
KVJAX_MEMORY_ARGS=${KVJAX_MEMORY_ARGS:-}
export PY OUT_DIR KVJAX_MEMORY_ARGS
MEMORY_SMALL=${KVJAX_MEMORY_SMALL:-small-gqa}
[ "$MEMORY_SMALL" != small-gqa ] || [ -d models/checkpoints/small-gqa ] || MEMORY_SMALL=preset:tiny
step memory_small 20 bash -c 'memory_check small "$0" 512' "$MEMORY_SMALL"
step memory_llama8b 35 bash -c 'memory_check llama-3-8b "$0" 4096' "${KVJAX_MEMORY_BIG:-preset:llama-3-8b}"

# ---- decode (issue 8) ------------------------------------------------------------------------
# kvjax.engine.core (8 decode steps per call) on Llama-3-8B's shapes, 2 of its 32 layers, random bf16
# weights: batch 8, 512-token prompts, 32 new tokens; bf16 vs fp8_e4m3 KV × pallas vs reference,
# the kernel first; variants past the time budget are skipped, results rewritten after each one
# in $OUT_DIR/decode_sweep.{json,md}. (env 30 → 15 s and kernel_bench 75 → 60 s made room.)
# CPU smoke run: KVJAX_DECODE_ARGS=--tiny bash experiments/gpu_check.sh
step decode_sweep 25 "$PY" -m kvjax.experiments.decode_bench --sweep-kv --layers 2 --time-budget 15 --out "$OUT_DIR" \
  ${KVJAX_DECODE_ARGS:-}

# ---- allocator (issue 15) ------------------------------------------------------------------------
# One decode step's append + allocate_step for 64 and 512 requests: per jitted call and per step
# inside lax.scan (the device loop's cost), in $OUT_DIR/allocator_step.json; exit 1 if the scan
# step at 512 requests takes over 100 us. (kernel_tests 120 → 100 s made room.)
step allocator_step 20 "$PY" -m kvjax.experiments.allocator_bench --device-step --out "$OUT_DIR"

# ---- host offload tier (issue 16) -----------------------------------------------------------------
# HostPages.load / store of 32 Llama-3-8B-shaped bf16 blocks (128 KiB per token) at block sizes 1,
# 4, 16 and 64 tokens: GB/s each way, pages in pinned_host memory, in $OUT_DIR/offload_bandwidth.*.
# (kernel_tests 100 → 90 s and memory_llama8b 50 → 45 s made room.)
step offload_bandwidth 10 "$PY" -m kvjax.experiments.offload_bench --bandwidth --out "$OUT_DIR"

# ---- long-context prefill (issue 40) -----------------------------------------------------------
# (a) one Llama-3-8B layer's compiled temporaries (XLA memory_analysis): old reference, tiled form and
# the Pallas ragged kernel, 8,192-token chunks at 8K / 32K / 128K, bf16 and fp8 pages; (d) the three
# timed on a 2,048-token chunk at each context (ms, TFLOP/s, KV GB/s), the kernel checked against the
# tiled form (exit 1 past 2^-4). Then a 32K passkey prompt through the engine on random weights: the
# bound holds end to end. (kernel_tests 90 → 65, kernel_bench 60 → 45, memory_llama8b 45 → 35,
# decode_sweep 30 → 25 and offload_bandwidth 15 → 10 s made room.)
step long_context 40 "$PY" -m kvjax.experiments.long_context --gpu --time-budget 15 --repeats 3 --out "$OUT_DIR"
step passkey_32k 25 "$PY" -m kvjax.commands.main accuracy --model preset:tiny-long --suite basic --max-windows 2 \
  --prompts 1 --decode-tokens 4 --variants "fp8_e4m3 unit" --passkey-lengths 32000 --passkey-depths 0.5 \
  --passkey-trials 1 --out "$OUT_DIR/passkey_32k"

echo "=== status"
cat "$STATUS"
exit $FAILED
