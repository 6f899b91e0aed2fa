"""The functional KV block pool: vLLM V1's allocator as pure functions over a pytree.

Reproduces vLLM V1 `core/block_pool.py` (BlockPool), the free queue of
`core/kv_cache_utils.py` (FreeKVCacheBlockQueue) and the per-request bookkeeping of
`core/kv_cache_manager.py` (get_computed_blocks / allocate_slots / free), with the
free-queue rules of kvjax issue 3 (where those differ from a vLLM release, the issue wins):

* Block 0 is the null block: never in the free queue, never allocated, freed, touched or
  cached. The free queue starts as blocks 1..P-1 in id order.
* Allocation pops from the HEAD of the free queue. A popped block that still holds a hash
  is evicted from the prefix cache (hash cleared) as it is taken: one queue serves both
  free blocks and LRU eviction, there is no eviction thread.
* `touch` (a prefix hit) removes a ref_cnt-0 block from wherever it sits in the queue.
  The queue is a doubly linked list in two arrays (`next`, `prev`) with sentinels
  HEAD = P and TAIL = P + 1, so that removal is O(1), as in vLLM.
* `free` releases a request's blocks in REVERSE order (last block first). Blocks reaching
  ref_cnt 0 WITHOUT a hash go to the HEAD, keeping that reversed order (first released is
  first reused); blocks WITH a hash are appended at the TAIL in that order, so a request's
  tail blocks are evicted before its prefix blocks, which other prompts are likelier to share.
* A FULL block is cached (hash set) as soon as its last token is scheduled. Identical hashes
  are not de-duplicated (vLLM keeps block tables append-only), so several blocks may hold
  one hash; a lookup returns the one cached EARLIEST (`cached_at`), like the first entry of
  vLLM's insertion-ordered `{hash: {block_id: block}}`.
* The hash -> block map is a vectorized compare of a request's hashes with the per-block
  hash array: O(M * P) work, but one branch-free vector op with no probe loops, tombstones
  or resizing, and "several blocks per hash" comes for free. Open addressing would be O(1)
  per lookup but needs a while_loop per probe and tombstones on eviction; at kvjax's pool
  sizes (<= 1e5 blocks) the compare wins on simplicity. Hash and collision odds:
  `kvjax/hashing.py`.

Every operation is `state -> state` (plus an `ok` flag where it can fail) and is jitted
with the sizes static; a failure returns the state unchanged. Loops over blocks are
`lax.fori_loop`s bounded by static sizes, so the decode-step allocation (`allocate_step`,
`append_token_step`) can run inside `lax.scan` with no host round trip.

Axis legend: P blocks (incl. the null block), Z tokens per block, R request slots,
M blocks per request (table width), B requests in a batched call, L tokens passed in.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import hashing
from kvjax.budget import cdiv
from kvjax.errors import KvjaxError

NULL_BLOCK = 0
_NEVER = np.iinfo(np.int32).max  # cached_at of a block holding no hash


class PoolRefusedError(RuntimeError):
    """The pool refused an operation that its caller's own bookkeeping said must succeed: a bug
    in kvjax, never bad input (which the operations report through their `ok` flags)."""


@struct.dataclass
class PoolState:
    """The whole allocator: blocks, the free queue, and the request table."""

    num_blocks: int = struct.field(pytree_node=False)  # P, including null block 0
    block_size: int = struct.field(pytree_node=False)  # Z tokens per block
    max_requests: int = struct.field(pytree_node=False)  # R request slots
    max_blocks_per_request: int = struct.field(pytree_node=False)  # M; a request holds <= M*Z tokens
    prefix_caching: bool = struct.field(pytree_node=False)  # off: no hashes, no hits

    # --- blocks
    ref_cnt: jax.Array  # i32[P] block tables pointing at the block; 0 = in the free queue
    block_hash: jax.Array  # u32[P, 2] chained hash (two 32-bit lanes); 0 when has_hash is False
    has_hash: jax.Array  # bool[P] block is in the prefix cache (full, hashed, not yet evicted)
    cached_at: jax.Array  # i32[P] cache_clock when hashed; picks among equal hashes (oldest wins)
    cache_clock: jax.Array  # i32[] count of blocks ever cached (insertion order of vLLM's dict)
    # --- free queue: doubly linked list; HEAD = P and TAIL = P + 1 are sentinels, -1 = unlinked
    next: jax.Array  # i32[P + 2] successor of each node (HEAD's is the first free block)
    prev: jax.Array  # i32[P + 2] predecessor (TAIL's is the last free block)
    num_free: jax.Array  # i32[] blocks in the queue (free or evictable cached)
    # --- requests (slot r); hashes live here so they survive preemption, as on vLLM's Request
    active: jax.Array  # bool[R] slot holds a request
    tokens: jax.Array  # i32[R, M*Z] all known token ids (prompt + generated), 0-padded
    num_tokens: jax.Array  # i32[R]
    has_salt: jax.Array  # bool[R] first block's hash mixes in a cache salt
    salt: jax.Array  # u32[R, 2] the salt key (hashing.salt_key)
    req_hash: jax.Array  # u32[R, M, 2] chained hash of each FULL block of the request's tokens
    num_hashed: jax.Array  # i32[R] = num_tokens // Z when caching is on, else 0
    block_table: jax.Array  # i32[R, M] physical block of each logical block; 0 (null) = unused
    num_held: jax.Array  # i32[R] leading table entries in use
    num_computed: jax.Array  # i32[R] tokens computed or scheduled (vLLM's num_computed_tokens)
    num_cached: jax.Array  # i32[R] leading blocks already cached for this request

    @property
    def head(self) -> int:
        return self.num_blocks

    @property
    def tail(self) -> int:
        return self.num_blocks + 1


def init(num_blocks: int, block_size: int, max_requests: int,
         max_blocks_per_request: int | None = None, prefix_caching: bool = True) -> PoolState:
    """A fresh pool: every usable block free, in id order; no requests.

    max_blocks_per_request defaults to num_blocks - 1 (no request can hold more)."""
    if max_blocks_per_request is None:
        max_blocks_per_request = num_blocks - 1
    for name, v, lo, why in (("num_blocks", num_blocks, 2, " (block 0 is the null block)"),
                             ("block_size", block_size, 1, ""), ("max_requests", max_requests, 1, ""),
                             ("max_blocks_per_request", max_blocks_per_request, 1, "")):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise KvjaxError(f"{name} must be an int >= {lo}{why}, got {v!r}")
    if max_blocks_per_request * block_size >= 2**31:
        raise KvjaxError(f"max_blocks_per_request * block_size = {max_blocks_per_request * block_size}"
                         " overflows int32 token positions")
    p, r, m, z = int(num_blocks), int(max_requests), int(max_blocks_per_request), int(block_size)
    ids = np.arange(p + 2, dtype=np.int32)
    nxt, prv = ids + 1, ids - 1  # 1 -> 2 -> ... -> P-1, then patch the ends to the sentinels
    nxt[p - 1], prv[1] = p + 1, p
    nxt[p], prv[p + 1] = 1, p - 1
    nxt[[0, p + 1]] = -1
    prv[[0, p]] = -1
    i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
    return PoolState(
        num_blocks=p, block_size=z, max_requests=r, max_blocks_per_request=m,
        prefix_caching=bool(prefix_caching),
        ref_cnt=i32(p), block_hash=jnp.zeros((p, 2), jnp.uint32), has_hash=jnp.zeros(p, bool),
        cached_at=jnp.full(p, _NEVER, jnp.int32), cache_clock=i32(()),
        next=jnp.asarray(nxt), prev=jnp.asarray(prv), num_free=jnp.asarray(p - 1, jnp.int32),
        active=jnp.zeros(r, bool), tokens=i32((r, m * z)), num_tokens=i32(r),
        has_salt=jnp.zeros(r, bool), salt=jnp.zeros((r, 2), jnp.uint32),
        req_hash=jnp.zeros((r, m, 2), jnp.uint32), num_hashed=i32(r),
        block_table=i32((r, m)), num_held=i32(r), num_computed=i32(r), num_cached=i32(r))




def _valid_req(state: PoolState, req):
    return (req >= 0) & (req < state.max_requests)


# ----------------------------------------------------------------------------- free queue
def _unlink(nxt, prv, b):
    """Remove node b from the list in O(1)."""
    p, n = prv[b], nxt[b]
    return nxt.at[p].set(n).at[b].set(-1), prv.at[n].set(p).at[b].set(-1)


def _link_after(nxt, prv, a, b):
    """Insert node b right after node a (a may be the HEAD sentinel)."""
    n = nxt[a]
    return nxt.at[a].set(b).at[b].set(n), prv.at[n].set(b).at[b].set(a)


def _pop_into_row(state: PoolState, row, start, n):
    """Pop n blocks from the HEAD into row[start:start+n]; evict any hash they hold.
    row: i32[K]. The caller has checked n <= num_free."""

    def body(i, c):
        nxt, prv, ref, bh, hh, at, row = c
        b = nxt[state.head]
        nxt, prv = _unlink(nxt, prv, b)
        # A cached block taken for reuse loses its hash: this IS the LRU eviction.
        bh, hh, at = bh.at[b].set(0), hh.at[b].set(False), at.at[b].set(_NEVER)
        return nxt, prv, ref.at[b].set(1), bh, hh, at, row.at[start + i].set(b)

    c = (state.next, state.prev, state.ref_cnt, state.block_hash, state.has_hash,
         state.cached_at, row)
    nxt, prv, ref, bh, hh, at, row = jax.lax.fori_loop(0, n, body, c)
    state = state.replace(next=nxt, prev=prv, ref_cnt=ref, block_hash=bh, has_hash=hh,
                          cached_at=at, num_free=state.num_free - n)
    return state, row


def _touch(state: PoolState, blocks, count):
    """ref_cnt += 1 for blocks[:count]; a ref_cnt-0 block leaves the free queue first."""

    def body(i, c):
        nxt, prv, ref, nfree = c
        b = blocks[i]
        was_free = ref[b] == 0
        nxt, prv = jax.lax.cond(was_free, lambda: _unlink(nxt, prv, b), lambda: (nxt, prv))
        return nxt, prv, ref.at[b].add(1), nfree - was_free.astype(jnp.int32)

    c = (state.next, state.prev, state.ref_cnt, state.num_free)
    nxt, prv, ref, nfree = jax.lax.fori_loop(0, count, body, c)
    return state.replace(next=nxt, prev=prv, ref_cnt=ref, num_free=nfree)


def _release(state: PoolState, blocks, count):
    """Release blocks[count-1], ..., blocks[0] (reverse order) per the module docstring."""

    def body(k, c):
        nxt, prv, ref, nfree, insert_at = c
        b = blocks[count - 1 - k]
        rc = ref[b] - 1
        hashed = state.has_hash[b]
        # Hashed blocks go to the tail (LRU); unhashed ones after the previous unhashed one
        # released by this call, so the head reads in release order.
        anchor = jnp.where(hashed, prv[state.tail], insert_at)
        nxt, prv = jax.lax.cond(rc == 0, lambda: _link_after(nxt, prv, anchor, b),
                                lambda: (nxt, prv))
        insert_at = jnp.where((rc == 0) & ~hashed, b, insert_at)
        return nxt, prv, ref.at[b].set(rc), nfree + (rc == 0).astype(jnp.int32), insert_at

    c = (state.next, state.prev, state.ref_cnt, state.num_free, jnp.int32(state.head))
    nxt, prv, ref, nfree, _ = jax.lax.fori_loop(0, count, body, c)
    return state.replace(next=nxt, prev=prv, ref_cnt=ref, num_free=nfree)


@functools.partial(jax.jit, static_argnames="max_n")
def get_new_blocks(state: PoolState, n, max_n: int):
    """Pop n blocks from the HEAD (ref_cnt -> 1, hashes evicted).
    -> (state, blocks i32[max_n] 0-padded, ok); fails if n > num_free or n > max_n."""
    ok = (n >= 0) & (n <= state.num_free) & (n <= max_n)
    new, row = _pop_into_row(state, jnp.zeros(max_n, jnp.int32), 0, jnp.where(ok, n, 0))
    return new, row, ok


@jax.jit
def touch(state: PoolState, blocks, count):
    """ref_cnt += 1 for blocks[:count] (i32[K]), taking ref_cnt-0 ones out of the queue.
    The null block is never touched: the call fails (ok False) if any block is 0 or out of
    range. -> (state, ok)."""
    idx = jnp.arange(blocks.shape[0])
    bad = (idx < count) & ((blocks <= NULL_BLOCK) | (blocks >= state.num_blocks))
    ok = (count >= 0) & (count <= blocks.shape[0]) & ~bad.any()
    return jax.lax.cond(ok, lambda s: _touch(s, blocks, count), lambda s: s, state), ok


# ----------------------------------------------------------------------------- requests
def _extend_hashes(state: PoolState, req):
    """Hash request req's blocks that became full since the last call (chained)."""
    if not state.prefix_caching:  # vLLM computes block hashes only with caching enabled
        return state
    z = state.block_size
    row = state.tokens[req]  # i32[M*Z]

    def body(j, hashes):
        parent = jnp.where(j > 0, hashes[jnp.maximum(j - 1, 0)], jnp.zeros(2, jnp.uint32))
        toks = jax.lax.dynamic_slice(row, (j * z,), (z,))
        first = j == 0
        h = hashing.block_hash_jnp(parent, toks, first & state.has_salt[req],
                                   jnp.where(first, state.salt[req], jnp.uint32(0)))
        return hashes.at[j].set(h)

    full = state.num_tokens[req] // z
    hashes = jax.lax.fori_loop(state.num_hashed[req], full, body, state.req_hash[req])
    return state.replace(req_hash=state.req_hash.at[req].set(hashes),
                         num_hashed=state.num_hashed.at[req].set(full))


def _write_tokens(state: PoolState, req, tokens, n):
    """Append tokens[:n] (i32[L]) after the request's current tokens."""
    mz = state.max_blocks_per_request * state.block_size
    idx = jnp.arange(tokens.shape[0])
    pos = jnp.where(idx < n, state.num_tokens[req] + idx, mz)  # mz is out of range: dropped
    row = state.tokens[req].at[pos].set(tokens, mode="drop")
    return state.replace(tokens=state.tokens.at[req].set(row),
                         num_tokens=state.num_tokens.at[req].add(n))


def _tokens_ok(state: PoolState, req, tokens, n):
    """n tokens fit in the request's row and are valid ids (>= 0)."""
    idx = jnp.arange(tokens.shape[0])
    room = state.max_blocks_per_request * state.block_size - state.num_tokens[req]
    return (n >= 0) & (n <= tokens.shape[0]) & (n <= room) & ~((idx < n) & (tokens < 0)).any()


@jax.jit
def add_request(state: PoolState, req, tokens, num_tokens, has_salt=False, salt=None):
    """Put a new request (its prompt tokens[:num_tokens], i32[L]) in the free slot req and
    hash its full blocks; salt (u32[2], from hashing.salt_key) enters the first block's
    hash when has_salt. Allocates nothing. Fails if the slot is taken, the prompt is empty
    or longer than M*Z tokens, or a token id is negative. -> (state, ok)."""
    r = jnp.clip(req, 0, state.max_requests - 1)
    ok = _valid_req(state, req) & ~state.active[r] & (num_tokens >= 1)
    ok &= _tokens_ok(state, r, tokens, num_tokens)
    salt = jnp.zeros(2, jnp.uint32) if salt is None else jnp.asarray(salt, jnp.uint32)

    def do(s):
        s = s.replace(active=s.active.at[r].set(True), has_salt=s.has_salt.at[r].set(has_salt),
                      salt=s.salt.at[r].set(salt))
        return _extend_hashes(_write_tokens(s, r, tokens, num_tokens), r)

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def append_tokens(state: PoolState, req, tokens, n):
    """Append tokens[:n] (i32[L]) to active request req (sampled or user tokens) and hash
    blocks they fill. Allocates nothing. -> (state, ok)."""
    r = jnp.clip(req, 0, state.max_requests - 1)
    ok = _valid_req(state, req) & state.active[r] & _tokens_ok(state, r, tokens, n)
    do = lambda s: _extend_hashes(_write_tokens(s, r, tokens, n), r)  # noqa: E731
    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def get_computed_blocks(state: PoolState, req):
    """vLLM's get_computed_blocks: the longest run of the request's leading full blocks
    whose hashes are cached, capped at (num_tokens - 1) // Z blocks so the last prompt token
    is always recomputed (its logits are needed). No hits with caching off. A pure query.
    -> (hit_blocks i32[M] 0-padded, num_hits i32[])."""
    m = state.max_blocks_per_request
    if not state.prefix_caching:
        return jnp.zeros(m, jnp.int32), jnp.int32(0)
    h = state.req_hash[req]  # u32[M, 2]
    match = (state.has_hash[None, :]  # bool[M, P]: block p holds the hash of logical block j
             & (state.block_hash[None, :, 0] == h[:, None, 0])
             & (state.block_hash[None, :, 1] == h[:, None, 1]))
    block = jnp.argmin(jnp.where(match, state.cached_at[None, :], _NEVER), axis=1)  # oldest
    max_hits = jnp.minimum(state.num_hashed[req], (state.num_tokens[req] - 1) // state.block_size)
    max_hits = jnp.where(_valid_req(state, req), max_hits, 0)
    run = jnp.cumprod(match.any(axis=1) & (jnp.arange(m) < max_hits)).astype(bool)
    hits = jnp.where(run, block, 0).astype(jnp.int32)
    return hits, run.sum().astype(jnp.int32)


def _cache_full_blocks(state: PoolState, req, num_tokens):
    """Give the request's blocks that are full within its first num_tokens tokens their
    hash (vLLM cache_full_blocks): blocks num_cached .. num_tokens // Z - 1."""
    if not state.prefix_caching:
        return state
    # Never past the held blocks: unused table entries point at the null block.
    full = jnp.minimum(jnp.minimum(num_tokens // state.block_size, state.num_hashed[req]),
                       state.num_held[req])

    def body(j, c):
        bh, hh, at, clock = c
        b = state.block_table[req, j]
        return (bh.at[b].set(state.req_hash[req, j]), hh.at[b].set(True), at.at[b].set(clock),
                clock + 1)

    c = (state.block_hash, state.has_hash, state.cached_at, state.cache_clock)
    bh, hh, at, clock = jax.lax.fori_loop(state.num_cached[req], full, body, c)
    return state.replace(block_hash=bh, has_hash=hh, cached_at=at, cache_clock=clock,
                         num_cached=state.num_cached.at[req].max(full))


def blocks_needed(state: PoolState, req, num_new, num_hits=0):
    """New blocks request slot req must take to hold num_new more tokens after its computed ones
    (and num_hits prefix-hit blocks on a first allocation): cdiv(computed + hits × Z + new, Z)
    − held − hits, at least 0 (vLLM `KVCacheManager.allocate_slots`' num_blocks_to_allocate).
    The one statement of the rule: `allocate_slots`, `allocate_step` and `step_fits` use it."""
    r = jnp.clip(req, 0, state.max_requests - 1)
    total = state.num_computed[r] + num_hits * state.block_size + num_new
    return jnp.maximum(cdiv(total, state.block_size) - state.num_held[r] - num_hits, 0)


@jax.jit
def step_fits(state: PoolState, reqs, num_new):
    """Whether one step's allocation for several requests fits the free queue as a whole.

    reqs: i32[B] request slots, -1 = none; num_new: i32[B] tokens each. -> (blocks needed
    i32[B], fits bool[]). The host scheduler asks this before allocating its running requests,
    and the device decode loop (kvjax.engine) before each of its steps, so both decide by the
    same rule; when it fits, `allocate_step` must succeed for every request."""
    need = jax.vmap(lambda r, n: blocks_needed(state, r, n))(reqs, num_new)
    need = jnp.where(reqs >= 0, need, 0).astype(jnp.int32)
    return need, need.sum() <= state.num_free


def _allocate(state: PoolState, req, num_new, hits, num_hits, enabled=True):
    """allocate_slots for one request; shared by the single and batched forms."""
    z, m = state.block_size, state.max_blocks_per_request
    r = jnp.clip(req, 0, state.max_requests - 1)
    held, computed = state.num_held[r], state.num_computed[r]
    total = computed + num_hits * z + num_new  # tokens computed once this step runs
    need = cdiv(total, z)
    num_new_blocks = blocks_needed(state, req, num_new, num_hits)
    is_hit = jnp.arange(m) < num_hits
    # A hit block nobody holds sits in the free queue: touching it takes it out, so it uses
    # free capacity exactly like a new block.
    evictable = (is_hit & (state.ref_cnt[hits] == 0)).sum()
    first_alloc = (held == 0) & (computed == 0)
    ok = (enabled & _valid_req(state, req) & state.active[r] & (num_new >= 0)
          & (num_hits >= 0) & (num_hits <= m) & ((num_hits == 0) | first_alloc)
          & ((num_hits == 0) | state.prefix_caching)
          & (total <= state.num_tokens[r]) & (need <= m)
          & (num_new_blocks + evictable <= state.num_free))

    def do(s):
        s = _touch(s, hits, num_hits)
        row = jnp.where(is_hit, hits, s.block_table[r])  # hits only on a first allocation
        s, row = _pop_into_row(s, row, held + num_hits, num_new_blocks)
        s = s.replace(block_table=s.block_table.at[r].set(row),
                      num_held=s.num_held.at[r].set(held + num_hits + num_new_blocks),
                      num_computed=s.num_computed.at[r].set(total),
                      num_cached=s.num_cached.at[r].max(num_hits))  # hit blocks are cached
        return _cache_full_blocks(s, r, total)

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def allocate_slots(state: PoolState, req, num_new_tokens, hit_blocks=None, num_hits=0):
    """vLLM's allocate_slots: make room for num_new_tokens more tokens of request req after
    its computed ones, taking hit_blocks[:num_hits] (from get_computed_blocks; only on the
    first allocation) as already computed. Needs cdiv(computed + hits*Z + new, Z) - held -
    num_hits new blocks, plus one free slot per ref_cnt-0 hit. All or nothing: on failure no
    block is touched, popped or evicted. Advances num_computed and caches every block that
    became full. -> (state, ok)."""
    if hit_blocks is None:
        hit_blocks = jnp.zeros(state.max_blocks_per_request, jnp.int32)
    return _allocate(state, req, num_new_tokens, hit_blocks, num_hits)


@functools.partial(jax.jit, static_argnames="stop_at_failure")
def allocate_step(state: PoolState, reqs, num_new, stop_at_failure: bool = False):
    """Batched allocate_slots without hits (the scheduler's running requests; a decode step).

    reqs: i32[B] request slots served in this order, -1 = skip; num_new: i32[B] tokens each.
    Each request succeeds or fails on its own, seeing the blocks taken by those before it.
    With stop_at_failure, requests after the first failure are not attempted (the host
    scheduler preempts, then resumes from the failed one). -> (state, ok bool[B])."""
    no_hits = jnp.zeros(state.max_blocks_per_request, jnp.int32)

    def body(i, c):
        s, ok, stopped = c
        s, ok_i = _allocate(s, reqs[i], num_new[i], no_hits, 0, enabled=(reqs[i] >= 0) & ~stopped)
        if stop_at_failure:
            stopped |= (reqs[i] >= 0) & ~ok_i
        return s, ok.at[i].set(ok_i), stopped

    c = (state, jnp.zeros(reqs.shape[0], bool), jnp.bool_(False))
    state, ok, _ = jax.lax.fori_loop(0, reqs.shape[0], body, c)
    return state, ok


@jax.jit
def append_token_step(state: PoolState, tokens, mask):
    """Batched single-token append (the sampled token of a decode step), vectorized over
    request slots. tokens: i32[R]; mask: bool[R]. Hashes the block each token completes.
    -> (state, ok bool[R]); a full or inactive slot, or a negative id, fails alone."""
    z, mz = state.block_size, state.max_blocks_per_request * state.block_size
    rows = jnp.arange(state.max_requests)
    n = state.num_tokens
    ok = mask & state.active & (n < mz) & (tokens >= 0)
    toks = state.tokens.at[rows, jnp.where(ok, n, mz)].set(tokens, mode="drop")
    n = n + ok
    state = state.replace(tokens=toks, num_tokens=n)
    if not state.prefix_caching:
        return state, ok
    j = jnp.maximum(n // z - 1, 0)  # i32[R] the block this token may have completed
    filled = ok & (n % z == 0)
    block_toks = jax.vmap(lambda row, jj: jax.lax.dynamic_slice(row, (jj * z,), (z,)))(toks, j)
    parent = jnp.where((j > 0)[:, None], state.req_hash[rows, jnp.maximum(j - 1, 0)], 0)
    first = j == 0
    h = hashing.block_hash_jnp(parent.astype(jnp.uint32), block_toks, first & state.has_salt,
                               jnp.where(first[:, None], state.salt, jnp.uint32(0)))  # u32[R, 2]
    req_hash = state.req_hash.at[rows, jnp.where(filled, j, state.max_blocks_per_request)].set(
        h, mode="drop")
    return state.replace(req_hash=req_hash,
                         num_hashed=jnp.where(filled, j + 1, state.num_hashed)), ok


@jax.jit
def free(state: PoolState, req):
    """vLLM's kv_cache_manager.free: release all the request's blocks (reverse order) and
    reset its block table, computed and cached counts. Its tokens and block hashes stay, so
    a preempted request can later hit its own cached prefix. -> (state, ok)."""
    r = jnp.clip(req, 0, state.max_requests - 1)
    ok = _valid_req(state, req) & state.active[r]

    def do(s):
        s = _release(s, s.block_table[r], s.num_held[r])
        return s.replace(block_table=s.block_table.at[r].set(0), num_held=s.num_held.at[r].set(0),
                         num_computed=s.num_computed.at[r].set(0),
                         num_cached=s.num_cached.at[r].set(0))

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def remove_request(state: PoolState, req):
    """Forget a finished request (after `free`): clear its slot. Fails if it holds blocks.
    -> (state, ok)."""
    r = jnp.clip(req, 0, state.max_requests - 1)
    ok = _valid_req(state, req) & state.active[r] & (state.num_held[r] == 0)

    def do(s):
        return s.replace(active=s.active.at[r].set(False), tokens=s.tokens.at[r].set(0),
                         num_tokens=s.num_tokens.at[r].set(0), has_salt=s.has_salt.at[r].set(False),
                         salt=s.salt.at[r].set(0), req_hash=s.req_hash.at[r].set(0),
                         num_hashed=s.num_hashed.at[r].set(0))

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def reset_prefix_cache(state: PoolState):
    """Clear every block hash; succeeds only when no block is held (vLLM refuses otherwise,
    since running requests' blocks would lose their cache entries mid-flight). The free
    queue keeps its order. -> (state, ok)."""
    ok = state.num_free == state.num_blocks - 1

    def do(s):
        return s.replace(block_hash=jnp.zeros_like(s.block_hash),
                         has_hash=jnp.zeros_like(s.has_hash),
                         cached_at=jnp.full_like(s.cached_at, _NEVER))

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def usage(state: PoolState):
    """Fraction of usable blocks not in the free queue: 1 - free / (P - 1), computed as
    used / usable so that an empty pool reads exactly 0 and a full one exactly 1."""
    usable = state.num_blocks - 1
    return (usable - state.num_free).astype(jnp.float32) / usable


# ----------------------------------------------------------------------------- host views
def free_queue(state: PoolState) -> list[int]:
    """Block ids in the free queue, HEAD to TAIL (host side, for inspection)."""
    nxt = np.asarray(state.next)
    out, b = [], int(nxt[state.head])
    while b != state.tail:
        out.append(b)
        if len(out) > state.num_blocks:
            raise AssertionError("free queue has a cycle: a block was linked twice")
        b = int(nxt[b])
    return out


def request_blocks(state: PoolState, req: int) -> list[int]:
    """The request's block table (host side)."""
    return [int(b) for b in np.asarray(state.block_table[req])[: int(state.num_held[req])]]


def _require(cond, msg: str) -> None:
    if not cond:  # not `assert`: the checks must also run under python -O
        raise AssertionError(msg)


def check_invariants(state: PoolState) -> None:
    """Check the pool's invariants on the host; raise AssertionError naming the likely cause."""
    s = jax.device_get(state)
    p = s.num_blocks
    queue = free_queue(s)
    walk, b = [], int(s.prev[p + 1])
    while b != p and len(walk) <= p:
        walk.append(b)
        b = int(s.prev[b])
    _require(walk[::-1] == queue, f"prev links disagree with next links: {walk[::-1]} vs {queue}")
    _require(NULL_BLOCK not in queue, "null block 0 entered the free queue")
    _require(len(queue) == int(s.num_free), f"num_free {int(s.num_free)} != queue length {len(queue)}")
    _require((s.ref_cnt >= 0).all(), f"negative ref_cnt at blocks {np.nonzero(s.ref_cnt < 0)[0]}")
    zero = {b for b in range(1, p) if s.ref_cnt[b] == 0}
    _require(zero == set(queue), f"free iff ref_cnt 0 broken at blocks {sorted(zero ^ set(queue))}")
    held = int((s.ref_cnt[1:] > 0).sum())
    _require(held + int(s.num_free) == p - 1, "free + held != num_blocks - 1: a block leaked")
    counts = np.zeros(p, np.int64)
    where: dict[int, set[int]] = {}
    for r in range(s.max_requests):
        for j, b in enumerate(s.block_table[r, : s.num_held[r]]):
            _require(b != NULL_BLOCK, f"request slot {r} maps logical block {j} to the null block")
            counts[b] += 1
            where.setdefault(int(b), set()).add(j)
    _require((counts == s.ref_cnt).all(),
             f"ref_cnt != table occurrences at blocks {np.nonzero(counts != s.ref_cnt)[0]}: "
             "a touch or release was skipped")
    for b, js in where.items():
        _require(counts[b] == 1 or (s.has_hash[b] and len(js) == 1),
                 f"block {b} is in {counts[b]} tables at positions {sorted(js)} but is not a "
                 "cached prefix block: two requests got the same new block")
    _require(not s.has_hash[NULL_BLOCK], "the null block was cached")
