"""vLLM's `vllm.logprobs`: Logprob (kvjax.engine.outputs)."""
from kvjax.engine.outputs import Logprob  # noqa: F401

__all__ = ["Logprob"]
