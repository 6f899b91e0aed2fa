"""The KV cache manager's request table: one row per request slot, with the request's tokens as
block hashes, its block tables (one per KV cache group) and its computed and cached counts
(vLLM keeps the first on its `Request` and the rest in each single-type manager's
`req_to_blocks` / `num_cached_block`). `kvjax/core/kv_cache_manager.py` is what changes it.

Axes: the kvjax package docstring's legend; here B is the requests of one batched call, T the
token ids a call is handed and G the KV cache groups.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.core import block_pool
from kvjax.core import kv_cache_utils as hashing
from kvjax.core.block_pool import BlockPool
from kvjax.errors import KvjaxError, require
from kvjax.utils.checks import check_int


@struct.dataclass
class Requests:
    """The request table: one row per request slot."""

    block_size: int = struct.field(pytree_node=False)  # Z tokens per block
    max_requests: int = struct.field(pytree_node=False)  # R request slots
    max_blocks_per_request: int = struct.field(pytree_node=False)  # M; a request holds <= M*Z tokens
    num_groups: int = struct.field(pytree_node=False)  # G KV cache groups, one block table each
    active: jax.Array  # bool[R] slot holds a request
    tail: jax.Array  # i32[R, Z] the tokens of each request's unfilled last block (num_tokens % Z), 0-padded
    num_tokens: jax.Array  # i32[R]
    has_salt: jax.Array  # bool[R] first block's hash mixes in a cache salt
    salt: jax.Array  # u32[R, 2] the salt key (hashing.salt_key)
    req_hash: jax.Array  # u32[R, M, 2] chained hash of each FULL block of the request's tokens
    num_hashed: jax.Array  # i32[R] = num_tokens // Z when caching is on, else 0
    block_table: jax.Array  # i32[R, G, M] physical block of each logical block; 0 (null) = unused or skipped
    num_held: jax.Array  # i32[R, G] leading table entries in use (a window's nulls included)
    num_skipped: jax.Array  # i32[R, G] leading entries a sliding window freed (null)
    num_computed: jax.Array  # i32[R] tokens computed or scheduled (vLLM's num_computed_tokens)
    num_cached: jax.Array  # i32[R, G] leading blocks already cached for this request


def empty(block_size: int, max_requests: int, max_blocks_per_request: int, num_groups: int = 1) -> Requests:
    """An empty request table of R slots and G block tables per slot."""
    z = check_int(block_size, "block_size", 1, None)
    r = check_int(max_requests, "max_requests", 1, None)
    m = check_int(max_blocks_per_request, "max_blocks_per_request", 1, None)
    if m * z >= 2**31:
        raise KvjaxError(f"max_blocks_per_request * block_size = {m * z} overflows int32 token positions")
    g = check_int(num_groups, "num_groups", 1, None)
    i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
    return Requests(block_size=z, max_requests=r, max_blocks_per_request=m, num_groups=g, active=jnp.zeros(r, bool),
                    tail=i32((r, z)), num_tokens=i32(r), has_salt=jnp.zeros(r, bool),
                    salt=jnp.zeros((r, 2), jnp.uint32), req_hash=jnp.zeros((r, m, 2), jnp.uint32),
                    num_hashed=i32(r), block_table=i32((r, g, m)), num_held=i32((r, g)), num_skipped=i32((r, g)),
                    num_computed=i32(r), num_cached=i32((r, g)))


def slot_of(t: Requests, req):
    """(valid, clipped slot) for a request slot index."""
    return (req >= 0) & (req < t.max_requests), jnp.clip(req, 0, t.max_requests - 1)


def append(t: Requests, rows, tokens, n, caching: bool, max_new: int | None = None) -> Requests:
    """Append tokens[b, :n[b]] (i32[B, T]) after the tokens of request slots rows (i32[B],
    distinct; None: every slot, in order), then hash the blocks they fill; each row keeps its
    unfilled block (`tail`). A request's tokens are its owner's, the scheduler's Request: a full
    block lives on here as its hash. caching: hash them (prefix caching on)."""
    z, (b, width) = t.block_size, tokens.shape
    every = rows is None  # the decode step: elementwise over the table, no gather or scatter of rows
    rows = jnp.arange(t.max_requests) if every else rows
    old_tail, num_tokens = (t.tail, t.num_tokens) if every else (t.tail[rows], t.num_tokens[rows])
    fill = num_tokens % z  # i32[B] tokens already in each row's tail
    full = (fill + n) // z  # i32[B] blocks the row fills
    if width == 1:  # one token a row: written into the tail, which is hashed and emptied if it fills
        filled = jnp.where((jnp.arange(z) == fill[:, None]) & (n > 0)[:, None], tokens, old_tail)
        tail = jnp.where((full > 0)[:, None], 0, filled)
    else:
        idx = jnp.arange(width)  # past the end: dropped
        pos = jnp.where(idx < n[:, None], fill[:, None] + idx, 2 * z + width)
        filled = jnp.concatenate([old_tail, jnp.zeros((b, z + width), jnp.int32)], axis=1)
        filled = filled.at[jnp.arange(b)[:, None], pos].set(tokens, mode="drop")  # the tail, then the new tokens
        tail = jax.vmap(lambda row, k: jax.lax.dynamic_slice(row, (k * z,), (z,)))(filled, full)  # block `full`
    t = t.replace(tail=tail if every else t.tail.at[rows].set(tail),
                  num_tokens=num_tokens + n if every else t.num_tokens.at[rows].add(n))
    if caching:
        t = hashing.extend_request_hashes(t, rows, filled, max_new)
    return t


def tokens_ok(t: Requests, r, tokens, n):
    """n tokens (of tokens i32[T]) fit in slot r's row and are valid ids (>= 0)."""
    idx = jnp.arange(tokens.shape[0])
    room = t.max_blocks_per_request * t.block_size - t.num_tokens[r]
    return (n >= 0) & (n <= tokens.shape[0]) & (n <= room) & ~((idx < n) & (tokens < 0)).any()


def check_tables(t: Requests, pool: BlockPool) -> None:
    """The tables' invariants against the pool's counts (host arrays): raise AssertionError naming
    the likely cause."""
    p = pool.num_blocks
    counts = np.zeros(p, np.int64)
    where: dict[int, set[tuple[int, int]]] = {}
    for r in range(t.max_requests):
        for g in range(t.num_groups):
            skipped, held = int(t.num_skipped[r, g]), int(t.num_held[r, g])
            require(skipped <= held and not t.block_table[r, g, :skipped].any() and not t.block_table[r, g, held:].any(),
                    f"request slot {r} group {g}: entries outside {skipped}..{held - 1} are not the null block")
            for j, b in enumerate(t.block_table[r, g, :held]):
                if j < skipped:
                    continue
                require(b != block_pool.NULL_BLOCK, f"request slot {r} group {g} maps logical block {j} to the null block")
                counts[b] += 1
                where.setdefault(int(b), set()).add((g, j))
    require((counts == pool.ref_cnt).all(),
            f"ref_cnt != table occurrences at blocks {np.nonzero(counts != pool.ref_cnt)[0]}: "
            "a touch or release was skipped")
    for b, places in where.items():
        require(counts[b] == 1 or (pool.has_hash[b] and len(places) == 1),
                f"block {b} is in {counts[b]} tables at (group, position) {sorted(places)} but is not a "
                "cached prefix block: two requests got the same new block")


# ----------------------------------------------------------------------------- host views (a KVCacheManager state)
def request_blocks(state, req: int, group: int = 0) -> list[int]:
    """The request's block table in one group (host side), a sliding window's nulls as 0."""
    t = state.reqs
    return [int(b) for b in np.asarray(t.block_table[req, group])[: int(t.num_held[req, group])]]


def check_invariants(state) -> None:
    """The pool's invariants plus the tables': raise AssertionError naming the likely cause."""
    s = jax.device_get(state)
    block_pool.check_invariants(s.pool)
    check_tables(s.reqs, s.pool)
