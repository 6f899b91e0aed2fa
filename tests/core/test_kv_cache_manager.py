"""Unit tests of kvjax/core/kv_cache_manager.py and kvjax/core/kv_cache_utils.py: each operation against
hand-worked expectations, the batched decode step against the one-request form and the oracle,
and the decode step inside `lax.scan`. (The block pool's own primitives: test_block_pool.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.core import block_pool
from kvjax.core import kv_cache_manager as pool
from kvjax.core import kv_cache_utils as hashing
from kvjax.testing.pool_oracle import OraclePool

Z = 4


def pad(tokens, state):
    a = np.zeros(state.reqs.max_blocks_per_request * state.reqs.block_size, np.int32)
    a[: len(tokens)] = tokens
    return jnp.asarray(a)


def add(state, slot, tokens):
    """add_request + get_computed_blocks + allocate_slots, as `kvjax replay add` does."""
    s, ok = pool.add_request(state, slot, pad(tokens, state), len(tokens))
    assert bool(ok)
    hits, nh = pool.get_computed_blocks(s, slot)
    s, ok = pool.allocate_slots(s, slot, len(tokens) - int(nh) * state.reqs.block_size, hits, nh)
    return s, bool(ok)


def same(a, b):  # the same state, whatever ring layout each call sequence left (block_pool.canonical)
    a, b = pool.canonical(a), pool.canonical(b)
    return all(bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---------------------------------------------------------------------------- hashing
def test_hash_numpy_and_jax_agree():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 2**31 - 1, size=(64, 16))
    parent = rng.integers(0, 2**32, size=(64, 2), dtype=np.uint64).astype(np.uint32)
    extra = rng.integers(0, 2**32, size=(64, 2), dtype=np.uint64).astype(np.uint32)
    has = rng.random(64) < 0.5
    ref = np.stack([hashing.block_hash_np(parent[i], toks[i], has[i], extra[i]) for i in range(64)])
    got = jax.jit(hashing.block_hash_jnp)(jnp.asarray(parent), jnp.asarray(toks, jnp.int32),
                                          jnp.asarray(has), jnp.asarray(extra))
    np.testing.assert_array_equal(np.asarray(got), ref)


def test_hash_is_chained_and_salted():
    a = hashing.request_block_hashes_np([1] * 4 + [2] * 4, Z)
    b = hashing.request_block_hashes_np([3] * 4 + [2] * 4, Z)
    assert a[1] != b[1], "same block tokens after a different parent must hash differently"
    s = hashing.request_block_hashes_np([1] * 4 + [2] * 4, Z, salt="x")
    assert s[0] != a[0] and s[1] != a[1], "the salt must reach every chained block"
    assert hashing.salt_key(None) == (False, (0, 0))
    with pytest.raises(TypeError, match="cache salt must be a string"):
        hashing.salt_key(5)


def test_pool_hashes_equal_the_definition():
    s = pool.init(20, Z, 2)
    toks = list(range(30, 43))  # 13 tokens: 3 full blocks
    s, ok = pool.add_request(s, 1, pad(toks[:6], s), 6, True,
                             np.asarray(hashing.salt_key("k")[1], np.uint32))
    s, _ = pool.append_tokens(s, 1, pad(toks[6:9], s), 3)  # the general append
    for t in toks[9:]:  # the batched one-token append
        s, ok = pool.append_token_step(s, jnp.zeros(2, jnp.int32).at[1].set(t),
                                       jnp.array([False, True]))
        assert bool(ok[1]) and not bool(ok[0])
    want = hashing.request_block_hashes_np(toks, Z, salt="k")
    assert int(s.reqs.num_hashed[1]) == 3
    assert [tuple(map(int, h)) for h in np.asarray(s.reqs.req_hash[1, :3])] == want


# ---------------------------------------------------------------------------- requests
def test_free_puts_unhashed_blocks_at_the_head_in_release_order():
    s = pool.init(8, Z, 2, prefix_caching=False)
    s, ok = add(s, 0, list(range(12)))  # blocks 1, 2, 3
    s, ok = add(s, 1, [7])  # block 4
    s, ok = pool.free(s, 0)
    # released 3, 2, 1 -> head reads 3, 2, 1 (first released is first reused)
    assert block_pool.free_queue(s.pool) == [3, 2, 1, 5, 6, 7]
    pool.check_invariants(s)


def test_free_keeps_tokens_and_hashes_for_a_preempted_request():
    s = pool.init(8, Z, 1)
    s, _ = add(s, 0, list(range(9)))  # blocks 1, 2, 3; 1 and 2 cached
    s, ok = pool.free(s, 0)
    assert bool(ok) and int(s.reqs.num_held[0, 0]) == 0 and int(s.reqs.num_computed[0]) == 0
    assert int(s.reqs.num_tokens[0]) == 9 and int(s.reqs.num_hashed[0]) == 2
    hits, nh = pool.get_computed_blocks(s, 0)  # re-admission hits its own prefix
    assert int(nh) == 2 and list(np.asarray(hits)[0])[:2] == [1, 2]
    s2, ok = pool.remove_request(s, 0)
    assert bool(ok) and not bool(s2.reqs.active[0])


def test_allocate_slots_rejects_bad_requests_without_change():
    s = pool.init(6, Z, 2)
    s, _ = add(s, 0, [1, 2, 3])
    for req, n in ((1, 1), (0, 5), (7, 1), (-1, 1)):  # inactive, beyond known tokens, bad slots
        s2, ok = pool.allocate_slots(s, req, n)
        assert not bool(ok) and same(s, s2), (req, n)
    s2, ok = pool.remove_request(s, 0)  # still holds a block
    assert not bool(ok) and same(s, s2)


def test_reset_prefix_cache_needs_an_empty_pool():
    s = pool.init(6, Z, 1)
    s, _ = add(s, 0, list(range(8)))
    s2, ok = pool.reset_prefix_cache(s)
    assert not bool(ok) and same(s, s2)
    s, _ = pool.free(s, 0)
    s, ok = pool.reset_prefix_cache(s)
    assert bool(ok) and not bool(s.pool.has_hash.any())


def test_check_invariants_catches_corruption():
    s = pool.init(6, Z, 1)
    s, _ = add(s, 0, list(range(8)))
    with pytest.raises(AssertionError, match="ref_cnt != table occurrences"):
        pool.check_invariants(s.replace(pool=s.pool.replace(ref_cnt=s.pool.ref_cnt.at[1].set(2))))
    with pytest.raises(AssertionError, match="num_free"):
        pool.check_invariants(s.replace(pool=s.pool.replace(num_free=s.pool.num_free + 1)))


# ---------------------------------------------------------------------------- batched step
def test_finish_is_free_then_remove_request():
    s = pool.init(8, Z, 2)
    s, _ = add(s, 0, list(range(9)))
    s, _ = add(s, 1, [3, 4])
    f, ok = pool.finish(s, 0)
    want, ok1 = pool.free(s, 0)
    want, ok2 = pool.remove_request(want, 0)
    assert bool(ok) and bool(ok1) and bool(ok2) and same(f, want)
    again, ok = pool.finish(f, 0)  # a slot that holds no request: refused, nothing changed
    assert not bool(ok) and same(again, f)


def _decode_setup(n_req=5, num_blocks=14):
    s = pool.init(num_blocks, Z, 8, 6)
    o = OraclePool(num_blocks, Z, max_blocks_per_request=6)
    for r in range(n_req):
        toks = [r] * (2 + r)  # different lengths so blocks fill at different steps
        s, ok = add(s, r, toks)
        assert ok and o.add(str(r), toks)["ok"]
    return s, o


def test_allocate_step_equals_one_at_a_time_and_oracle():
    """Decode steps until the pool runs out: the batched step leaves exactly the state of
    allocate_slots one request at a time (and the oracle's), and at the step that runs out it
    grants the requests before the first refusal and attempts none after it."""
    s, o = _decode_setup()
    seq = s
    order = jnp.array([3, 0, -1, 4, 1, 2, -1, -1], jnp.int32)
    for step in range(12):
        tok = jnp.arange(8, dtype=jnp.int32) + 100 * step
        mask = jnp.arange(8) < 5
        s, _ = pool.append_token_step(s, tok, mask)
        s, ok = pool.allocate_step(s, order, jnp.ones(8, jnp.int32))
        oks = []
        for r in [3, 0, 4, 1, 2]:
            seq, _ = pool.append_tokens(seq, r, jnp.array([100 * step + r], jnp.int32), 1)
            if oks and not oks[-1]:
                oks.append(False)  # not attempted after a refusal
                continue
            seq, ok1 = pool.allocate_slots(seq, r, 1)
            oks.append(bool(ok1))
        # the batched step reports the same per-request outcome (in `order`'s positions)
        assert [bool(ok[i]) for i in (0, 1, 3, 4, 5)] == oks
        assert same(s, seq), f"step {step}"
        pool.check_invariants(s)
        if not all(oks):
            break
        for r in [3, 0, 4, 1, 2]:
            assert o.append(str(r), [100 * step + r])["ok"]
        assert block_pool.free_queue(s.pool) == o.free_queue
    assert not all(oks) and any(oks), "the pool should run out in the middle of a step"


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_allocate_step_in_lockstep_equals_one_at_a_time(prefix_caching):
    """Equal-length requests step in lockstep: every Z steps they all fill a block, which must
    be cached though no new block is needed, and on the next step all start one; the steps
    between only advance num_computed. The batched step must leave exactly the state that
    allocate_slots one request at a time gives."""
    s = pool.init(40, Z, 8, 8, prefix_caching=prefix_caching)
    for r in range(4):
        s, ok = add(s, r, [10 + r] * 3)  # 3 tokens: the first block fills on the next token
        assert ok
    seq = s
    order = jnp.array([2, -1, 0, 3, 1, -1], jnp.int32)
    for step in range(4 * Z + 1):
        tok = jnp.arange(8, dtype=jnp.int32) + 100 * step
        s, _ = pool.append_token_step(s, tok, jnp.arange(8) < 4)
        s, ok = pool.allocate_step(s, order, jnp.array([1, 0, 1, 1, 1, 0], jnp.int32))
        for r in (2, 0, 3, 1):
            seq, _ = pool.append_tokens(seq, r, jnp.array([100 * step + r], jnp.int32), 1)
            seq, ok1 = pool.allocate_slots(seq, r, 1)
            assert bool(ok1)
        assert list(np.asarray(ok)) == [True, False, True, True, True, False]
        assert same(s, seq), f"step {step}"
        pool.check_invariants(s)
    assert int(s.reqs.num_cached.max()) == (4 + 4 * Z) // Z if prefix_caching else int(s.reqs.num_cached.max()) == 0


def test_allocate_step_refuses_a_slot_listed_twice():
    s = pool.init(10, Z, 4)
    s, _ = add(s, 1, [7] * 5)
    s, _ = add(s, 2, [8] * 2)
    s, _ = pool.append_tokens(s, 1, jnp.array([8, 9], jnp.int32), 2)
    s, _ = pool.append_tokens(s, 2, jnp.array([8], jnp.int32), 1)
    s2, ok = pool.allocate_step(s, jnp.array([1, 1, 2], jnp.int32), jnp.array([1, 1, 1], jnp.int32))
    assert list(np.asarray(ok)) == [True, False, False]  # the repeat is refused; nothing after it runs
    want, _ = pool.allocate_slots(s, 1, 1)
    assert same(s2, want)


def test_allocate_step_stops_at_the_first_refusal():
    s = pool.init(5, Z, 4, 4)  # 4 usable blocks
    for r in range(3):
        s, _ = pool.add_request(s, r, pad([1, 2, 3, 4], s), 4)
    s, _ = pool.allocate_step(s, jnp.array([0, 1, 2, -1]), jnp.array([4, 4, 4, 0]))
    assert int(s.pool.num_free) == 1
    for r in range(3):
        s, _ = pool.append_tokens(s, r, jnp.array([9], jnp.int32), 1)
    # request 0 gets the last block, 1 fails; 2 would fail anyway, but it is not tried
    _, ok = pool.allocate_step(s, jnp.array([0, 1, 2, -1]), jnp.array([1, 1, 1, 0]))
    assert list(np.asarray(ok)) == [True, False, False, False]
    # a request that needs no new block is not tried either once one before it was refused
    assert bool(pool.allocate_slots(s, 2, 0)[1])
    _, ok = pool.allocate_step(s, jnp.array([0, 1, 2, -1]), jnp.array([1, 1, 0, 0]))
    assert list(np.asarray(ok)) == [True, False, False, False]


def test_decode_steps_run_inside_lax_scan():
    """A later issue runs decode steps in lax.scan with the pool in the carry: the whole
    append + allocate step must trace with no host round trip and match the host loop."""
    s0, o = _decode_setup(n_req=4, num_blocks=30)
    mask = jnp.arange(8) < 4
    reqs = jnp.where(mask, jnp.arange(8), -1).astype(jnp.int32)

    def step(s, t):
        s, ok_a = pool.append_token_step(s, jnp.full(8, 1000, jnp.int32) + t, mask)
        s, ok = pool.allocate_step(s, reqs, jnp.ones(8, jnp.int32))
        return s, ok & ok_a

    s_scan, oks = jax.jit(lambda s: jax.lax.scan(step, s, jnp.arange(10, dtype=jnp.int32)))(s0)
    s_loop = s0
    for t in range(10):
        s_loop, _ = step(s_loop, jnp.int32(t))
        for r in range(4):
            assert o.append(str(r), [1000 + t])["ok"]
    assert bool(oks[:, :4].all())
    assert same(s_scan, s_loop)
    assert block_pool.free_queue(s_scan.pool) == o.free_queue
    assert [pool.request_blocks(s_scan, r) for r in range(4)] == [o.requests[str(r)].table for r in range(4)]
    pool.check_invariants(s_scan)


def test_allocate_step_equals_allocate_slots_in_order_on_random_batches():
    """The vector form against the one-request statement of the rule: random requests (shared
    prefixes, so hits and shared blocks), random batches in random order with random token
    counts (including too many, a skipped row and refusals for lack of blocks)."""
    rng = np.random.default_rng(0)
    p, r, m, b = 24, 6, 8, 6
    base = pool.init(p, Z, r, m)
    for trial in range(12):
        s = base
        for slot in range(r):  # prompts of 1-16 tokens, half of them starting with a shared block
            toks = ([1, 2, 3, 4] if rng.random() < 0.5 else []) + list(rng.integers(0, 50, rng.integers(1, 13)))
            s, ok = add(s, slot, toks[: m * Z])
            if ok:  # then more tokens to schedule: up to 12
                extra = jnp.asarray(rng.integers(0, 50, 12), jnp.int32)
                s, _ = pool.append_tokens(s, slot, extra, int(rng.integers(0, 13)))
            else:
                s, _ = pool.remove_request(s, slot)
        reqs = rng.permutation(r)[:b].astype(np.int32)
        reqs[rng.integers(b)] = -1
        nums = rng.integers(0, 10, b).astype(np.int32)
        got, ok = pool.allocate_step(s, jnp.asarray(reqs), jnp.asarray(nums))
        want, oks, stopped = s, [], False
        for q, n in zip(reqs, nums):
            if q < 0:
                oks.append(False)
                continue
            if not stopped:
                want, ok1 = pool.allocate_slots(want, int(q), int(n))
                stopped = not bool(ok1)
            oks.append(not stopped)
        assert list(np.asarray(ok)) == oks, (trial, reqs, nums)
        assert same(got, want), trial
        pool.check_invariants(got)


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value a jaxpr (and every jaxpr inside it) computes."""
    most = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            most = max(most, int(np.prod(getattr(v.aval, "shape", ()), dtype=np.int64)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    most = max(most, _largest_intermediate(getattr(inner, "jaxpr", inner)))
    return most


def test_no_op_builds_a_table_of_every_hash_against_every_block():
    # at kvjax replay's documented limits (65,536 blocks, 2**20 tokens a request), each op's work
    # grows with the pool and the request, never with their product: no value of A x P elements
    # (a lookup comparing each of a request's 65,536 hashes with each block took 10 s an op)
    p, z, m = 2**16, 16, 2**16
    state = pool.init(p, z, 4, m)
    tokens = np.zeros(m * z, np.int32)
    key = np.zeros(2, np.uint32)
    ops = {
        "add_request": lambda s: pool.add_request(s, 0, tokens, 100, False, key),
        "get_computed_blocks": lambda s: pool.get_computed_blocks(s, 0),
        "allocate_slots": lambda s: pool.allocate_slots(s, 0, 100),
        "append_tokens": lambda s: pool.append_tokens(s, 0, tokens, 3),
        "free": lambda s: pool.free(s, 0),
        "remove_request": lambda s: pool.remove_request(s, 0),
    }
    bound = 4 * (p + m * z)  # a few values of the pool's or the request's size
    for name, op in ops.items():
        most = _largest_intermediate(jax.make_jaxpr(op)(state).jaxpr)
        assert most <= bound, (name, most, bound)
