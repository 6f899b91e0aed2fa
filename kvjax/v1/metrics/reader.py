"""vLLM's `vllm.v1.metrics.reader`: the types `LLM.get_metrics()` returns (kvjax.engine.metrics).
vLLM's get_metrics_snapshot() reads its process-wide Prometheus registry; kvjax keeps each engine's
metrics on the engine (`LLM.get_metrics()`, `AsyncLLM.get_metrics()`)."""
from kvjax.engine.metrics import Counter, Gauge, Histogram, Metric, Vector  # noqa: F401

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
