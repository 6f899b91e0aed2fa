# Source: vLLM 0.33, docs/models/generative_models.md, "Offline Inference" > "LLM.generate", first snippet
# Copied unchanged but for these substitutions:
#   from vllm import LLM
#     -> from kvjax import LLM
#   model="facebook/opt-125m"
#     -> model="small-gqa" (kvjax's built-in byte-level Llama)
# Run in-process, its outputs checked, by tests/examples/test_vllm_examples.py.
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from kvjax import LLM

llm = LLM(model="small-gqa")
outputs = llm.generate("Hello, my name is")

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
