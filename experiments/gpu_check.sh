#!/usr/bin/env bash
# kvjax's one prepared run for a lent GPU (an H200: jax, flax, chex, numpy, pytest, torch and
# transformers preinstalled; no network). One call, within 8 minutes, at most 8 files back:
#
#   bash experiments/gpu_check.sh                 # results in $OUT when set, else experiments/results/gpu_check
#   bash experiments/gpu_check.sh --smoke         # every step's code path on tiny shapes, on the CPU (tests run this)
#   GPU_CHECK_STEPS="peaks model" bash experiments/gpu_check.sh     # a subset, in this order
#
# It sets its own platform (JAX_PLATFORMS=cuda) and XLA flags per step. Each step runs under its
# own `timeout`, its log and results go to a work folder, and the script carries on when a step
# fails. At the end experiments/gpu_summary.py writes summary.md (every figure beside its target)
# into the output folder with status.tsv (each step's exit status, 124 = timed out, and seconds)
# and results.tgz (every log and JSON), and prints the summary last.
#
# Steps and limits (seconds; 465 in all, sized from the H200 runs of 2026-12-04: peaks 11 s,
# Llama-3-8B random init 8.5 s, a 32-layer decode program compiles in 7-11 s, the kernel tests 19-43 s):
#   peaks          20  read / copy bandwidth (4 GiB) and the bf16 matmul rate: every roofline's denominator
#   kernel_tests   70  the Mosaic GPU kernels' tests (not slow), compiled (KVJAX_INTERPRET=0), one process per
#                      file, the files side by side (compiling is the CPUs' work: MLA 30 s, ragged 27 s alone
#                      on the H200; the Triton kernels' tests passed there on 2026-12-04)
#   kernel_bench   60  decode and ragged kernels side by side (Mosaic GPU, Triton, JAX's shipped, XLA
#                      reference), every page format; its rows in kernel_bench.jobs_in_order's order
#   model         125  Llama-3-8B (32 layers, random bf16): decode steps at B 1-128, 512 and 8K, bf16 / fp8 KV,
#                      against the roofline; prefill TTFT; a profile of one case; the leave-one-out variants
#                      (attention, sampler, allocator left out; K = 1 against 8)
#   model_cb       40  the same B 32 / 128 decode steps with KVJAX_XLA_FLAGS=1 (kvjax.utils.xla_flags: the while
#                      loop and its conds recorded into command buffers): what the flags buy, side by side
#   transformers   55  transformers 5 `generate` (sdpa, static cache) on the same shapes and the same GPU
#   moe            25  Mixtral-8x7B (2 layers) decode steps
#   moe_mla        25  DeepSeek-V3 (4 layers: 3 dense + 1 MoE, MLA) decode steps
#   model_70b      20  Llama-3-70B (2 layers): decode and prefill per layer pair
#   memory         25  kvjax memory on Llama-3-8B's shapes: measured KV pages / analytic within 0.1%
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT_DIR=${OUT:-$ROOT/experiments/results/gpu_check}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=2
if [ $SMOKE = 1 ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=cuda; fi
STATUS=$WORK/status.tsv
printf 'step\texit\tseconds\tlimit\n' > "$STATUS"
STEPS=${GPU_CHECK_STEPS:-peaks kernel_tests kernel_bench model model_cb transformers moe moe_mla model_70b memory}
START=$SECONDS

step() {  # step NAME LIMIT COMMAND...
  local name=$1 limit=$2
  shift 2
  [ $SMOKE = 1 ] && limit=$((limit * 3))  # the limits are the GPU's; a loaded CPU runs the tiny shapes slower
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s, at $((SECONDS - START))s)"
  local t=$SECONDS
  (cd "$WORK" && timeout --kill-after=5 "$limit" "$@") > "$WORK/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t))" "$limit" >> "$STATUS"
  tail -n 4 "$WORK/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t))s"
}

if [ $SMOKE = 1 ]; then
  TINY=--tiny
  BENCH_BUDGET=3
  MODEL=(--tiny --profile)
  CASES_CB=decode:2:24:bf16:reference:2
  HF=(--model tiny --cases "decode:2:16 prefill:2:16" --new-tokens 3)
  MOE=(--tiny --model tiny-moe --cases "decode:2:24:bf16:reference:2")
  MOE_MLA=(--tiny --model tiny-moe-mla --cases "decode:2:24:bf16:reference:2")
  L70=(--tiny --cases "decode:2:24:bf16:reference:2")
  MEMORY=(--model preset:tiny --max-num-batched-tokens 64 --device-memory-gib 1)
else
  TINY=
  BENCH_BUDGET=50
  MODEL=(--profile decode:128 --time-budget 105 --calls 4 --cases "decode:32:512 decode:128:512 decode:32:8192 \
decode:32:8192:fp8_e4m3 decode:128:8192:fp8_e4m3 prefill:32:512 decode:1:512 decode:8:512 prefill:1:8192 \
decode:32:512:bf16:pallas:1 decode:32:512:bf16:no-attention decode:32:512:bf16:no-sampling \
decode:32:512:bf16:no-allocator decode:8:8192 decode:1:8192")
  CASES_CB="decode:32:512 decode:128:512"
  HF=(--cases "decode:32:512 prefill:32:512 decode:128:512 decode:1:512 decode:8:512 decode:32:8192 prefill:1:8192" \
      --new-tokens 24)
  MOE=(--model mixtral-8x7b --layers 2 --calls 3 --cases "decode:32:512 decode:128:512")
  MOE_MLA=(--model deepseek-v3 --layers 4 --calls 3 --cases "decode:32:512 decode:32:8192")
  L70=(--model llama-3-70b --layers 2 --calls 3 --cases "decode:32:512 decode:128:8192 prefill:8:2048")
  MEMORY=(--model preset:llama-3-8b --max-num-batched-tokens 4096)
fi

step peaks 20 "$PY" -m kvjax.experiments.device_peaks $TINY --out "$WORK"
if [ $SMOKE = 0 ]; then
  # Each file in a process of its own: an illegal instruction poisons the process's CUDA context.
  # The files side by side (compiling is CPU work; 16 cores), none holding the GPU's memory up front.
  step kernel_tests 70 bash -c 'for f in decode mla ragged per_token nvfp4 ragged_quant ragged_mla; do \
    t="$1/tests/attention/test_mgpu_$f.py"; [ -f "$t" ] || continue; XLA_PYTHON_CLIENT_PREALLOCATE=false \
    KVJAX_INTERPRET=0 "$0" -m pytest -q -p no:cacheprovider --maxfail=4 -m "not slow" "$t" \
    --junitxml="kernel_tests_$f.xml" > "kernel_tests_$f.log" 2>&1 & done; rc=0; \
    for j in $(jobs -p); do wait "$j" || rc=1; done; tail -n 3 kernel_tests_*.log; exit $rc' "$PY" "$ROOT"
fi
step kernel_bench 60 "$PY" -m kvjax.experiments.kernel_bench $TINY --time-budget "$BENCH_BUDGET" --out "$WORK"
step model 125 "$PY" -m kvjax.experiments.gpu_model_bench "${MODEL[@]}" --out "$WORK"
step model_cb 40 env KVJAX_XLA_FLAGS=1 "$PY" -m kvjax.experiments.gpu_model_bench $TINY --cases "$CASES_CB" \
  --calls 3 --tag _cb --out "$WORK"
step transformers 55 "$PY" -m kvjax.experiments.gpu_model_bench --transformers "${HF[@]}" --out "$WORK"
step moe 25 "$PY" -m kvjax.experiments.gpu_model_bench "${MOE[@]}" --tag _moe --out "$WORK"
step moe_mla 25 "$PY" -m kvjax.experiments.gpu_model_bench "${MOE_MLA[@]}" --tag _moe_mla --out "$WORK"
step model_70b 20 "$PY" -m kvjax.experiments.gpu_model_bench "${L70[@]}" --tag _70b --out "$WORK"
step memory 25 bash -c '"$0" -m kvjax.commands.main memory "$@" --json > memory.json' "$PY" "${MEMORY[@]}"

echo "=== summary (at $((SECONDS - START))s)"
"$PY" -m kvjax.experiments.gpu_summary "$WORK" --status "$STATUS" --out "$OUT_DIR"
cp "$STATUS" "$OUT_DIR/status.tsv"
(cd "$WORK" && rm -rf trace && tar czf "$OUT_DIR/results.tgz" --exclude='*.tgz' .)
cat "$OUT_DIR/summary.md"
