"""vLLM's `vllm.v1.engine.llm_engine`: LLMEngine (kvjax.engine.llm_engine)."""
from kvjax.engine.llm_engine import LLMEngine  # noqa: F401

__all__ = ["LLMEngine"]
