"""The engine and the Python API (vLLM V1's `vllm/v1/engine/` and `vllm/entrypoints/llm.py`).

arg_utils.py        EngineArgs (vLLM's engine arguments) → the one resolved config (kvjax.config.engine)
cli_args.py         the engine's command-line flags, one table (EngineArgs.add_cli_args)
core.py             the engine core: the only token producer (scheduler, pool, cache and model, step by step)
llm_engine.py       LLMEngine: requests in (checked, n samples fanned out), one step at a time, RequestOutputs out
async_llm.py        AsyncLLM: the LLMEngine in a thread, requests from many coroutines streamed back
llm.py              LLM, vLLM's offline API: generate (a loop over LLMEngine), chat, beam_search, score
output_processor.py RequestOutputs from the engine's results, per output kind (CUMULATIVE / DELTA / FINAL_ONLY)
outputs.py          RequestOutput, CompletionOutput, Logprob, RequestMetrics (vLLM's `vllm/outputs.py`)
processor.py        the engine's per-request rules, n samples as n requests, stop strings, detokenizing
sampling_params.py  SamplingParams, RequestOutputKind (vLLM's `vllm/sampling_params.py`)
sampling.py         the sampler: a step's logits → tokens, in vLLM's order
beam_search.py      vLLM's beam search over generate
steps.py            the two compiled device calls (the ragged step, the decode loop)
metrics.py          vLLM's Prometheus metrics (get_metrics, /metrics)
stats.py            what a run of steps reports (Summary)
"""
