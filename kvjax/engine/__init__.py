"""The engine and the Python API (vLLM V1's `vllm/v1/engine/` and `vllm/entrypoints/llm.py`).

core.py       the engine: the only token producer (scheduler, pool, cache and model in one loop)
llm.py        LLM, vLLM's offline API: load, size, generate, chat, score
arg_utils.py  LLM's arguments checked before a model loads (vLLM's `vllm/engine/arg_utils.py`)
outputs.py    RequestOutput, CompletionOutput, Logprob, RequestMetrics (vLLM's `vllm/outputs.py`)
sampling.py   SamplingParams and the sampler
stats.py      what a run reports
"""
