"""The host tier's scheduler side (vLLM's OffloadingConnector, `OffloadingConnectorScheduler`): which
of a request's blocks the tier serves at admission, and which of its blocks are offered to it.

The scheduler (kvjax.core.sched.scheduler) and the trace replay (kvjax.core.replay) both call
these, so the connector's rules exist once:

- at every admission attempt, all of the request's full-block hashes are touched first,
  resident or not (ARC: a ghost hit moves p); then the hash chain continues in the tier after
  the device prefix hits, and its contiguous run of resident blocks are host hits, capped like
  device hits (kvjax.core.kv_cache_utils.max_cached_blocks) so that the request's last token is still computed;
- after a step, each request's full blocks not yet offered are offered, from logical block
  `host_next` on: block 0 at first (device hits included), or just after the host hits when
  there were any (loaded blocks are not offered back).
"""
from __future__ import annotations

import numpy as np

from kvjax.core.kv_cache_utils import max_cached_blocks
from kvjax.kv_offload import manager as host_cache


def lookup(host: host_cache.HostIndex, req_hash: np.ndarray, num_tokens: int, num_hits: int, block_size: int,
           size: int | None = None):
    """At an admission attempt. req_hash: u32[M, 2] the request's block hashes (the full blocks'
    first); num_hits: its device prefix hits. size: the rows the hashes are padded to (default a
    power of two). → (host index, the hashes after the device hits u32[size, 2] or None, host hits)."""
    full = num_tokens // block_size
    host = host_cache.touch(host, host_cache.pad_hashes(req_hash[:full], size), full)
    cap = max_cached_blocks(num_tokens, block_size) - num_hits
    if cap <= 0:
        return host, None, 0
    hashes = host_cache.pad_hashes(req_hash[num_hits:num_hits + cap], size)
    return host, hashes, int(host_cache.lookup(host, hashes, cap))


def offer(host: host_cache.HostIndex, req_hash: np.ndarray, first: int, end: int):
    """Offer the tier a request's full blocks first .. end - 1 (req_hash: u32[>= end, 2]).
    → (host index, [(logical block, host slot)] newly stored, the next block to offer)."""
    if end <= first:
        return host, [], max(first, end)
    host, slots, stored = host_cache.offer(host, np.asarray(req_hash)[:end], first)
    return host, [(j, int(x)) for j, x, k in zip(range(first, end), slots, stored) if k], end
