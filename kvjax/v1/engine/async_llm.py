"""vLLM's `vllm.v1.engine.async_llm`: AsyncLLM (kvjax.engine.async_llm)."""
from kvjax.engine.async_llm import AsyncLLM  # noqa: F401

__all__ = ["AsyncLLM"]
