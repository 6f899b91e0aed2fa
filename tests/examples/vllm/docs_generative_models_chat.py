# Source: vLLM 0.33, docs/models/generative_models.md, "Offline Inference" > "LLM.chat"
# Copied unchanged but for these substitutions:
#   from vllm import LLM
#     -> from kvjax import LLM
#   model="meta-llama/Meta-Llama-3-8B-Instruct"
#     -> model="<tiny-bpe-llama>"
#     a placeholder that the test replaces, when it loads this file, with the path of a checkpoint
#     folder it makes: a random 2-layer Llama with a byte-level BPE tokenizer trained on these
#     copies' text and a ChatML chat_template.jinja
# Run in-process, its outputs checked, by tests/examples/test_vllm_examples.py.
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from kvjax import LLM

llm = LLM(model="<tiny-bpe-llama>")
conversation = [
    {
        "role": "system",
        "content": "You are a helpful assistant",
    },
    {
        "role": "user",
        "content": "Hello",
    },
    {
        "role": "assistant",
        "content": "Hello! How can I assist you today?",
    },
    {
        "role": "user",
        "content": "Write an essay about the importance of higher education.",
    },
]
outputs = llm.chat(conversation)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
