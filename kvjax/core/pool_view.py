"""The block pool as plain JSON: what `kvjax replay --show` draws, for the pages that draw it in a browser.

One view serves the live page of `kvjax serve` (kvjax.engine.pool_snapshot) and the trace page of
`kvjax replay --html`: per physical block its ref count and whether it holds a hash (cached: kept
in the free queue for a prefix hit until its turn to be evicted comes), the free queue from head
(the next block allocated) to tail (cached blocks wait there, the least recently freed first, vLLM's
LRU), and each request's block table per KV cache group (kvjax.core.request_table). Block 0, the
null block, never holds KV and is never in the queue.

`host_arrays` copies just the arrays the view reads off the device (`jax.device_get`); the caller
decides when that is safe (between two engine steps, under the engine's lock: the next step donates
the device arrays). `view` is NumPy on those copies. A pool of more than `max_blocks` blocks is drawn
up to that many, and a free queue longer than twice that keeps its head and tail ends (the counts stay whole).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from kvjax.core.block_pool import NOT_LISTED, ordered

MAX_DRAWN_BLOCKS = 4096


def host_arrays(state) -> dict[str, np.ndarray]:
    """The pool and table arrays `view` reads, copied from a KVCacheManager state to the host."""
    p, r = state.pool, state.reqs
    return jax.device_get({"ref_cnt": p.ref_cnt, "queue_pos": p.queue_pos, "head": p.head, "num_free": p.num_free,
                           "has_hash": p.has_hash, "hash": p.block_hash[:, 0], "block_table": r.block_table,
                           "num_held": r.num_held, "num_tokens": r.num_tokens, "num_computed": r.num_computed})


def free_queue(a: dict[str, np.ndarray]) -> list[int]:
    """The free queue's blocks, head to tail (kvjax.core.block_pool.free_queue on host arrays)."""
    qp = np.asarray(a["queue_pos"]).astype(np.int64)
    p = qp.shape[0]
    return ordered(np.where(qp < NOT_LISTED, (qp - int(a["head"])) % p, NOT_LISTED))


def view(a: dict[str, np.ndarray], *, block_size: int, windows: Sequence[int | None], prefix_caching: bool,
         requests: Sequence[dict[str, Any]], max_blocks: int = MAX_DRAWN_BLOCKS) -> dict[str, Any]:
    """The JSON view of host arrays `a` (host_arrays). requests: one dict per request with its
    "name" and pool "slot" (None: it holds no blocks), any other keys passed through; each gains
    "tables" (one block table per group, a sliding window's dropped blocks as 0) and its token
    counts."""
    ref = np.asarray(a["ref_cnt"])
    p = int(ref.shape[0])
    drawn = min(p, max_blocks)
    num_free = int(a["num_free"])
    out_requests = []
    for req in requests:
        r = dict(req)
        slot = r.get("slot")
        if slot is None:
            r.update(tables=[[] for _ in windows], num_tokens=None, num_computed=None)
        else:
            held = np.asarray(a["num_held"])[slot]
            r.update(tables=[[int(b) for b in np.asarray(a["block_table"])[slot, g, :int(held[g])]]
                             for g in range(len(windows))],
                     num_tokens=int(np.asarray(a["num_tokens"])[slot]),
                     num_computed=int(np.asarray(a["num_computed"])[slot]))
        out_requests.append(r)
    cached = np.asarray(a["has_hash"])
    queue = free_queue(a)
    elided = max(0, len(queue) - 2 * max_blocks)  # a long queue keeps its head and its tail
    if elided:
        queue = queue[:max_blocks] + queue[-max_blocks:]
    return {"num_blocks": p, "drawn_blocks": drawn, "block_size": int(block_size),
            "windows": list(windows), "prefix_caching": bool(prefix_caching),
            "num_free": num_free, "usage": round(1.0 - num_free / (p - 1), 6),
            "num_cached": int(cached.sum()), "num_shared": int((ref > 1).sum()),
            "ref_cnt": [int(x) for x in ref[:drawn]],
            "cached": [bool(x) for x in cached[:drawn]],
            "hash": [int(h) if c else 0 for h, c in zip(np.asarray(a["hash"])[:drawn], cached[:drawn])],
            "free_queue": queue, "free_queue_elided": elided, "requests": out_requests}
