"""A running engine's block pool, read between two steps: what the live pool page of `kvjax serve` shows.

The engine thread of AsyncLLM steps the engine while HTTP handlers run in other threads, and each
step donates the pool's device arrays to its jitted call: their buffers are gone once the call
starts. So a reader never touches them from its own thread mid-step. `pool_snapshot` takes the
engine's lock (kvjax.utils.atomic.lock_of, the one every Engine step and request holds), which waits
for the step in flight to end, copies the few arrays the view needs to the host, reads the
scheduler's requests, and lets go; the JSON is built from the host copies afterwards. That is how
`/metrics` reads the engine too (EngineMetrics keeps host values under its own lock). The server
asks the engine thread itself to take it between two steps (AsyncLLM.call_between_steps): a thread
waiting on the lock of a busy engine would rarely get it, as the engine thread takes it again at
once for its next step.

The snapshot is kvjax.core.pool_view's view (the state `kvjax replay --show` draws) plus each
request's id, status and preemptions, and the headline numbers under vLLM's metric names:
num_gpu_blocks (vllm:cache_config_info), vllm:kv_cache_usage_perc, the prefix cache's queries and
hits (vllm:prefix_cache_queries / _hits, and their ratio), vllm:num_preemptions, and the running and
waiting requests.
"""
from __future__ import annotations

import time
from typing import Any

from kvjax.core import pool_view
from kvjax.utils.atomic import lock_of

HEADLINE = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")


def pool_snapshot(engine, *, max_blocks: int = pool_view.MAX_DRAWN_BLOCKS) -> dict[str, Any]:
    """The block pool of `engine` (a kvjax.engine.core.Engine) as JSON, read between two steps."""
    sched = engine.scheduler
    with lock_of(engine):  # no step runs while the arrays are copied
        arrays = pool_view.host_arrays(sched.state)
        requests = [{"name": r.req_id, "slot": r.slot, "status": r.status, "preemptions": r.num_preemptions,
                     "prompt_tokens": len(r.prompt), "output_tokens": len(r.output)}
                    for r in sched.requests.values() if r.status != "finished"]
        metrics = engine.metrics.snapshot()
    cfg = sched.config
    out = pool_view.view(arrays, block_size=cfg.block_size, windows=cfg.windows, prefix_caching=cfg.prefix_caching,
                         requests=requests, max_blocks=max_blocks)
    values = {m.name: m.value for m in metrics if m.name in HEADLINE and "reason" not in m.labels}
    queries, hits = values["vllm:prefix_cache_queries"], values["vllm:prefix_cache_hits"]
    out["metrics"] = {"num_gpu_blocks": cfg.num_blocks, **values,
                      "prefix_cache_hit_rate": hits / queries if queries else None}
    out["time"] = time.time()
    return out
