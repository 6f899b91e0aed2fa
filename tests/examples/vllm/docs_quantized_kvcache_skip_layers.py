# Source: vLLM 0.33, docs/features/quantization/quantized_kvcache.md, "Skipping Specific Layers from
# KV-Cache Quantization", the "Programmatic usage" snippet
# Copied unchanged but for these substitutions:
#   (the snippet imports nothing)
#     -> from kvjax import LLM
#   model="meta-llama/Llama-3.1-8B-Instruct"
#     -> model="<gemma3-tiny>"
#     a placeholder that the test replaces, when it loads this file, with the path of a checkpoint
#     folder it makes: a tiny random Gemma-3 text model (sliding-window and full-attention layers)
# Run in-process, its outputs checked, by tests/examples/test_vllm_examples.py.
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from kvjax import LLM

llm = LLM(
    model="<gemma3-tiny>",
    kv_cache_dtype="fp8",
    kv_cache_dtype_skip_layers=["sliding_window"],
)
