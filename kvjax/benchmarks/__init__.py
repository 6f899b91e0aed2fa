"""Benchmarks with vLLM's definitions (vLLM's `vllm/benchmarks/`): serve.py is `kvjax bench serve`."""
