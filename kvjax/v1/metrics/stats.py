"""vLLM's `vllm.v1.metrics.stats`: what the scheduler reports after each step
(kvjax.core.sched.stats: SchedulerStats, PrefixCacheStats)."""
from kvjax.core.sched.stats import PrefixCacheStats, SchedulerStats  # noqa: F401

__all__ = ["PrefixCacheStats", "SchedulerStats"]
