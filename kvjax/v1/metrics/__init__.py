"""vLLM's `vllm.v1.metrics`: kvjax.v1.metrics.reader, kvjax.v1.metrics.stats."""
