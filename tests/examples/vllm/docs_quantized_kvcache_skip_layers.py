# Source: vLLM 0.33, docs/features/quantization/quantized_kvcache.md, "Skipping Specific Layers from
# KV-Cache Quantization", the "Programmatic usage" snippet
# Copied unchanged but for these substitutions:
#   (the snippet imports nothing)
#     -> from kvjax import LLM
#   model="meta-llama/Llama-3.1-8B-Instruct"
#     -> model="small-gqa"
#     kvjax's built-in Llama (full attention in every layer, as Llama-3.1's: "sliding_window" names
#     no layer of it); tests/examples/test_vllm_examples.py also runs these arguments on a model
#     with sliding windows
# Run in-process, its outputs checked, by tests/examples/test_vllm_examples.py.
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from kvjax import LLM

llm = LLM(
    model="small-gqa",
    kv_cache_dtype="fp8",
    kv_cache_dtype_skip_layers=["sliding_window"],
)
