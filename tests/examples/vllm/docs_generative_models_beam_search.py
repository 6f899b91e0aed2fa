# Source: vLLM 0.33, docs/models/generative_models.md, "Offline Inference" > "LLM.beam_search"
# Copied unchanged but for these substitutions:
#   from vllm import LLM
#     -> from kvjax import LLM
#   from vllm.sampling_params import BeamSearchParams
#     -> from kvjax.engine.beam_search import BeamSearchParams
#   model="facebook/opt-125m"
#     -> model="small-gqa" (kvjax's built-in byte-level Llama)
# Run in-process, its outputs checked, by tests/examples/test_vllm_examples.py.
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from kvjax import LLM
from kvjax.engine.beam_search import BeamSearchParams

llm = LLM(model="small-gqa")
params = BeamSearchParams(beam_width=5, max_tokens=50)
outputs = llm.beam_search([{"prompt": "Hello, my name is "}], params)

for output in outputs:
    generated_text = output.sequences[0].text
    print(f"Generated text: {generated_text!r}")
