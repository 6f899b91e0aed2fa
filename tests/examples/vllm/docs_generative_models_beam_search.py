# Source: vLLM 0.33, docs/models/generative_models.md, "Offline Inference" > "LLM.beam_search"
# Copied unchanged but for these substitutions:
#   from vllm import LLM
#     -> from kvjax import LLM
#   from vllm.sampling_params import BeamSearchParams
#     -> from kvjax.sampling_params import BeamSearchParams
#   model="facebook/opt-125m"
#     -> model="<tiny-bpe-llama-128>"
#     a placeholder that the test replaces, when it loads this file, with the path of a checkpoint
#     folder it makes: a random 2-layer Llama with a byte-level BPE tokenizer trained on these
#     copies' text, with max_position_embeddings 128 (the beams' ~60 tokens fit)
# Run in-process, its outputs checked, by tests/examples/test_vllm_examples.py.
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from kvjax import LLM
from kvjax.sampling_params import BeamSearchParams

llm = LLM(model="<tiny-bpe-llama-128>")
params = BeamSearchParams(beam_width=5, max_tokens=50)
outputs = llm.beam_search([{"prompt": "Hello, my name is "}], params)

for output in outputs:
    generated_text = output.sequences[0].text
    print(f"Generated text: {generated_text!r}")
