"""The block pool: vLLM V1's `core/block_pool.py` (BlockPool) and the free queue of
`core/kv_cache_utils.py` (FreeKVCacheBlockQueue) as pure functions over a small pytree.

It owns the physical blocks: their reference counts, the free queue, and the prefix cache
(which block holds which chained hash). It knows nothing about requests; the request table
and vLLM's `allocate_slots` / `free` live in `kvjax/core/kv_cache_manager.py`. The rules (kvjax
issue 3; where they differ from a vLLM release, the issue wins):

* Block 0 is the null block: never in the free queue, never allocated, freed, touched or
  cached. The free queue starts as blocks 1..P-1 in id order.
* Allocation pops from the HEAD of the free queue. A popped block that still holds a hash
  is evicted from the prefix cache (hash cleared) as it is taken: one queue serves both
  free blocks and LRU eviction, there is no eviction thread.
* `touch` (a prefix hit) takes a ref_cnt-0 block out of the queue wherever it sits.
* `release` frees a request's blocks in REVERSE order (last block first). Blocks reaching
  ref_cnt 0 WITHOUT a hash go to the HEAD, keeping that reversed order (first released is
  first reused); blocks WITH a hash are appended at the TAIL in that order, so a request's
  tail blocks are evicted before its prefix blocks, which other prompts are likelier to share.
* A block is cached (given its hash) by `cache`, called for every block that becomes full.
  Identical hashes are not de-duplicated (vLLM keeps block tables append-only), so several
  blocks may hold one hash; `lookup` returns the one cached EARLIEST (`cached_at`), like the
  first entry of vLLM's insertion-ordered `{hash: {block_id: block}}`.

The free queue as a ring. vLLM links free blocks in a doubly linked list so a touch can
unlink one in O(1); walking a list is a loop, one tiny kernel per block on a GPU. Here the queue
sits in a ring of P cells (`ring`: the block in each cell; the queue is the num_free cells from
`head` on, modulo P) and every queued block holds its cell (`queue_pos`; INT32_MAX (NOT_LISTED)
for a held block and the null block); a block's place in the queue is (queue_pos - head) mod P.
Every operation is then a fixed number of vector operations, whatever the number of blocks or
requests involved, and the common ones touch only the blocks they move:

* pop n    = the blocks in the n cells from the head (one gather); the head moves on by n;
* release  = u blocks to the head take the u cells before it, in release order, and the head
             moves back by u; h blocks to the tail take the h cells after the last, each
             numbered by a cumulative sum over the released table (vLLM's free_blocks);
* touch    = the touched blocks leave; each other block moves up by the number of touched
             blocks before it (a cumulative sum over the queue), and the ring is laid out again
             from the head: O(P), as is the hybrid groups' interleaved `free_and_take`.

A pop (POP_CELLS cells a turn: a decode step's or a prompt chunk's pop is one) and a release
cost the blocks they move, not P (on a CPU, where a pass over the 194,455 blocks of an 8×H200
deployment's pool takes 0.1–0.3 ms, a call that made several paid about 1 ms). No sort, no probe
loop, and cells never drift out of [0, P).

The hash -> block map is a search of the request's hashes for each block: the A hashes are
sorted (A <= a request's blocks), every cached block finds its hash among them by binary search,
and a scatter-min keeps the oldest block per hash. O(P log A) vector work with no probe loops,
tombstones or resizing, and "several blocks per hash" comes for free. Hash and collision odds:
`kvjax/core/kv_cache_utils.py`.

Axes: the kvjax package docstring's legend; A is the blocks or hashes one call is handed (a
request's table or its hashes, or a batch's tables flattened).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.errors import KvjaxError, require
from kvjax.utils.checks import is_int

NULL_BLOCK = 0  # vLLM's null block: never allocated to a request, target of padding writes
NOT_LISTED = np.iinfo(np.int32).max  # the position of an entry that is not in a list
MAX_BLOCKS = 2**30  # a cell plus an offset below P stays below 2**31
_NEVER = np.iinfo(np.int32).max  # cached_at of a block holding no hash


def when(pred, fn, x):
    """fn(x) if pred else x, as a loop of at most one turn rather than a `lax.cond`: XLA updates a
    loop's carried arrays in place, where a branch that passes them through copies them (on the
    8×H200 pool, allocate_slots made six copies of P-sized arrays through its three conds)."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), fn(c[1])), (jnp.asarray(pred), x))[1]


@struct.dataclass
class BlockPool:
    """The physical blocks: reference counts, free-queue order and the prefix cache."""

    num_blocks: int = struct.field(pytree_node=False)  # P, including null block 0
    ref_cnt: jax.Array  # i32[P] block tables pointing at the block; 0 = in the free queue
    queue_pos: jax.Array  # i32[P] the block's cell in the ring; INT32_MAX = not in the free queue
    ring: jax.Array  # i32[P] the block in each cell; the queue is num_free cells from head on (mod P)
    head: jax.Array  # i32[] the cell of the queue's head
    num_free: jax.Array  # i32[] blocks in the queue (free or evictable cached)
    block_hash: jax.Array  # u32[P, 2] chained hash (two 32-bit lanes); 0 when has_hash is False
    has_hash: jax.Array  # bool[P] block is in the prefix cache (full, hashed, not yet evicted)
    cached_at: jax.Array  # i32[P] cache_clock when hashed; picks among equal hashes (oldest wins)
    cache_clock: jax.Array  # i32[] count of blocks ever cached (insertion order of vLLM's dict)
    cached_group: jax.Array  # i32[P] the KV cache group the hash was cached for (vLLM's BlockHashWithGroupId)


def init(num_blocks: int) -> BlockPool:
    """A fresh pool: every usable block free, in id order (block b at position b - 1)."""
    if not is_int(num_blocks) or not 2 <= num_blocks <= MAX_BLOCKS:
        raise KvjaxError(f"num_blocks must be an int in [2, {MAX_BLOCKS:,}] (block 0 is the null block; the ring's "
                         f"cell arithmetic stays in int32), got {num_blocks!r}")
    p = int(num_blocks)
    # jnp, not numpy: under jax.eval_shape (kvjax.core.sched.tables sizing a pool before it is
    # allocated) nothing is then built, however many blocks
    pos = jnp.arange(-1, p - 1, dtype=jnp.int32).at[NULL_BLOCK].set(NOT_LISTED)
    cell = jnp.arange(p, dtype=jnp.int32)
    ring = jnp.where(cell == p - 1, 0, cell + 1)  # cell c holds block c + 1; the last, unused, the null block
    return BlockPool(num_blocks=p, ref_cnt=jnp.zeros(p, jnp.int32), queue_pos=pos,
                     ring=ring, head=jnp.zeros((), jnp.int32), num_free=jnp.asarray(p - 1, jnp.int32),
                     block_hash=jnp.zeros((p, 2), jnp.uint32),
                     has_hash=jnp.zeros(p, bool), cached_at=jnp.full(p, _NEVER, jnp.int32),
                     cache_clock=jnp.zeros((), jnp.int32), cached_group=jnp.zeros(p, jnp.int32))


def _evict(pool: BlockPool, mask) -> BlockPool:
    """Drop the hash of every block where mask (bool[P]) is set."""
    return pool.replace(block_hash=jnp.where(mask[:, None], jnp.uint32(0), pool.block_hash),
                        has_hash=pool.has_hash & ~mask, cached_at=jnp.where(mask, _NEVER, pool.cached_at))


# ----------------------------------------------------------------------------- lists as positions
# A list held as one position per entry (0 = first, NOT_LISTED = not in it): the free queue's
# places (`positions`) when a touch or free_and_take reorders it, the host tier's LRU / ARC lists
# in kvjax/kv_offload/manager.py.
def count_before(pos, sub):
    """For each listed entry: how many sub entries sit before it in the list. pos i32, sub bool:
    one per entry that may be listed (P here; E in the host tier)."""
    m = pos.shape[0]
    listed = pos < NOT_LISTED
    mark = jnp.zeros(m, jnp.int32).at[jnp.where(sub & listed, pos, m)].set(1, mode="drop")
    before = jnp.cumsum(mark) - mark  # i32, one per position
    return before[jnp.where(listed, pos, 0)]


def close_up(pos, gone):
    """Remove the entries where gone (bool, like pos); the others close up, keeping their order."""
    keep = (pos < NOT_LISTED) & ~gone
    return jnp.where(keep, pos - count_before(pos, gone), NOT_LISTED)


def ordered(pos) -> list[int]:
    """The listed entries' indices, first to last (host side)."""
    pos = np.asarray(pos)
    ids = np.flatnonzero(pos < NOT_LISTED)
    return [int(i) for i in ids[np.argsort(pos[ids], kind="stable")]]


POP_CELLS = 4096  # the blocks one turn of `take`'s loop pops (a decode step's, a prompt chunk's: one turn)


@struct.dataclass
class Popped:
    """The blocks one call popped, in order: the k-th is popped[k] (k below the number popped)."""

    ring: jax.Array  # i32[P] the pool's ring after the call
    first: jax.Array  # i32[] the cell of the first popped block

    def __getitem__(self, k):
        return self.ring[(self.first + k) % self.ring.shape[0]]


def positions(pool: BlockPool):
    """i32[P]: each queued block's place in the free queue (0 = head); NOT_LISTED for the others."""
    return jnp.where(pool.queue_pos < NOT_LISTED, (pool.queue_pos - pool.head) % pool.num_blocks, NOT_LISTED)


def _laid_out(pool: BlockPool, pos, popped=None, total=0) -> BlockPool:
    """The pool with its queue at places pos (i32[P] as `positions` gives them) laid out in the ring
    from cell `total` on; popped: i32[P] the ring's cells before that (a call's popped blocks in
    order, cells 0 .. total - 1), else the old ring's."""
    p = pool.num_blocks
    listed = pos < NOT_LISTED
    cell = jnp.where(listed, pos + total, NOT_LISTED)
    ring = (pool.ring if popped is None else popped).at[jnp.where(listed, cell, p)].set(
        jnp.arange(p, dtype=jnp.int32), mode="drop")
    return pool.replace(queue_pos=cell, ring=ring, head=jnp.asarray(total, jnp.int32))


@jax.jit
def take(pool: BlockPool, counts):
    """Pop counts.sum() blocks from the HEAD (vLLM get_new_blocks for B requests at once):
    request i gets the next counts[i] blocks, in request order. Popped blocks get ref_cnt 1
    and lose any hash they held (the LRU eviction). The caller has checked sum <= num_free.

    counts: i32[B] >= 0. -> (pool, popped Popped, starts i32[B]): request i's k-th block is
    popped[starts[i] + k]."""
    p, total, first = pool.num_blocks, counts.sum(), pool.head
    cells = min(p, POP_CELLS)

    def pop(c):  # the blocks in the next `cells` cells from the head, those below total
        done, pool = c
        i = done + jnp.arange(cells)
        ids = jnp.where(i < total, pool.ring[(first + i) % p], p)  # p: dropped by every scatter
        return done + cells, pool.replace(ref_cnt=pool.ref_cnt.at[ids].set(1, mode="drop"),
                                          queue_pos=pool.queue_pos.at[ids].set(NOT_LISTED, mode="drop"),
                                          block_hash=pool.block_hash.at[ids].set(jnp.uint32(0), mode="drop"),
                                          has_hash=pool.has_hash.at[ids].set(False, mode="drop"),
                                          cached_at=pool.cached_at.at[ids].set(_NEVER, mode="drop"))

    # A loop, not a branch: XLA updates a loop's carried arrays in place, where a branch over the
    # pool copies it (a decode step's pop is one turn; a pop of more than POP_CELLS blocks, more).
    _, pool = jax.lax.while_loop(lambda c: c[0] < total, pop, (jnp.int32(0), pool))
    pool = pool.replace(head=((first + total) % p).astype(jnp.int32), num_free=pool.num_free - total)
    return pool, Popped(pool.ring, first), (jnp.cumsum(counts) - counts).astype(jnp.int32)


def _last_below(depth, t, height):
    """For each query q: the largest s <= t[q] with depth[s] < height[q] (depth: i32[S], depth[0] = 0
    and every height >= 1, so there is one): binary lifting over a sparse table of range minima,
    log2(S) gathers per query instead of a scan."""
    levels = max(1, (depth.shape[0] - 1).bit_length())
    table = [depth]  # table[k][s] = min(depth[max(0, s - 2**k + 1) .. s])
    for k in range(1, levels):
        prev = table[-1]
        table.append(jnp.minimum(prev, prev[jnp.maximum(jnp.arange(depth.shape[0]) - 2 ** (k - 1), 0)]))
    pos = t
    for k in reversed(range(levels)):  # jump back over runs that are all >= height
        pos = jnp.where(table[k][pos] >= height, jnp.maximum(pos - 2 ** k, 0), pos)
    return pos


def _releases(pool: BlockPool, blocks, live):
    """Rounds of releases (blocks i32[B, G, A], live bool[B, G, A], in round order; a block held
    by several rounds' tables is released by each). -> (ref_cnt after them all i32[P], bool[B*G*A]
    the release that returns its block to the queue: its last, when nothing holds it after,
    bool[B*G*A] the block holds a hash)."""
    p = pool.num_blocks
    flat, lv = blocks.reshape(-1), live.reshape(-1)
    e = jnp.arange(flat.shape[0], dtype=jnp.int32)
    at = jnp.where(lv, flat, p)
    ref = pool.ref_cnt - jnp.zeros(p, jnp.int32).at[at].add(1, mode="drop")
    last = jnp.full(p, -1, jnp.int32).at[at].max(e, mode="drop")  # each block's last release
    back = lv & (last.at[at].get(mode="fill", fill_value=-1) == e) & (ref.at[at].get(mode="fill", fill_value=1) == 0)
    return ref, back, pool.has_hash.at[at].get(mode="fill", fill_value=False)


@jax.jit
def returned(pool: BlockPool, blocks, live):
    """How many blocks each round of `free_and_take`'s releases returns to the queue. -> i32[B]."""
    return _releases(pool, blocks, live)[1].reshape(blocks.shape[0], -1).sum(axis=1, dtype=jnp.int32)


@jax.jit
def free_and_take(pool: BlockPool, blocks, live, counts):
    """Rounds b = 0..B-1 in order, each one request's allocation as vLLM runs it: release, group by
    group, the live entries of blocks[b, g] from the last to the first (one free_blocks call per
    group: the blocks a sliding window skipped), then pop counts[b] blocks from the HEAD
    (get_new_blocks). A block released in one round and popped in a later one is reused, LIFO, as
    in vLLM; a block several rounds release returns to the queue at the last. blocks: i32[B, G, A]
    (distinct within a round where live), live: bool[B, G, A], counts: i32[B] >= 0; the caller has
    checked each round's pop against the queue as it stands then. -> (pool, popped, starts i32[B])
    as `take`: round b's k-th block is popped[starts[b] + k]. O(P): the ring is laid out again.

    The queue's head as a stack, so no loop over rounds: a round pushes its blocks bound for the
    head (u[b]) and pops counts[b]; pops take the stack first, then the old queue followed by the
    blocks appended at the tail (the "rest", in order). With cu, cn the running sums of u and
    counts, the rest has lost max(0, running max of cn - cu) blocks after each round (the
    reflection of the walk cu - cn at 0), and the stack depth is cu - cn plus that. The block at
    height h popped in round t was pushed in the last round i <= t before which the depth was
    below h (`_last_below`)."""
    p, (rounds, groups, width) = pool.num_blocks, blocks.shape
    flat = blocks.reshape(-1)
    ref, back, hashed = _releases(pool, blocks, live)
    front, tail = back & ~hashed, back & hashed
    # To the head: pushed round by round, group by group, in table order (each call prepends its
    # list, whose first entry is the table's last). To the tail: appended in release order.
    push_rank = jnp.cumsum(front) - 1
    rev = lambda x: x.reshape(rounds, groups, width)[:, :, ::-1].reshape(-1)  # noqa: E731
    tail_rank = rev(jnp.cumsum(rev(tail)) - 1)
    u = front.reshape(rounds, -1).sum(1, dtype=jnp.int32)
    cu, cn = jnp.cumsum(u), jnp.cumsum(counts)
    lost = jnp.maximum(jax.lax.cummax(cn - cu), 0)  # blocks the rest has lost after each round
    zero = jnp.zeros(1, jnp.int32)
    depth = jnp.concatenate([zero, cu - cn + lost])  # depth[b] = stack depth before round b
    lost = jnp.concatenate([zero, lost])
    items = jnp.zeros(p, jnp.int32).at[jnp.where(front, push_rank, p)].set(flat, mode="drop")
    first_item = cu - u  # round i's first push in `items`
    num_free, queue_pos = pool.num_free, positions(pool)
    listed = queue_pos < NOT_LISTED
    rest = jnp.zeros(p, jnp.int32).at[jnp.where(listed, queue_pos, p)].set(jnp.arange(p, dtype=jnp.int32),
                                                                          mode="drop")
    rest = rest.at[jnp.where(tail, num_free + tail_rank, p)].set(flat, mode="drop")
    rest_len = num_free + tail.sum(dtype=jnp.int32)

    def pushed(t, height):  # the block at stack height `height` in round t (before round t's pops)
        i = _last_below(depth, t, height)
        return items[jnp.clip(first_item[jnp.minimum(i, rounds - 1)] + height - depth[i] - 1, 0, p - 1)]

    x = jnp.arange(p, dtype=jnp.int32)  # pop slots
    total = cn[-1]
    t = jnp.minimum(jnp.searchsorted(cn, x, side="right"), rounds - 1).astype(jnp.int32)
    k = x - (cn[t] - counts[t])
    top = depth[t] + u[t]
    from_stack = k < top - depth[t + 1]
    order = jnp.where(from_stack, pushed(t, top - k), rest[jnp.clip(lost[t] + k - (top - depth[t + 1]), 0, p - 1)])
    order = jnp.where(x < total, order, 0)
    popped = jnp.zeros(p, bool).at[jnp.where(x < total, order, p)].set(True, mode="drop")
    # The queue after the last round: the stack (top first), then what is left of the rest.
    end, gone = depth[rounds], lost[rounds]
    pos = jnp.full(p, NOT_LISTED, jnp.int32)
    pos = pos.at[jnp.where((x >= gone) & (x < rest_len), rest, p)].set(end + x - gone, mode="drop")
    pos = pos.at[jnp.where(x < end, pushed(jnp.full(p, rounds, jnp.int32), x + 1), p)].set(end - 1 - x, mode="drop")
    pool = _laid_out(_evict(pool, popped).replace(ref_cnt=jnp.where(popped, 1, ref),
                                                  num_free=rest_len + u.sum() - total), pos, order, total)
    return pool, Popped(pool.ring, jnp.int32(0)), (cn - counts).astype(jnp.int32)


@jax.jit
def touch(pool: BlockPool, blocks, mask):
    """ref_cnt += 1 for every blocks[k] with mask[k] (i32[A], bool[A]; a block may repeat);
    a block leaving ref_cnt 0 leaves the free queue, wherever it sat."""
    p = pool.num_blocks
    at = jnp.where(mask, blocks, p)
    ref = pool.ref_cnt.at[at].add(1, mode="drop")
    # A block left ref_cnt 0 if its new count is the number of times it was touched. (Reading the
    # old count instead, before or after the add, makes XLA copy ref_cnt twice: a P-sized array.)
    by_block = jnp.sort(at)
    times = jnp.searchsorted(by_block, at, side="right") - jnp.searchsorted(by_block, at, side="left")
    left = mask & (ref.at[at].get(mode="fill", fill_value=0) == times)
    taken = jnp.zeros(p, bool).at[jnp.where(left, at, p)].set(True, mode="drop")
    pool = pool.replace(ref_cnt=ref, num_free=pool.num_free - taken.sum(dtype=jnp.int32))
    # Only a block that leaves the queue moves the others (O(P)); a touch of held blocks does not.
    return when(taken.any(), lambda q: _laid_out(q, close_up(positions(q), taken)), pool)


@jax.jit
def release(pool: BlockPool, blocks, count):
    """Release blocks[count-1], ..., blocks[0] (reverse order; a request's table: distinct
    blocks) per the module docstring. blocks: i32[A]."""
    return release_masked(pool, blocks, jnp.arange(blocks.shape[0]) < count)


@jax.jit
def release_masked(pool: BlockPool, blocks, live):
    """One vLLM `free_blocks` call on the live entries of blocks (i32[A], distinct where live,
    bool[A]), from the last to the first: `release` on any run of a table, not just its head."""
    p = pool.num_blocks
    at = jnp.where(live, blocks, p)
    ref = pool.ref_cnt.at[at].add(-1, mode="drop")
    back = live & (ref.at[at].get(mode="fill", fill_value=1) == 0)  # bool[A]: returns to the queue
    hashed = pool.has_hash.at[at].get(mode="fill", fill_value=False)
    # Release order runs from the table's end: rank = how many such blocks sit after this one.
    to_head, to_tail = back & ~hashed, back & hashed
    head_rank = jnp.cumsum(to_head[::-1])[::-1] - 1  # 0 for the first released
    tail_rank = jnp.cumsum(to_tail[::-1])[::-1] - 1
    head = (pool.head - to_head.sum(dtype=jnp.int32)) % p  # the u cells before the head, then the queue
    cell = jnp.where(to_head, head + head_rank, pool.head + pool.num_free + tail_rank) % p
    return pool.replace(ref_cnt=ref, queue_pos=pool.queue_pos.at[jnp.where(back, blocks, p)].set(cell, mode="drop"),
                        ring=pool.ring.at[jnp.where(back, cell, p)].set(blocks, mode="drop"),
                        head=head.astype(jnp.int32),
                        num_free=pool.num_free + back.sum(dtype=jnp.int32))


@jax.jit
def cache(pool: BlockPool, blocks, hashes, mask, rank, group=0):
    """Give blocks[k] the hash hashes[k] where mask[k] (vLLM cache_full_blocks), cached for KV
    cache group group[k] (i32[A] or one for all). blocks: i32[A] distinct where masked; hashes:
    u32[A, 2]; rank: i32[A] the order in which the masked blocks are cached, 0..count-1 (the
    caller knows it without a cumulative sum over A)."""
    at = jnp.where(mask, blocks, pool.num_blocks)
    return pool.replace(block_hash=pool.block_hash.at[at].set(hashes, mode="drop"),
                        has_hash=pool.has_hash.at[at].set(True, mode="drop"),
                        cached_at=pool.cached_at.at[at].set(pool.cache_clock + rank, mode="drop"),
                        cache_clock=pool.cache_clock + mask.sum(dtype=jnp.int32),
                        cached_group=pool.cached_group.at[at].set(group, mode="drop"))


def first_holders(entry_hashes, valid, queries, age=None):
    """For each query hash: the entry holding it, where valid, of least age (then least index).

    entry_hashes: u32[P, 2]; valid: bool[P]; queries: u32[A, 2]; age: i32[P] (None: by index
    alone, as an argmax over matches picks). -> (entry i32[A], 0 where none; found bool[A]).
    The A queries are sorted (lane 0, then lane 1) and each entry finds its own hash among them
    by binary search; per query a scatter-min keeps the least age, then the least index: O(P log
    A), not the A × P table of comparing every query with every entry (10 s for one request of a
    65,536-block pool on a CPU) nor a sort of the P entries (142 ms against 15 ms for 512 hashes
    in 194,455 blocks on a 2-core CPU)."""
    a, p = queries.shape[0], entry_hashes.shape[0]
    order = jnp.lexsort((queries[:, 1], queries[:, 0]))
    s0, s1 = queries[order, 0], queries[order, 1]

    def lower_bound(h0, h1):  # the first sorted query not below (h0, h1), per element
        lo, hi = jnp.zeros(h0.shape, jnp.int32), jnp.full(h0.shape, a, jnp.int32)
        for _ in range(a.bit_length()):
            mid = (lo + hi) // 2
            m = jnp.minimum(mid, a - 1)
            go = (lo < hi) & ((s0[m] < h0) | ((s0[m] == h0) & (s1[m] < h1)))
            lo, hi = jnp.where(go, mid + 1, lo), jnp.where(go, hi, mid)
        return jnp.minimum(lo, a - 1)

    h0, h1 = entry_hashes[:, 0], entry_hashes[:, 1]
    k = lower_bound(h0, h1)  # i32[P] the sorted query each entry may hold
    match = valid & (s0[k] == h0) & (s1[k] == h1)
    at = jnp.where(match, k, a)  # entries holding none of the queries scatter out of range
    if age is not None:
        oldest = jnp.full(a, _NEVER, jnp.int32).at[at].min(age, mode="drop")
        match = match & (age == oldest[k])
        at = jnp.where(match, k, a)
    entry = jnp.full(a, p, jnp.int32).at[at].min(jnp.arange(p, dtype=jnp.int32), mode="drop")
    entry = entry[lower_bound(s0, s1)][jnp.argsort(order)]  # equal queries share their first's answer; input order
    found = entry < p
    return jnp.where(found, entry, 0).astype(jnp.int32), found


@jax.jit
def lookup(pool: BlockPool, hashes, group=0):
    """The oldest block cached for KV cache group `group` holding each hash (vLLM keys its cache
    by hash and group: its dict lookup): `first_holders` by cached_at. hashes: u32[A, 2].
    -> (blocks i32[A], found bool[A])."""
    return first_holders(pool.block_hash, pool.has_hash & (pool.cached_group == group), hashes, pool.cached_at)


@jax.jit
def reset_prefix_cache(pool: BlockPool):
    """Clear every block hash; succeeds only when no block is held (vLLM refuses otherwise,
    since running requests' blocks would lose their cache entries mid-flight). The free
    queue keeps its order. -> (pool, ok)."""
    ok = pool.num_free == pool.num_blocks - 1
    return jax.lax.cond(ok, lambda q: _evict(q, jnp.ones(q.num_blocks, bool)), lambda q: q, pool), ok


@jax.jit
def usage(pool: BlockPool):
    """Fraction of usable blocks not in the free queue, computed as used / usable so that an
    empty pool reads exactly 0 and a full one exactly 1."""
    usable = pool.num_blocks - 1
    return (usable - pool.num_free).astype(jnp.float32) / usable


def canonical(pool: BlockPool) -> BlockPool:
    """The pool laid out from cell 0, its unused cells 0: one value per pool whatever ring layout
    the operations left it in (two pools are the same pool when these are equal)."""
    return _laid_out(pool.replace(ring=jnp.zeros(pool.num_blocks, jnp.int32)), positions(pool))


# ----------------------------------------------------------------------------- host views
def free_queue(pool: BlockPool) -> list[int]:
    """Block ids in the free queue, HEAD to TAIL (host side, for inspection)."""
    return ordered(positions(pool))


def check_invariants(pool: BlockPool) -> None:
    """Check the pool's own invariants on the host; raise AssertionError naming the likely cause."""
    s = jax.device_get(pool)
    p, pos, ref = s.num_blocks, np.asarray(positions(s)), np.asarray(s.ref_cnt)
    queue = free_queue(s)
    require(NULL_BLOCK not in queue, "null block 0 entered the free queue")
    require(len(queue) == int(s.num_free), f"num_free {int(s.num_free)} != queue length {len(queue)}")
    require(sorted(pos[pos < NOT_LISTED].tolist()) == list(range(len(queue))),
            "the free queue's positions are not exactly 0..num_free-1 (two blocks share one, or one is skipped)")
    cells, listed = np.asarray(s.queue_pos), np.flatnonzero(pos < NOT_LISTED)
    require(0 <= int(s.head) < p and ((cells[listed] >= 0) & (cells[listed] < p)).all(),
            "the head or a queued block's cell is outside the ring")
    require((np.asarray(s.ring)[cells[listed]] == listed).all(),
            "a queued block's cell holds another block in the ring")
    require((ref >= 0).all(), f"negative ref_cnt at blocks {np.nonzero(ref < 0)[0]}")
    zero = {b for b in range(1, p) if ref[b] == 0}
    require(zero == set(queue), f"free iff ref_cnt 0 broken at blocks {sorted(zero ^ set(queue))}")
    require(int((ref[1:] > 0).sum()) + int(s.num_free) == p - 1, "free + held != num_blocks - 1: a block leaked")
    require(not s.has_hash[NULL_BLOCK] and ref[NULL_BLOCK] == 0, "the null block was cached or held")
