"""vLLM's `vllm.outputs`: RequestOutput, CompletionOutput, RequestMetrics (kvjax.engine.outputs)."""
from kvjax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: F401

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]
