#!/usr/bin/env bash
# Run 1 (probe): peaks, whole-model decode/prefill with a profile, Mosaic vs Triton decode kernel, transformers.
set -u
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cuda PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=2
O=${OUT:-/tmp/run1}; mkdir -p "$O"
s() { local name=$1 lim=$2; shift 2; local st=$SECONDS; timeout -k 5 "$lim" "$@" > "$O/$name.log" 2>&1; local rc=$?
      echo "$name rc=$rc $((SECONDS-st))s" | tee -a "$O/status.txt"; tail -n 6 "$O/$name.log"; }
s peaks 35 python3 -m kvjax.experiments.device_peaks --out "$O"
s kvjax 150 python3 -m kvjax.experiments.gpu_model_bench --profile --time-budget 125 --calls 4 --out "$O" --cases \
  "decode:32:512 prefill:32:512 decode:32:512:bf16:no-attention decode:32:512:bf16:pallas:1 decode:128:512 decode:32:8192 decode:32:8192:fp8_e4m3 decode:32:512:bf16:reference prefill:1:8192"
s kernels 40 python3 .run1/kernels_ab.py "$O/device_peaks.json"
s mgpu_tests 35 env KVJAX_INTERPRET=0 python3 -m pytest -q -x -p no:cacheprovider tests/attention/test_mgpu_decode.py
s hf 55 python3 -m kvjax.experiments.gpu_model_bench --transformers --new-tokens 24 --out "$O" --cases \
  "decode:32:512 prefill:32:512 decode:128:512 decode:32:8192 prefill:1:8192"
cd "$O" && rm -rf trace && tar czf run1.tgz --exclude=run1.tgz *.json *.log status.txt && rm -f *.json *.log
ls -la "$O"; cat "$O/status.txt"; cat "$O"/gpu_model_bench.md 2>/dev/null | tail -15
