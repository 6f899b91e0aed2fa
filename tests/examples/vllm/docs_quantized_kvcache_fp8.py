# Source: vLLM 0.33, docs/features/quantization/quantized_kvcache.md, "Examples" >
# "1. No Calibration (kv_cache_dtype="fp8")"
# Copied unchanged but for these substitutions:
#   from vllm import LLM, SamplingParams
#     -> from kvjax import LLM, SamplingParams
#   model="meta-llama/Llama-2-7b-chat-hf"
#     -> model="small-gqa" (kvjax's built-in byte-level Llama)
# Run in-process, its outputs checked, by tests/examples/test_vllm_examples.py.
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from kvjax import LLM, SamplingParams

sampling_params = SamplingParams(temperature=0.7, top_p=0.8)
llm = LLM(
    model="small-gqa",
    kv_cache_dtype="fp8",
)
prompt = "London is the capital of"
out = llm.generate(prompt, sampling_params)[0].outputs[0].text
print(out)
