"""The host tier's scheduler side (vLLM's OffloadingConnector, `OffloadingConnectorScheduler`): which
of a request's blocks the tier serves at admission, and which of its blocks are offered to it.

`HostTier` is what the scheduler (kvjax.core.sched.scheduler) keeps of the tier: the index, the
copies it planned, its hit count. The scheduler and the trace replay (kvjax.core.replay) both go
through `lookup`, `first_offer` and `offer`, so the connector's rules exist once:

- at every admission attempt, all of the request's full-block hashes are touched first,
  resident or not (ARC: a ghost hit moves p); then the hash chain continues in the tier after
  the device prefix hits, and its contiguous run of resident blocks are host hits, capped like
  device hits (kvjax.core.kv_cache_utils.max_cached_blocks) so that the request's last token is still computed;
- after a step, each request's full blocks not yet offered are offered, from logical block
  `host_next` on: block 0 at first (device hits included), or just after the host hits when
  there were any (loaded blocks are not offered back).

Host hits take fresh device blocks in the same `allocate_slots` call and count as computed
tokens (vLLM's external tokens); the plan lists their copies (`StepPlan.loads`), their host
slots pinned until the engine copied them in (`loads_done`). `take_stores` hands the engine the
(device block, host slot) copies of the blocks newly offered and taken.
"""
from __future__ import annotations

import jax
import numpy as np

from kvjax.core.kv_cache_manager import PoolRefusedError
from kvjax.core.kv_cache_utils import max_cached_blocks
from kvjax.kv_offload import manager as host_cache
from kvjax.math_utils import pow2_bucket


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


def first_offer(num_hits: int, host_hits: int, offered: int = 0) -> int:
    """The logical block from which a request's blocks are offered after its admission: just after
    the host hits when there were any (loaded blocks are not offered back), else where its
    offering stood (block 0 for a new request, device hits included)."""
    return num_hits + host_hits if host_hits else offered


def offer(host: host_cache.HostIndex, req_hash: np.ndarray, first: int, end: int):
    """Offer the tier a request's full blocks first .. end - 1 (req_hash: u32[>= end, 2]).
    → (host index, [(logical block, host slot)] newly stored, the next block to offer)."""
    if end <= first:
        return host, [], max(first, end)
    host, slots, stored = host_cache.offer(host, np.asarray(req_hash)[:end], first)
    return host, [(j, int(x)) for j, x, k in zip(range(first, end), slots, stored) if k], end


class HostTier:
    """The scheduler's side of the host tier: its index (a HostIndex pytree on `placement`), the
    copies planned since the engine last took them, and the tokens its hits served."""

    def __init__(self, num_slots: int, policy: str, placement, block_size: int, max_blocks: int):
        self.num_slots, self.policy, self.placement = num_slots, policy, placement
        self.block_size, self.max_blocks = block_size, max_blocks
        self.index = self.new_index()
        self.stores: list[tuple[int, int]] = []  # (device block, host slot) to copy after the step
        self.hit_tokens = 0

    def new_index(self) -> host_cache.HostIndex:
        """An empty index, committed to the device like the pool state."""
        return jax.device_put(host_cache.init(self.num_slots, self.policy), self.placement)

    def lookup(self, req_hash: np.ndarray, num_tokens: int, num_hits: int) -> tuple[np.ndarray | None, int]:
        """At an admission attempt (`lookup` above): (the hashes after the device hits, host hits)."""
        self.index, hashes, n = lookup(self.index, req_hash, num_tokens, num_hits, self.block_size, self.max_blocks)
        return hashes, n

    def plan_loads(self, hashes: np.ndarray, n: int, blocks: np.ndarray) -> list[tuple[int, int]]:
        """Pin n host hits until loaded (prepare_load): their (host slot, device block) copies
        into the fresh blocks after the device hits."""
        self.index, slots = host_cache.prepare_load(self.index, hashes, n)
        self.hit_tokens += n * self.block_size
        return list(zip(np.asarray(slots[:n]).tolist(), np.asarray(blocks).tolist()))

    def loads_done(self, loads: np.ndarray) -> None:
        """The engine copied loads (i32[loads, 2] host slot, device block) in: unpin their slots."""
        if len(loads):
            slots = np.full(pow2_bucket(len(loads)), -1, np.int32)
            slots[: len(loads)] = loads[:, 0]
            self.index, ok = host_cache.complete_load(self.index, slots, len(loads))
            if not bool(ok):
                raise PoolRefusedError(f"the host tier refused to unpin slots {loads[:, 0].tolist()} after their load")

    def store(self, req_hash: np.ndarray, first: int, end: int, table) -> int:
        """Offer one request's full blocks first .. end - 1 (`offer` above), planning the copies
        of those the tier took (from `table`, its block table). → the next block to offer."""
        self.index, stored, end = offer(self.index, req_hash, first, end)
        self.stores += [(int(table[j]), s) for j, s in stored]
        return end

    def take_stores(self) -> list[tuple[int, int]]:
        stores, self.stores = self.stores, []
        return stores

    def blocks_in_use(self) -> int:
        return int(self.index.valid.sum())
