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

KV cache groups (vLLM's hybrid KV cache manager): one block table per group, named by its
window (`KVCacheManager.windows`, None = full attention; the rules are in
kvjax/core/single_type_kv_cache_manager.py), all drawing on the one pool. An allocation first
frees the blocks its sliding groups no longer see, then takes each group's new blocks in group
order; a hit is agreed across the groups; `free` releases group by group. With full attention
only there is one group, and every figure is what it was before groups existed.

Every operation is `state -> state` (plus an `ok` flag where it can fail) and is jitted with
the sizes static; a failure returns the state unchanged, except that an allocation's freeing of
a window's skipped blocks stands (vLLM frees them before it checks for room: they are dead
either way).

Axes: the kvjax package docstring's legend; B: the requests of one batched call; T: token ids.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.core import block_pool
from kvjax.core import kv_cache_utils as hashing
from kvjax.core import request_table
from kvjax.core import single_type_kv_cache_manager as groups
from kvjax.core.block_pool import BlockPool
from kvjax.core.request_table import Requests, slot_of, tokens_ok
from kvjax.math_utils import cdiv


class PoolRefusedError(RuntimeError):
    """The pool refused an operation that its caller's own bookkeeping said must succeed: a bug
    in kvjax, never bad input (which the operations report through their `ok` flags)."""


@struct.dataclass
class KVCacheManager:
    """The allocator's whole state: the block pool and the request table."""

    prefix_caching: bool = struct.field(pytree_node=False)  # off: no hashes, no hits
    windows: tuple = struct.field(pytree_node=False)  # each group's window, None = full attention
    pool: BlockPool
    reqs: Requests


def init(num_blocks: int, block_size: int, max_requests: int, max_blocks_per_request: int | None = None,
         prefix_caching: bool = True, windows: tuple = (None,)) -> KVCacheManager:
    """A fresh pool (every usable block free, in id order) and an empty request table with one
    block table per KV cache group (windows: each group's sliding window, None = full attention).
    max_blocks_per_request defaults to num_blocks - 1 (no request can hold more)."""
    windows = groups.check_windows(windows, prefix_caching)
    pool = block_pool.init(num_blocks)
    return KVCacheManager(prefix_caching=bool(prefix_caching), windows=windows, pool=pool,
                          reqs=request_table.empty(block_size, max_requests,
                                             num_blocks - 1 if max_blocks_per_request is None
                                             else max_blocks_per_request, len(windows)))


def _append(state: KVCacheManager, rows, tokens, n, max_new: int | None = None) -> KVCacheManager:
    """request_table.append on the manager's table."""
    return state.replace(reqs=request_table.append(state.reqs, rows, tokens, n, state.prefix_caching, max_new))


@jax.jit
def add_request(state: KVCacheManager, req, tokens, num_tokens, has_salt=False, salt=None):
    """Put a new request (its prompt tokens[:num_tokens], i32[T]) in the free slot req and
    hash its full blocks; salt (u32[2], from hashing.salt_key) enters the first block's
    hash when has_salt. Allocates nothing. Fails if the slot is taken, the prompt is empty
    or longer than M*Z tokens, or a token id is negative. -> (state, ok)."""
    t = state.reqs
    valid, r = slot_of(t, req)
    ok = valid & ~t.active[r] & (num_tokens >= 1) & tokens_ok(t, r, tokens, num_tokens)
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
    valid, r = slot_of(state.reqs, req)
    ok = valid & state.reqs.active[r] & tokens_ok(state.reqs, r, tokens, n)
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
    """vLLM's get_computed_blocks: the prefix-cache hit the groups agree on, capped at
    (num_tokens - 1) // Z blocks so the last prompt token is always recomputed (its logits are
    needed). With full attention only, the longest run of the request's leading full blocks whose
    hashes are cached; a sliding group's hit has nulls before the blocks its window needs
    (kvjax/core/single_type_kv_cache_manager.py). No hits with caching off. A pure query.
    -> (hit_blocks i32[G, M] 0-padded, num_hits i32[] blocks, the same for every group)."""
    t = state.reqs
    g, m = t.num_groups, t.max_blocks_per_request
    if not state.prefix_caching:
        return jnp.zeros((g, m), jnp.int32), jnp.int32(0)
    valid, r = slot_of(t, req)
    max_hits = jnp.where(valid, jnp.minimum(t.num_hashed[r], hashing.max_cached_blocks(t.num_tokens[r], t.block_size)),
                         0)

    def search(_):
        looked = [block_pool.lookup(state.pool, t.req_hash[r], group) for group in range(g)]
        block, found = jnp.stack([b for b, _ in looked]), jnp.stack([f for _, f in looked])  # [G, M]
        length, start = groups.hit_length(state.windows, found, max_hits, t.block_size)
        j = jnp.arange(m)
        slides = jnp.asarray([w is not None for w in state.windows])[:, None]
        keep = (j < length) & (~slides | (j >= start))
        return jnp.where(keep, block, 0).astype(jnp.int32), length

    full = [group for group, w in enumerate(state.windows) if w is None]
    if not full:
        return search(None)
    # A hit needs the first block in every full group: one pass over the pool settles the usual
    # miss without the search (a new prompt, or caching of unrelated requests).
    p = state.pool
    first = (p.has_hash & (p.cached_group == full[0]) & (p.block_hash == t.req_hash[r, 0]).all(axis=1)).any()
    return jax.lax.cond((max_hits > 0) & first, search, lambda _: (jnp.zeros((g, m), jnp.int32), jnp.int32(0)), None)


def _group_need(state: KVCacheManager, reqs, num_new, num_hits=0):
    """i32[B, G]: each group's share of `blocks_needed`."""
    t = state.reqs
    r = jnp.clip(reqs, 0, t.max_requests - 1)
    total = t.num_computed[r] + num_hits * t.block_size + num_new
    wanted = groups.blocks_wanted(state.windows, total, t.block_size)  # a Mamba group: one state block
    return jnp.maximum(wanted - t.num_held[r] - jnp.asarray(num_hits)[..., None], 0)


def blocks_needed(state: KVCacheManager, reqs, num_new, num_hits=0):
    """New blocks request slots reqs must take to hold num_new more tokens after their computed
    ones (and num_hits prefix-hit blocks on a first allocation): per group cdiv(computed + hits ×
    Z + new, Z) − held − hits, at least 0, summed over the groups (vLLM's
    get_num_blocks_to_allocate; a group's held entries include its window's nulls, so freeing
    them changes nothing here). The one statement of the rule: `allocate_slots`, `allocate_step`
    and `step_fits` use it."""
    return _group_need(state, reqs, num_new, num_hits).sum(axis=-1)


def _can_grow(state: KVCacheManager, reqs, num_new, num_hits=0):
    """The per-request conditions of allocate_slots, apart from free blocks. bool like reqs."""
    t = state.reqs
    valid, r = slot_of(t, reqs)
    total = t.num_computed[r] + num_hits * t.block_size + num_new
    return (valid & t.active[r] & (num_new >= 0) & (total <= t.num_tokens[r])
            & (cdiv(total, t.block_size) <= t.max_blocks_per_request))


def _skipped(state: KVCacheManager, reqs, attempt):
    """The window's skipped entries of request slots reqs where attempt (bool[B]): (live
    bool[B, G, M], the new num_skipped i32[B, G]); nothing without a sliding group."""
    t = state.reqs
    r = jnp.clip(reqs, 0, t.max_requests - 1)
    live, end = groups.removal(state.windows, t.num_skipped[r], t.num_held[r], t.num_computed[r], t.block_size,
                               t.max_blocks_per_request)
    return live & attempt[:, None, None], jnp.where(attempt[:, None], end, t.num_skipped[r])


COLUMNS = 64  # the table columns one turn of an allocation's loops writes per row and group


def _grant(state: KVCacheManager, reqs, num_new, ok, skipped=None) -> KVCacheManager:
    """Give each request reqs[b] with ok[b] (distinct slots) room for num_new[b] more tokens:
    first free the window's skipped entries (skipped: (live, new num_skipped) from `_skipped`,
    None when there are none), then new blocks from the pool's head in request order, group by
    group, then cache every block that became full."""
    t, z, m = state.reqs, state.reqs.block_size, state.reqs.max_blocks_per_request
    r = jnp.clip(reqs, 0, t.max_requests - 1)
    held, total = t.num_held[r], t.num_computed[r] + num_new  # i32[B, G], i32[B]
    need = jnp.where(ok[:, None], _group_need(state, reqs, num_new), 0)  # i32[B, G]
    offset = jnp.cumsum(need, axis=1) - need  # a group's first block among its request's new ones
    at = jnp.where(ok, r, t.max_requests)  # refused rows scatter out of range
    g_ = jnp.arange(t.num_groups)[None, :, None]

    def placed(table, order, starts):  # the new blocks go to table columns held .. held + need - 1
        def put(c):  # COLUMNS of them at a time
            k, table = c
            d = k * COLUMNS + jnp.arange(COLUMNS)  # i32[W] the next columns, from each row's first new one
            rows = jnp.where(d < need[..., None], r[:, None, None], t.max_requests)  # i32[B, G, W]; R: dropped
            block = order[jnp.clip(starts[:, None, None] + offset[..., None] + d, 0, state.pool.num_blocks - 1)]
            return k + 1, table.at[rows, g_, held[..., None] + d].set(block, mode="drop")

        # Loops, not branches: XLA updates a loop's carried arrays in place, where a branch over the
        # tables or the pool copies them (a decode step's one new block per row is one turn).
        return jax.lax.while_loop(lambda c: c[0] * COLUMNS < need.max(), put, (jnp.int32(0), table))[1]

    if skipped is None:
        pool, order, starts = block_pool.take(state.pool, need.sum(axis=1))
        table = t.block_table
    else:  # frees and takes interleave request by request, as vLLM's allocations run
        live, skip = skipped
        to = jnp.where(live.any(axis=(1, 2)) | need.any(axis=1), r, t.max_requests)  # the rows that change
        pool, order, starts = block_pool.free_and_take(state.pool, t.block_table[r], live, need.sum(axis=1))
        table = t.block_table.at[to].set(jnp.where(live, 0, t.block_table[r]), mode="drop")  # nulls where skipped
        t = t.replace(num_skipped=t.num_skipped.at[to].set(skip, mode="drop"))
    state = state.replace(pool=pool, reqs=t.replace(block_table=placed(table, order, starts)))
    t = state.reqs.replace(num_held=state.reqs.num_held.at[at].set(held + need, mode="drop"),
                           num_computed=state.reqs.num_computed.at[at].set(total, mode="drop"))
    if not state.prefix_caching:
        return state.replace(reqs=t)
    # vLLM cache_full_blocks: blocks num_cached .. full - 1, never past the held ones, skipping nulls
    full = jnp.minimum(jnp.minimum(total // z, t.num_hashed[r])[:, None], held + need)  # i32[B, G]
    cached = t.num_cached[r]
    count = jnp.where(ok[:, None], jnp.maximum(full - cached, 0), 0)  # each row's run of newly full blocks

    caching = jnp.asarray(groups.caches(state.windows, z))
    before = (jnp.cumsum(count.reshape(-1)) - count.reshape(-1)).reshape(count.shape)  # i32[B, G]

    def cache(c):  # blocks cached .. cached + count - 1 of each row and group, COLUMNS at a time
        k, pool = c
        d = k * COLUMNS + jnp.arange(COLUMNS)
        col = jnp.minimum(cached[..., None] + d, m - 1)  # i32[B, G, W]
        block = t.block_table[r[:, None, None], g_, col]
        newly = (d < count[..., None]) & (block != 0) & caching[None, :, None]
        rank = before[..., None] + d  # caching order: rows, then groups, then blocks
        return k + 1, block_pool.cache(pool, block.reshape(-1), t.req_hash[r[:, None, None], col].reshape(-1, 2),
                                       newly.reshape(-1), rank.reshape(-1).astype(jnp.int32),
                                       jnp.broadcast_to(g_, block.shape).reshape(-1))

    pool = jax.lax.while_loop(lambda c: c[0] * COLUMNS < count.max(), cache, (jnp.int32(0), state.pool))[1]
    return state.replace(pool=pool, reqs=t.replace(num_cached=t.num_cached.at[at].max(full, mode="drop")))


def _remove_skipped(state: KVCacheManager, req) -> KVCacheManager:
    t = state.reqs
    valid, r = slot_of(t, req)
    if groups.sliding_window(state.windows) is None:
        return state
    live, skip = _skipped(state, r[None], (valid & t.active[r])[None])
    pool = block_pool.free_and_take(state.pool, t.block_table[r][None], live, jnp.zeros(1, jnp.int32))[0]
    return state.replace(pool=pool, reqs=t.replace(block_table=t.block_table.at[r].set(
        jnp.where(live[0], 0, t.block_table[r])), num_skipped=t.num_skipped.at[r].set(skip[0])))


@jax.jit
def remove_skipped_blocks(state: KVCacheManager, req) -> KVCacheManager:
    """vLLM's remove_skipped_blocks: free the blocks request req's sliding windows no longer see
    (its computed tokens decide), last first, and put the null block in their place. Every
    allocation starts with it; nothing to do without a sliding group or for a free slot."""
    return _remove_skipped(state, req)


@jax.jit
def allocate_slots(state: KVCacheManager, req, num_new_tokens, hit_blocks=None, num_hits=0):
    """vLLM's allocate_slots: make room for num_new_tokens more tokens of request req after
    its computed ones, taking hit_blocks[:, :num_hits] (i32[G, M] from get_computed_blocks; only
    on the first allocation) as already computed. First frees the blocks a sliding window
    skipped (kept even when the rest is refused, as in vLLM). Needs, summed over the groups,
    cdiv(computed + hits*Z + new, Z) - held - num_hits new blocks, plus one free slot per
    ref_cnt-0 hit. All or nothing: on failure no other block is touched, popped or evicted.
    Advances num_computed and caches every block that became full. A sliding group takes only
    the hit blocks its window still sees (nulls before them). -> (state, ok)."""
    t, z, m, g = state.reqs, state.reqs.block_size, state.reqs.max_blocks_per_request, state.reqs.num_groups
    hits = jnp.zeros((g, m), jnp.int32) if hit_blocks is None else hit_blocks
    valid, r = slot_of(t, req)
    state = _remove_skipped(state, req)  # before anything is checked, as vLLM
    t = state.reqs
    skip = groups.skipped_blocks(state.windows, num_hits * z, z)  # i32[G] hit entries the window no longer sees
    is_hit = (jnp.arange(m) >= skip[:, None]) & (jnp.arange(m) < num_hits) & (hits != 0)  # bool[G, M]
    # A hit block nobody holds sits in the free queue: touching it takes it out, so it uses
    # free capacity exactly like a new block.
    evictable = (is_hit & (state.pool.ref_cnt[hits] == 0)).sum()
    first_alloc = (t.num_held[r] == 0).all() & (t.num_computed[r] == 0)
    ok = (_can_grow(state, req, num_new_tokens, num_hits) & (num_hits >= 0) & (num_hits <= m)
          & ((num_hits == 0) | (first_alloc & state.prefix_caching))
          & (blocks_needed(state, req, num_new_tokens, num_hits) + evictable <= state.pool.num_free))

    def take_hits(s):  # a first allocation: the hits head the tables, touched, computed and cached
        q = s.reqs
        return s.replace(pool=block_pool.touch(s.pool, hits.reshape(-1), is_hit.reshape(-1)), reqs=q.replace(
            block_table=q.block_table.at[r].set(jnp.where(is_hit, hits, q.block_table[r])),
            num_held=q.num_held.at[r].set(num_hits), num_skipped=q.num_skipped.at[r].set(jnp.minimum(skip, num_hits)),
            num_computed=q.num_computed.at[r].set(num_hits * z), num_cached=q.num_cached.at[r].max(num_hits)))

    state = block_pool.when(ok & (num_hits > 0), take_hits, state)
    return _grant(state, r[None], jnp.asarray(num_new_tokens, jnp.int32)[None], ok[None]), ok


def _step_rows(state: KVCacheManager, reqs, num_new):
    """allocate_step's rows: (present, can, need i32[B], skipped or None, returned i32[B]): the
    rows named, those whose own conditions hold (a repeated slot fails at its second place),
    their new blocks, the window's skipped entries of every row that can be attempted, and the
    blocks each row's freeing returns to the queue."""
    present, r = reqs >= 0, state.reqs.max_requests
    b = jnp.arange(reqs.shape[0])
    at = jnp.where(present, reqs, r)  # out of range (not -1, which indexes from the end): dropped
    first = jnp.full(r, reqs.shape[0]).at[at].min(b, mode="drop")  # each slot's first place in the batch
    repeated = present & (first.at[at].get(mode="fill", fill_value=-1) != b)
    can = _can_grow(state, reqs, num_new) & ~repeated
    need = jnp.where(can, blocks_needed(state, reqs, num_new), 0)
    if groups.sliding_window(state.windows) is None:
        return present, can, need, None, jnp.zeros_like(need)
    valid, rr = slot_of(state.reqs, reqs)
    skipped = _skipped(state, reqs, present & valid & state.reqs.active[rr] & ~repeated)
    returned = block_pool.returned(state.pool, state.reqs.block_table[rr], skipped[0])
    return present, can, need, skipped, returned


@jax.jit
def step_fits(state: KVCacheManager, reqs, num_new):
    """Whether one step's allocation for several requests fits the free queue as a whole.

    reqs: i32[B] request slots, -1 = none; num_new: i32[B] tokens each. -> (blocks needed
    i32[B], fits bool[]). The host scheduler asks this before allocating its running requests,
    and the device decode loop (kvjax.engine.core) before each of its steps, so both decide by the
    same rule; when it fits, `allocate_step` must succeed for every request. With a sliding
    group, each request's freed blocks count from its own place in the order on."""
    present, _, _, _, returned = _step_rows(state, reqs, num_new)
    need = jnp.where(present, blocks_needed(state, reqs, num_new), 0).astype(jnp.int32)
    return need, (jnp.cumsum(need) <= state.pool.num_free + jnp.cumsum(returned)).all()


@jax.jit
def allocate_step(state: KVCacheManager, reqs, num_new):
    """Batched allocate_slots without hits (the scheduler's running requests; a decode step).

    reqs: i32[B] request slots served in this order, -1 = skip; num_new: i32[B] tokens each.
    Equals allocate_slots for each request in order up to the first refusal (that request's
    window frees its skipped blocks, as allocate_slots does); the requests after it are not
    attempted (the scheduler preempts, then resumes from the refused one, as vLLM's does). A
    slot listed twice is refused at its second place, freeing nothing. -> (state, ok bool[B])."""
    present, can, need, skipped, returned = _step_rows(state, reqs, num_new)
    can &= jnp.cumsum(need) <= state.pool.num_free + jnp.cumsum(returned)  # with what earlier rows freed
    refused = present & ~can
    ok = can & (jnp.cumsum(refused) == 0)  # nothing after the first refusal
    if skipped is not None:
        tried = (jnp.cumsum(refused) - refused) == 0  # up to the first refusal, which frees too
        skipped = (skipped[0] & tried[:, None, None], skipped[1])
    return _grant(state, reqs, num_new, ok, skipped), ok


@jax.jit
def allocate_running(state: KVCacheManager, reqs, num_new):
    """`step_fits`, then `allocate_step`, in one call: the scheduler's running requests, which asks
    both. -> (state, ok bool[B], blocks needed i32[B], fits bool[])."""
    need, fits = step_fits(state, reqs, num_new)
    state, ok = allocate_step(state, reqs, num_new)
    return state, ok, need, fits


@jax.jit
def free(state: KVCacheManager, req):
    """vLLM's kv_cache_manager.free: release all the request's blocks, group by group, each
    group's last block first, and reset its block tables, computed and cached counts. Its tokens
    and block hashes stay, so a preempted request can later hit its own cached prefix.
    -> (state, ok)."""
    return _free(state, req, _tables(state, req))


def _tables(state: KVCacheManager, req):
    """Request slot req's block tables, i32[G, M]."""
    return state.reqs.block_table[slot_of(state.reqs, req)[1]]


def _free(state: KVCacheManager, req, tables):
    """`free`, handed the request's block tables (`_tables`)."""
    valid, r = slot_of(state.reqs, req)
    ok = valid & state.reqs.active[r]

    def do(s):
        q = s.reqs
        j = jnp.arange(q.max_blocks_per_request)
        live = (j >= q.num_skipped[r][:, None]) & (j < q.num_held[r][:, None])  # bool[G, M]
        if q.num_groups == 1:
            pool = block_pool.release_masked(s.pool, tables[0], live[0])
        else:
            pool = block_pool.free_and_take(s.pool, tables[None], live[None], jnp.zeros(1, jnp.int32))[0]
        return s.replace(pool=pool, reqs=q.replace(
            block_table=q.block_table.at[r].set(0), num_held=q.num_held.at[r].set(0),
            num_skipped=q.num_skipped.at[r].set(0), num_computed=q.num_computed.at[r].set(0),
            num_cached=q.num_cached.at[r].set(0)))

    return block_pool.when(ok, do, state), ok


@jax.jit
def remove_request(state: KVCacheManager, req):
    """Forget a finished request (after `free`): clear its slot. Fails if it holds blocks.
    -> (state, ok)."""
    valid, r = slot_of(state.reqs, req)
    ok = valid & state.reqs.active[r] & (state.reqs.num_held[r] == 0).all()

    def do(s):
        q = s.reqs
        return s.replace(reqs=q.replace(
            active=q.active.at[r].set(False), tail=q.tail.at[r].set(0), num_tokens=q.num_tokens.at[r].set(0),
            has_salt=q.has_salt.at[r].set(False), salt=q.salt.at[r].set(0), req_hash=q.req_hash.at[r].set(0),
            num_hashed=q.num_hashed.at[r].set(0)))

    return jax.lax.cond(ok, do, lambda s: s, state), ok


@jax.jit
def finish(state: KVCacheManager, req):
    """A finished request leaves the pool: `free`, then `remove_request`, in one call. -> (state, ok)."""
    return _finish(state, req, _tables(state, req))


def _finish(state: KVCacheManager, req, tables):
    state, ok = _free(state, req, tables)
    state, ok2 = remove_request(state, req)
    return state, ok & ok2


def reset_prefix_cache(state: KVCacheManager):
    """block_pool.reset_prefix_cache on the manager's pool. -> (state, ok)."""
    pool, ok = block_pool.reset_prefix_cache(state.pool)
    return state.replace(pool=pool), ok


def canonical(state: KVCacheManager) -> KVCacheManager:
    """The state with its pool's ring laid out from cell 0 (block_pool.canonical): equal for equal states."""
    return state.replace(pool=block_pool.canonical(state.pool))


request_blocks = request_table.request_blocks  # the host views, kept beside the table they read
check_invariants = request_table.check_invariants


def _owning(fn):
    """fn's program with the state argument donated: its buffers become the returned state's (on a
    CPU, a 194,455-block pool's ~8 MB are otherwise copied by every call: allocate_step 1.25 →
    0.28 ms). For the one owner of a state that drops the old one as it takes the new (the
    Scheduler); the old one's arrays are deleted by the call."""
    return jax.jit(fn.__wrapped__, donate_argnums=0)


def _owning_given_tables(fn):
    """_owning for free and finish, handed the request's block tables read by a program of their own:
    XLA copies an array that one program both reads and updates in place (the 1 MB table of the
    8×H200 pool, three times in a finish: 0.2 of its 0.4 ms)."""
    read, run = jax.jit(_tables), jax.jit(fn, donate_argnums=0)
    return lambda state, req: run(state, req, read(state, req))


# The scheduler's forms of the state -> state operations (`_owning`): manager.owned.free(state, r).
# Anyone who keeps a state it passes in calls the plain ones above.
owned = types.SimpleNamespace(**{fn.__name__: _owning(fn) for fn in (
    add_request, allocate_slots, allocate_step, allocate_running, remove_request)},
    free=_owning_given_tables(_free), finish=_owning_given_tables(_finish))
