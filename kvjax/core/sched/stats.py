"""What the scheduler reports after each engine step (vLLM V1's `SchedulerStats` and
`PrefixCacheStats`, `vllm/v1/metrics/stats.py`).

vLLM's engine core asks its scheduler for one `SchedulerStats` per step (`Scheduler.make_stats`,
attached to the step's outputs) and its loggers read that, never the scheduler's queues. kvjax's
engine does the same: `kvjax.core.sched.scheduler.Scheduler.make_stats()` after every step, read
by the metrics (kvjax.engine.metrics), a run's Summary and the step log (kvjax.engine.stats).

Beside vLLM's fields (queue lengths, KV cache usage, the prefix cache's lookups), kvjax's stats
carry what vLLM's engine learns from the same step's outputs or its model runner: the requests
preempted and finished since the last stats (vLLM's PREEMPTED events and `finished_req_ids`; a
request aborted or preempted between steps is in the next step's stats), the blocks in use after
each model step of the call (kvjax's device loop runs up to steps_per_call), and the host tier's
hits and occupancy (vLLM's connector prefix-cache stats).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PrefixCacheStats:
    """vLLM's PrefixCacheStats: the prefix-cache lookups of the requests admitted since the last
    stats, in tokens. A request admitted again after a preemption is counted apart (preempted_*),
    as vLLM's `record` does, so that requests / queries / hits are each prompt's first lookup."""

    requests: int = 0
    queries: int = 0  # tokens looked up (the request's tokens)
    hits: int = 0  # tokens found (device prefix cache and host tier)
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """One admission's lookup (vLLM's `PrefixCacheStats.record`)."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """One engine step as the scheduler saw it (module docstring). Counts are of this step, or
    since the last stats where the field says so; queue lengths and usage are after the step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # 1 - free / usable blocks after the step (the null block is not usable)
    prefix_cache_stats: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)
    # kvjax's (vLLM's engine reads these from the step's outputs and its own counters)
    preempted_req_ids: tuple[str, ...] = ()  # preempted since the last stats, in order
    finished_req_ids: frozenset[str] = frozenset()  # finished (or aborted) since the last stats
    blocks_in_use: tuple[int, ...] = ()  # blocks out of the free queue after each model step of the call
    host_hit_tokens: int = 0  # prompt tokens the host tier supplied since the last stats (within hits)
    host_blocks_in_use: int = 0  # host tier slots holding a block after the step (0: no tier)

    @property
    def num_preempted_reqs(self) -> int:
        return len(self.preempted_req_ids)


@dataclasses.dataclass
class SinceLastStats:
    """What a scheduler records between two of its stats (`Scheduler.make_stats`)."""

    prefix: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)
    preempted: list[str] = dataclasses.field(default_factory=list)
    finished: set[str] = dataclasses.field(default_factory=set)
    used: tuple[int, ...] | None = None  # blocks in use after each step a device loop ran (None: read the pool)
    host_hits: int = 0  # the host tier's hit tokens at the last stats

    def stats(self, *, running: int, waiting: int, used: tuple[int, ...], usable: int, host_hits: int,
              host_in_use: int) -> SchedulerStats:
        """These counts and the queues now as a SchedulerStats; the counting starts over."""
        out = SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=used[-1] / usable,
                             prefix_cache_stats=self.prefix, preempted_req_ids=tuple(self.preempted),
                             finished_req_ids=frozenset(self.finished), blocks_in_use=used,
                             host_hit_tokens=host_hits - self.host_hits, host_blocks_in_use=host_in_use)
        self.__init__(host_hits=host_hits)
        return out


__all__ = ["PrefixCacheStats", "SchedulerStats", "SinceLastStats"]
