"""The engine and the Python API (vLLM V1's `vllm/v1/engine/` and `vllm/entrypoints/llm.py`): the engine loop, LLM, SamplingParams and the sampler, run statistics."""
