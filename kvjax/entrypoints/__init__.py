"""Ways into the engine from outside Python (vLLM's `vllm/entrypoints/`): the OpenAI-compatible server."""
