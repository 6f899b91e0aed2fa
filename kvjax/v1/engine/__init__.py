"""vLLM's `vllm.v1.engine`: kvjax.v1.engine.async_llm, kvjax.v1.engine.llm_engine."""
