"""The KV cache manager: vLLM V1's `core/kv_cache_manager.py` as pure functions over a pytree.

It owns the request table (each request slot's block hashes, block table and computed tokens)
and asks the block pool (`kvjax/core/block_pool.py`, which owns the blocks) for blocks:
`get_computed_blocks` (prefix-cache hits), `allocate_slots` (room for new tokens; caches every
block that becomes full), `free` (a request's blocks back to the pool). Hashes live on the
request, so they survive preemption, as on vLLM's Request. A request's blocks are hashed as its
tokens arrive (`add_request`, `append_tokens`, the batched `append_token_step`: `_append`, with
kv_cache_utils' request block hasher), so the table keeps only the tokens of each unfilled last
block; a block is cached when the allocation that schedules its last token runs.

The decode step's two batched calls, `append_token_step` and `allocate_step`, are a fixed
number of vector operations for any number of requests: no loop over requests or blocks, so
they run inside the engine's device decode loop as a handful of kernels. `allocate_slots` is
the one-request statement of vLLM's rule; `allocate_step` equals calling it for each request
in order up to the first refusal (tests/core/test_kv_cache_manager.py checks that).

Every operation is `state -> state` (plus an `ok` flag where it can fail) and is jitted with
the sizes static; a failure returns the state unchanged.

Axes: the kvjax package docstring's legend; here B is the requests of one batched call and T
the token ids a call is handed.
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
from kvjax.errors import KvjaxError, check_int, require
from kvjax.math_utils import cdiv


class PoolRefusedError(RuntimeError):
    """The pool refused an operation that its caller's own bookkeeping said must succeed: a bug
    in kvjax, never bad input (which the operations report through their `ok` flags)."""


@struct.dataclass
class Requests:
    """The request table: one row per request slot."""

    block_size: int = struct.field(pytree_node=False)  # Z tokens per block
    max_requests: int = struct.field(pytree_node=False)  # R request slots
    max_blocks_per_request: int = struct.field(pytree_node=False)  # M; a request holds <= M*Z tokens
    active: jax.Array  # bool[R] slot holds a request
    tail: jax.Array  # i32[R, Z] the tokens of each request's unfilled last block (num_tokens % Z), 0-padded
    num_tokens: jax.Array  # i32[R]
    has_salt: jax.Array  # bool[R] first block's hash mixes in a cache salt
    salt: jax.Array  # u32[R, 2] the salt key (hashing.salt_key)
    req_hash: jax.Array  # u32[R, M, 2] chained hash of each FULL block of the request's tokens
    num_hashed: jax.Array  # i32[R] = num_tokens // Z when caching is on, else 0
    block_table: jax.Array  # i32[R, M] physical block of each logical block; 0 (null) = unused
    num_held: jax.Array  # i32[R] leading table entries in use
    num_computed: jax.Array  # i32[R] tokens computed or scheduled (vLLM's num_computed_tokens)
    num_cached: jax.Array  # i32[R] leading blocks already cached for this request


@struct.dataclass
class KVCacheManager:
    """The allocator's whole state: the block pool and the request table."""

    prefix_caching: bool = struct.field(pytree_node=False)  # off: no hashes, no hits
    pool: BlockPool
    reqs: Requests


def init(num_blocks: int, block_size: int, max_requests: int,
         max_blocks_per_request: int | None = None, prefix_caching: bool = True) -> KVCacheManager:
    """A fresh pool (every usable block free, in id order) and an empty request table.
    max_blocks_per_request defaults to num_blocks - 1 (no request can hold more)."""
    pool = block_pool.init(num_blocks)
    return KVCacheManager(prefix_caching=bool(prefix_caching), pool=pool,
                          reqs=request_table(block_size, max_requests,
                                             num_blocks - 1 if max_blocks_per_request is None
                                             else max_blocks_per_request))


def request_table(block_size: int, max_requests: int, max_blocks_per_request: int) -> Requests:
    """An empty request table of R slots."""
    z = check_int(block_size, "block_size", 1, None)
    r = check_int(max_requests, "max_requests", 1, None)
    m = check_int(max_blocks_per_request, "max_blocks_per_request", 1, None)
    if m * z >= 2**31:
        raise KvjaxError(f"max_blocks_per_request * block_size = {m * z} overflows int32 token positions")
    i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
    return Requests(block_size=z, max_requests=r, max_blocks_per_request=m, active=jnp.zeros(r, bool),
                    tail=i32((r, z)), num_tokens=i32(r), has_salt=jnp.zeros(r, bool),
                    salt=jnp.zeros((r, 2), jnp.uint32), req_hash=jnp.zeros((r, m, 2), jnp.uint32),
                    num_hashed=i32(r), block_table=i32((r, m)), num_held=i32(r), num_computed=i32(r), num_cached=i32(r))


def _slot(t: Requests, req):
    """(valid, clipped slot) for a request slot index."""
    return (req >= 0) & (req < t.max_requests), jnp.clip(req, 0, t.max_requests - 1)


def _append(state: KVCacheManager, rows, tokens, n, max_new: int | None = None) -> KVCacheManager:
    """Append tokens[b, :n[b]] (i32[B, T]) after the tokens of request slots rows (i32[B],
    distinct; None: every slot, in order), then hash the blocks they fill; each row keeps its
    unfilled block (`tail`). A request's tokens are its owner's, the scheduler's Request: a full
    block lives on here as its hash."""
    t = state.reqs
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
    if state.prefix_caching:
        t = hashing.extend_request_hashes(t, rows, filled, max_new)
    return state.replace(reqs=t)


def _tokens_ok(t: Requests, r, tokens, n):
    """n tokens (of tokens i32[T]) fit in slot r's row and are valid ids (>= 0)."""
    idx = jnp.arange(tokens.shape[0])
    room = t.max_blocks_per_request * t.block_size - t.num_tokens[r]
    return (n >= 0) & (n <= tokens.shape[0]) & (n <= room) & ~((idx < n) & (tokens < 0)).any()


@jax.jit
def add_request(state: KVCacheManager, req, tokens, num_tokens, has_salt=False, salt=None):
    """Put a new request (its prompt tokens[:num_tokens], i32[T]) in the free slot req and
    hash its full blocks; salt (u32[2], from hashing.salt_key) enters the first block's
    hash when has_salt. Allocates nothing. Fails if the slot is taken, the prompt is empty
    or longer than M*Z tokens, or a token id is negative. -> (state, ok)."""
    t = state.reqs
    valid, r = _slot(t, req)
    ok = valid & ~t.active[r] & (num_tokens >= 1) & _tokens_ok(t, r, tokens, num_tokens)
    salt = jnp.zeros(2, jnp.uint32) if salt is None else jnp.asarray(salt, jnp.uint32)

    def do(s):
        q = s.reqs
        s = s.replace(reqs=q.replace(active=q.active.at[r].set(True), has_salt=q.has_salt.at[r].set(has_salt),
                                     salt=q.salt.at[r].set(salt)))
        return _append(s, r[None], tokens[None], jnp.asarray(num_tokens, jnp.int32)[None])

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def append_tokens(state: KVCacheManager, req, tokens, n):
    """Append tokens[:n] (i32[T]) to active request req (sampled or user tokens) and hash
    blocks they fill. Allocates nothing. -> (state, ok)."""
    valid, r = _slot(state.reqs, req)
    ok = valid & state.reqs.active[r] & _tokens_ok(state.reqs, r, tokens, n)
    do = lambda s: _append(s, r[None], tokens[None], jnp.asarray(n, jnp.int32)[None])  # noqa: E731
    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def append_token_step(state: KVCacheManager, tokens, mask):
    """Batched single-token append (the sampled token of a decode step) over all request
    slots. tokens: i32[R]; mask: bool[R]. Hashes the block each token completes.
    -> (state, ok bool[R]); a full or inactive slot, or a negative id, fails alone."""
    t = state.reqs
    ok = mask & t.active & (t.num_tokens < t.max_blocks_per_request * t.block_size) & (tokens >= 0)
    return _append(state, None, tokens[:, None], ok.astype(jnp.int32), max_new=1), ok


@jax.jit
def get_computed_blocks(state: KVCacheManager, req):
    """vLLM's get_computed_blocks: the longest run of the request's leading full blocks
    whose hashes are cached, capped at (num_tokens - 1) // Z blocks so the last prompt token
    is always recomputed (its logits are needed). No hits with caching off. A pure query.
    -> (hit_blocks i32[M] 0-padded, num_hits i32[])."""
    t = state.reqs
    m = t.max_blocks_per_request
    if not state.prefix_caching:
        return jnp.zeros(m, jnp.int32), jnp.int32(0)
    valid, r = _slot(t, req)
    block, found = block_pool.lookup(state.pool, t.req_hash[r])
    max_hits = jnp.where(valid, jnp.minimum(t.num_hashed[r], hashing.max_cached_blocks(t.num_tokens[r], t.block_size)),
                         0)
    run = jnp.cumprod(found & (jnp.arange(m) < max_hits)).astype(bool)
    return jnp.where(run, block, 0).astype(jnp.int32), run.sum().astype(jnp.int32)


def blocks_needed(state: KVCacheManager, reqs, num_new, num_hits=0):
    """New blocks request slots reqs must take to hold num_new more tokens after their computed
    ones (and num_hits prefix-hit blocks on a first allocation): cdiv(computed + hits × Z + new,
    Z) − held − hits, at least 0 (vLLM `KVCacheManager.allocate_slots`' num_blocks_to_allocate).
    The one statement of the rule: `allocate_slots`, `allocate_step` and `step_fits` use it."""
    t = state.reqs
    r = jnp.clip(reqs, 0, t.max_requests - 1)
    total = t.num_computed[r] + num_hits * t.block_size + num_new
    return jnp.maximum(cdiv(total, t.block_size) - t.num_held[r] - num_hits, 0)


def _can_grow(state: KVCacheManager, reqs, num_new, num_hits=0):
    """The per-request conditions of allocate_slots, apart from free blocks. bool like reqs."""
    t = state.reqs
    valid, r = _slot(t, reqs)
    total = t.num_computed[r] + num_hits * t.block_size + num_new
    return (valid & t.active[r] & (num_new >= 0) & (total <= t.num_tokens[r])
            & (cdiv(total, t.block_size) <= t.max_blocks_per_request))


def _grant(state: KVCacheManager, reqs, num_new, ok) -> KVCacheManager:
    """Give each request reqs[b] with ok[b] (distinct slots) room for num_new[b] more tokens:
    new blocks from the pool's head in request order, then cache every block that became full."""
    t, z, m = state.reqs, state.reqs.block_size, state.reqs.max_blocks_per_request
    r = jnp.clip(reqs, 0, t.max_requests - 1)
    held, total = t.num_held[r], t.num_computed[r] + num_new
    need = jnp.where(ok, blocks_needed(state, reqs, num_new), 0)
    at = jnp.where(ok, r, t.max_requests)  # refused rows scatter out of range
    j = jnp.arange(m)[None, :]

    def take(s):  # the new blocks go to table positions held .. held + need - 1
        pool, order, starts = block_pool.take(s.pool, need)
        fresh = (j >= held[:, None]) & (j < (held + need)[:, None])
        rows = jnp.where(fresh, order[jnp.clip(starts[:, None] + j - held[:, None], 0, pool.num_blocks - 1)],
                         s.reqs.block_table[r])  # i32[B, M]
        return s.replace(pool=pool, reqs=s.reqs.replace(block_table=s.reqs.block_table.at[at].set(rows, mode="drop")))

    # Most decode steps take no block and fill none (one in Z does): skip those parts then.
    state = jax.lax.cond(need.any(), take, lambda s: s, state)
    t = state.reqs.replace(num_held=state.reqs.num_held.at[at].set(held + need, mode="drop"),
                           num_computed=state.reqs.num_computed.at[at].set(total, mode="drop"))
    if not state.prefix_caching:
        return state.replace(reqs=t)
    # vLLM cache_full_blocks: blocks num_cached .. full - 1, never past the held ones
    full = jnp.minimum(jnp.minimum(total // z, t.num_hashed[r]), held + need)
    cached = t.num_cached[r]
    count = jnp.where(ok, jnp.maximum(full - cached, 0), 0)  # each row's run of newly full blocks

    def cache(pool):
        newly = ok[:, None] & (j >= cached[:, None]) & (j < full[:, None])  # bool[B, M]
        rank = (jnp.cumsum(count) - count)[:, None] + j - cached[:, None]  # caching order: rows, then blocks
        return block_pool.cache(pool, t.block_table[r].reshape(-1), t.req_hash[r].reshape(-1, 2),
                                newly.reshape(-1), rank.reshape(-1).astype(jnp.int32))

    pool = jax.lax.cond(count.any(), cache, lambda p: p, state.pool)
    return state.replace(pool=pool, reqs=t.replace(num_cached=t.num_cached.at[at].max(full, mode="drop")))


@jax.jit
def allocate_slots(state: KVCacheManager, req, num_new_tokens, hit_blocks=None, num_hits=0):
    """vLLM's allocate_slots: make room for num_new_tokens more tokens of request req after
    its computed ones, taking hit_blocks[:num_hits] (from get_computed_blocks; only on the
    first allocation) as already computed. Needs cdiv(computed + hits*Z + new, Z) - held -
    num_hits new blocks, plus one free slot per ref_cnt-0 hit. All or nothing: on failure no
    block is touched, popped or evicted. Advances num_computed and caches every block that
    became full. -> (state, ok)."""
    t, z, m = state.reqs, state.reqs.block_size, state.reqs.max_blocks_per_request
    hits = jnp.zeros(m, jnp.int32) if hit_blocks is None else hit_blocks
    _, r = _slot(t, req)
    is_hit = jnp.arange(m) < num_hits
    # A hit block nobody holds sits in the free queue: touching it takes it out, so it uses
    # free capacity exactly like a new block.
    evictable = (is_hit & (state.pool.ref_cnt[hits] == 0)).sum()
    first_alloc = (t.num_held[r] == 0) & (t.num_computed[r] == 0)
    ok = (_can_grow(state, req, num_new_tokens, num_hits) & (num_hits >= 0) & (num_hits <= m)
          & ((num_hits == 0) | (first_alloc & state.prefix_caching))
          & (blocks_needed(state, req, num_new_tokens, num_hits) + evictable <= state.pool.num_free))

    def take_hits(s):  # a first allocation: the hits head the table, touched, computed and cached
        q = s.reqs
        return s.replace(pool=block_pool.touch(s.pool, hits, is_hit), reqs=q.replace(
            block_table=q.block_table.at[r].set(jnp.where(is_hit, hits, q.block_table[r])),
            num_held=q.num_held.at[r].set(num_hits), num_computed=q.num_computed.at[r].set(num_hits * z),
            num_cached=q.num_cached.at[r].max(num_hits)))

    def do(s):
        s = jax.lax.cond(num_hits > 0, take_hits, lambda s: s, s)
        return _grant(s, r[None], jnp.asarray(num_new_tokens, jnp.int32)[None], jnp.ones(1, bool))

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def step_fits(state: KVCacheManager, reqs, num_new):
    """Whether one step's allocation for several requests fits the free queue as a whole.

    reqs: i32[B] request slots, -1 = none; num_new: i32[B] tokens each. -> (blocks needed
    i32[B], fits bool[]). The host scheduler asks this before allocating its running requests,
    and the device decode loop (kvjax.engine.core) before each of its steps, so both decide by the
    same rule; when it fits, `allocate_step` must succeed for every request."""
    need = jnp.where(reqs >= 0, blocks_needed(state, reqs, num_new), 0).astype(jnp.int32)
    return need, need.sum() <= state.pool.num_free


@jax.jit
def allocate_step(state: KVCacheManager, reqs, num_new):
    """Batched allocate_slots without hits (the scheduler's running requests; a decode step).

    reqs: i32[B] request slots served in this order, -1 = skip; num_new: i32[B] tokens each.
    Equals allocate_slots for each request in order up to the first refusal; the requests
    after it are not attempted (the scheduler preempts, then resumes from the refused one,
    as vLLM's does). A slot listed twice is refused at its second place. -> (state, ok bool[B])."""
    present, r = reqs >= 0, state.reqs.max_requests
    b = jnp.arange(reqs.shape[0])
    at = jnp.where(present, reqs, r)  # out of range (not -1, which indexes from the end): dropped
    first = jnp.full(r, reqs.shape[0]).at[at].min(b, mode="drop")  # each slot's first place in the batch
    repeated = present & (first.at[at].get(mode="fill", fill_value=-1) != b)
    can = _can_grow(state, reqs, num_new) & ~repeated
    need = jnp.where(can, blocks_needed(state, reqs, num_new), 0)
    can &= jnp.cumsum(need) <= state.pool.num_free  # every request before it was granted its blocks
    ok = can & (jnp.cumsum(present & ~can) == 0)  # nothing after the first refusal
    return _grant(state, reqs, num_new, ok), ok


@jax.jit
def free(state: KVCacheManager, req):
    """vLLM's kv_cache_manager.free: release all the request's blocks (reverse order) and
    reset its block table, computed and cached counts. Its tokens and block hashes stay, so
    a preempted request can later hit its own cached prefix. -> (state, ok)."""
    valid, r = _slot(state.reqs, req)
    ok = valid & state.reqs.active[r]

    def do(s):
        q = s.reqs
        return s.replace(pool=block_pool.release(s.pool, q.block_table[r], q.num_held[r]), reqs=q.replace(
            block_table=q.block_table.at[r].set(0), num_held=q.num_held.at[r].set(0),
            num_computed=q.num_computed.at[r].set(0), num_cached=q.num_cached.at[r].set(0)))

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def remove_request(state: KVCacheManager, req):
    """Forget a finished request (after `free`): clear its slot. Fails if it holds blocks.
    -> (state, ok)."""
    valid, r = _slot(state.reqs, req)
    ok = valid & state.reqs.active[r] & (state.reqs.num_held[r] == 0)

    def do(s):
        q = s.reqs
        return s.replace(reqs=q.replace(
            active=q.active.at[r].set(False), tail=q.tail.at[r].set(0), num_tokens=q.num_tokens.at[r].set(0),
            has_salt=q.has_salt.at[r].set(False), salt=q.salt.at[r].set(0), req_hash=q.req_hash.at[r].set(0),
            num_hashed=q.num_hashed.at[r].set(0)))

    return jax.lax.cond(ok, do, lambda s: s, state), ok


def reset_prefix_cache(state: KVCacheManager):
    """block_pool.reset_prefix_cache on the manager's pool. -> (state, ok)."""
    pool, ok = block_pool.reset_prefix_cache(state.pool)
    return state.replace(pool=pool), ok


# ----------------------------------------------------------------------------- host views
def request_blocks(state: KVCacheManager, req: int) -> list[int]:
    """The request's block table (host side)."""
    t = state.reqs
    return [int(b) for b in np.asarray(t.block_table[req])[: int(t.num_held[req])]]


def check_invariants(state: KVCacheManager) -> None:
    """The pool's invariants plus the tables': raise AssertionError naming the likely cause."""
    s = jax.device_get(state)
    block_pool.check_invariants(s.pool)
    t, p = s.reqs, s.pool.num_blocks
    counts = np.zeros(p, np.int64)
    where: dict[int, set[int]] = {}
    for r in range(t.max_requests):
        for j, b in enumerate(t.block_table[r, : t.num_held[r]]):
            require(b != block_pool.NULL_BLOCK, f"request slot {r} maps logical block {j} to the null block")
            counts[b] += 1
            where.setdefault(int(b), set()).add(j)
    require((counts == s.pool.ref_cnt).all(),
            f"ref_cnt != table occurrences at blocks {np.nonzero(counts != s.pool.ref_cnt)[0]}: "
            "a touch or release was skipped")
    for b, js in where.items():
        require(counts[b] == 1 or (s.pool.has_hash[b] and len(js) == 1),
                f"block {b} is in {counts[b]} tables at positions {sorted(js)} but is not a "
                "cached prefix block: two requests got the same new block")
