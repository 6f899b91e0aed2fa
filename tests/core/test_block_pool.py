"""Unit tests of kvjax/core/block_pool.py: each primitive against hand-worked expectations, and
random sequences of pops, touches, caching and releases against a plain Python list of the free
queue (the way vLLM holds it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.core import block_pool

P = 8


def blocks(*ids, n=P):
    """i32[n]: the ids, 0-padded (the null block pads, as in a block table)."""
    return jnp.asarray(list(ids) + [0] * (n - len(ids)), jnp.int32)


def cached(pool, ids, first_word=7):
    """Cache each block b of ids with hash (first_word, b), in ids order."""
    hashes = jnp.asarray([[first_word, b] for b in ids] + [[0, 0]] * (P - len(ids)), jnp.uint32)
    return block_pool.cache(pool, blocks(*ids), hashes, jnp.arange(P) < len(ids), jnp.arange(P, dtype=jnp.int32))


def test_init():
    pool = block_pool.init(6)
    assert block_pool.free_queue(pool) == [1, 2, 3, 4, 5]
    assert int(pool.num_free) == 5 and float(block_pool.usage(pool)) == 0.0
    block_pool.check_invariants(pool)
    for bad in (1, 2**30 + 1):  # above 2**30 a cell plus an offset would leave int32
        with pytest.raises(ValueError, match=r"num_blocks must be an int in \[2, 1,073,741,824\].*got " + str(bad)):
            block_pool.init(bad)
    # sized without being built: under eval_shape the largest pool allocates nothing
    assert jax.eval_shape(lambda: block_pool.init(2**30)).ring.shape == (2**30,)


def test_take_pops_the_head_in_request_order_and_evicts():
    pool = cached(block_pool.init(P), [1, 2])
    pool, order, starts = block_pool.take(pool, jnp.asarray([2, 0, 1], jnp.int32))
    got = [[int(order[int(starts[i]) + k]) for k in range(n)] for i, n in enumerate([2, 0, 1])]
    assert got == [[1, 2], [], [3]]
    assert block_pool.free_queue(pool) == [4, 5, 6, 7] and int(pool.num_free) == 4
    assert list(np.asarray(pool.ref_cnt)) == [0, 1, 1, 1, 0, 0, 0, 0]
    assert not bool(pool.has_hash.any()), "a popped block keeps no hash: that is the LRU eviction"
    block_pool.check_invariants(pool)


def test_touch_removes_from_anywhere_in_the_queue():
    pool = block_pool.init(6)
    pool = block_pool.touch(pool, jnp.array([3, 5, 3]), jnp.ones(3, bool))  # middle, tail, then again
    assert block_pool.free_queue(pool) == [1, 2, 4]
    assert list(np.asarray(pool.ref_cnt)) == [0, 0, 0, 2, 0, 1] and int(pool.num_free) == 3
    pool = block_pool.touch(pool, jnp.array([3, 1]), jnp.array([True, False]))  # masked entries are skipped
    assert list(np.asarray(pool.ref_cnt)) == [0, 0, 0, 3, 0, 1] and int(pool.num_free) == 3


def test_release_sends_unhashed_blocks_to_the_head_and_hashed_to_the_tail():
    pool, _, _ = block_pool.take(block_pool.init(P), jnp.asarray([3], jnp.int32))  # blocks 1, 2, 3
    pool = cached(pool, [2])
    pool = block_pool.touch(pool, jnp.array([1]), jnp.ones(1, bool))  # block 1 shared by another table
    pool = block_pool.release(pool, blocks(1, 2, 3), 3)
    # released 3, 2, 1: 3 (no hash) to the head; 2 (hashed) to the tail; 1 still held once
    assert block_pool.free_queue(pool) == [3, 4, 5, 6, 7, 2]
    assert list(np.asarray(pool.ref_cnt))[:4] == [0, 1, 0, 0]
    pool = block_pool.release(pool, blocks(1), 1)
    assert block_pool.free_queue(pool) == [1, 3, 4, 5, 6, 7, 2]
    block_pool.check_invariants(pool)
    # a release into an empty queue
    pool, _, _ = block_pool.take(block_pool.init(4), jnp.asarray([3], jnp.int32))
    pool = block_pool.release(cached(pool, [2]), blocks(1, 2, 3, n=4), 3)
    assert block_pool.free_queue(pool) == [3, 1, 2]


def test_lookup_returns_the_oldest_block_of_a_hash():
    pool = cached(block_pool.init(P), [5])
    hashes = jnp.asarray([[7, 5], [7, 5], [1, 1]], jnp.uint32)
    pool = block_pool.cache(pool, blocks(3, n=1), hashes[:1], jnp.ones(1, bool), jnp.zeros(1, jnp.int32))  # (7, 5) too
    found_blocks, found = block_pool.lookup(pool, hashes)
    assert list(np.asarray(found)) == [True, True, False] and list(np.asarray(found_blocks))[:2] == [5, 5]
    pool = block_pool.touch(pool, blocks(3, n=1), jnp.ones(1, bool))  # 3 is held (a hit): not evictable
    pool, _, _ = block_pool.take(pool, jnp.asarray([4], jnp.int32))  # pops 1, 2, 4, 5: evicts 5, the older
    found_blocks, found = block_pool.lookup(pool, hashes[:1])
    assert bool(found[0]) and int(found_blocks[0]) == 3


def test_check_invariants_catches_corruption():
    pool = block_pool.init(6)
    with pytest.raises(AssertionError, match="positions are not exactly 0..num_free-1"):
        block_pool.check_invariants(pool.replace(queue_pos=pool.queue_pos.at[2].set(0)))
    with pytest.raises(AssertionError, match="null block 0 entered the free queue"):
        block_pool.check_invariants(pool.replace(queue_pos=pool.queue_pos.at[0].set(-1)))
    with pytest.raises(AssertionError, match="num_free"):
        block_pool.check_invariants(pool.replace(num_free=pool.num_free + 1))


@pytest.mark.parametrize("seed, pop_cells", [(0, None), (1, None), (2, 3)])
def test_random_ops_equal_a_list_of_the_queue(seed, pop_cells, monkeypatch):
    """400 random pops, touches, cachings and releases on 12 blocks against a Python list
    (head = index 0) and reference counts kept by hand; the ring wraps round many times. With
    pop_cells, a pool larger than block_pool.POP_CELLS (13 blocks, its own compile): pops of at
    most that many blocks read only those cells, larger ones every cell."""
    p, rng = 12 if pop_cells is None else 13, np.random.default_rng(seed)
    if pop_cells is not None:
        monkeypatch.setattr(block_pool, "POP_CELLS", pop_cells)
    pool = block_pool.init(p)
    queue, ref, hashed = list(range(1, p)), [0] * p, [False] * p
    tables: list[list[int]] = []
    for _ in range(400):
        op = rng.integers(4)
        if op == 0 and queue:  # a request takes n new blocks from the head
            n = int(rng.integers(1, len(queue) + 1))
            pool, order, starts = block_pool.take(pool, jnp.asarray([n], jnp.int32))
            got = [int(b) for b in np.asarray(order[jnp.arange(n)])]
            want, queue = queue[:n], queue[n:]
            assert got == want
            for b in want:
                ref[b], hashed[b] = 1, False
            tables.append(want)
        elif op == 1 and tables:  # another request shares some of a table's blocks (a prefix hit)
            t = tables[int(rng.integers(len(tables)))]
            shared = t[: int(rng.integers(1, len(t) + 1))]
            pool = block_pool.touch(pool, blocks(*shared, n=p), jnp.arange(p) < len(shared))
            tables.append(list(shared))
            for b in shared:
                ref[b] += 1
        elif op == 2 and tables:  # cache some held blocks
            b = [b for t in tables for b in t if not hashed[b]][:2]
            pool = cached(pool, b) if len(b) <= P else pool
            for x in b:
                hashed[x] = True
        elif op == 3 and tables:  # a request frees its table, last block first
            t = tables.pop(int(rng.integers(len(tables))))
            pool = block_pool.release(pool, blocks(*t, n=p), len(t))
            head = 0
            for b in reversed(t):
                ref[b] -= 1
                if ref[b] == 0 and hashed[b]:
                    queue.append(b)
                elif ref[b] == 0:
                    queue.insert(head, b)
                    head += 1
        assert block_pool.free_queue(pool) == queue
        assert list(np.asarray(pool.ref_cnt)) == ref
        assert [b for b in range(p) if pool.has_hash[b]] == [b for b in range(p) if hashed[b]]
        block_pool.check_invariants(pool)


@pytest.mark.parametrize("seed", range(6))
def test_lookup_finds_the_oldest_block_of_each_hash_as_a_scan_does(seed):
    # lookup's binary search against a plain scan of every block (the dict lookup vLLM does):
    # equal lane-0 values with other lane-1 values, one hash in several blocks (the oldest wins),
    # blocks of another group or holding no hash, and hashes cached nowhere
    rng = np.random.default_rng(seed)
    p, a = int(rng.integers(2, 300)), int(rng.integers(1, 200))
    lanes = rng.integers(0, 6, (p, 2)).astype(np.uint32)  # few values: many collisions, in one lane or both
    has_hash = rng.random(p) < 0.7
    group = rng.integers(0, 2, p).astype(np.int32)
    # distinct cache times, or repeated ones (then the lowest block id of the oldest wins, as a stable sort gives)
    cached_at = (rng.permutation(p) if seed % 2 else rng.integers(0, 4, p)).astype(np.int32)
    pool = block_pool.init(p)
    pool = pool.replace(block_hash=jnp.asarray(lanes), has_hash=jnp.asarray(has_hash),
                        cached_group=jnp.asarray(group), cached_at=jnp.asarray(cached_at))
    queries = rng.integers(0, 7, (a, 2)).astype(np.uint32)
    for g in (0, 1):
        blocks, found = block_pool.lookup(pool, jnp.asarray(queries), g)
        for q, b, f in zip(queries, np.asarray(blocks), np.asarray(found)):
            holders = [i for i in range(p) if has_hash[i] and group[i] == g and (lanes[i] == q).all()]
            assert bool(f) == bool(holders)
            assert b == (min(holders, key=lambda i: (cached_at[i], i)) if holders else 0)
