"""KV cache groups (vLLM's hybrid KV cache manager): the pool's interleaved free-then-take
against a list simulation, hand-worked traces, the batched step against allocate_slots one
request at a time, and hypothesis state machines against the plain-Python oracle written from
vLLM 0.33's code (kvjax/testing/hybrid_oracle.py). experiments/vllm_replay_reference.py runs the
same traces through vLLM's own KVCacheManager."""
from __future__ import annotations

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.core import block_pool
from kvjax.core import kv_cache_manager as manager
from kvjax.core.replay import Replay, ReplayError, iter_trace
from kvjax.errors import KvjaxError
from kvjax.testing.hybrid_oracle import HybridOracle


# ----------------------------------------------------------------------------- the pool primitive
def _simulate(pool, blocks, live, counts):
    """free_and_take by hand: per round, each group's live entries released last first (unhashed
    to the head in that order, hashed to the tail), then counts[b] popped from the head."""
    queue, ref, hashed = block_pool.free_queue(pool), list(np.asarray(pool.ref_cnt)), list(np.asarray(pool.has_hash))
    popped = []
    for b in range(blocks.shape[0]):
        for g in range(blocks.shape[1]):
            head, tail = [], []
            for x, alive in zip(blocks[b, g][::-1], live[b, g][::-1]):
                if alive:
                    ref[x] -= 1
                    if ref[x] == 0:
                        (tail if hashed[x] else head).append(int(x))
            queue = head + queue + tail
        popped.append(queue[:counts[b]])
        for x in queue[:counts[b]]:
            ref[x], hashed[x] = 1, False
        queue = queue[counts[b]:]
    return popped, queue, ref, hashed


def test_free_and_take_equals_the_list_simulation():
    rng = random.Random(3)
    p = 24  # fixed shapes: every primitive compiles once
    for _ in range(60):
        pool, order, _ = block_pool.take(block_pool.init(p), jnp.asarray([rng.randint(0, p - 1)], jnp.int32))
        held = [int(x) for x in np.asarray(order[jnp.arange(int((np.asarray(pool.ref_cnt) > 0).sum()))])]
        shared = [x for x in held if rng.random() < 0.3]
        pool = block_pool.touch(pool, jnp.asarray(shared + [0] * (p - len(shared)), jnp.int32), jnp.arange(p) < len(shared))
        hashed = [x for x in held if rng.random() < 0.4]
        pool = block_pool.cache(pool, jnp.asarray(hashed + [0] * (p - len(hashed)), jnp.int32),
                                jnp.arange(2 * p, dtype=jnp.uint32).reshape(p, 2), jnp.arange(p) < len(hashed),
                                jnp.arange(p, dtype=jnp.int32))
        back = [x for x in held if x not in shared and rng.random() < 0.3]  # some hashed blocks queue at the tail
        pool = block_pool.release(pool, jnp.asarray(back + [0] * (p - len(back)), jnp.int32), len(back))
        rounds, groups, width = 3, 2, 3
        blocks, live = np.zeros((rounds, groups, width), np.int32), np.zeros((rounds, groups, width), bool)
        holds = {x: int(c) for x, c in enumerate(np.asarray(pool.ref_cnt)) if c}
        free, counts = int(pool.num_free), []
        for b in range(rounds):
            used: set[int] = set()
            for g in range(groups):
                for a in range(width):
                    left = [x for x, c in holds.items() if c and x not in used]
                    if left and rng.random() < (0.6 if rng.random() < 0.5 else 0.2):
                        x = rng.choice(left)
                        blocks[b, g, a], live[b, g, a] = x, True
                        used.add(x)
                        holds[x] -= 1
                        free += holds[x] == 0
            counts.append(rng.randint(0, free))
            free -= counts[-1]
        popped, queue, ref, hashed = _simulate(pool, blocks, live, counts)
        new, order, starts = block_pool.free_and_take(pool, jnp.asarray(blocks), jnp.asarray(live),
                                                      jnp.asarray(counts, jnp.int32))
        order, starts = np.asarray(order[jnp.arange(p)]), np.asarray(starts)
        assert [list(order[starts[b]:starts[b] + counts[b]]) for b in range(rounds)] == popped
        assert block_pool.free_queue(new) == queue
        assert list(np.asarray(new.ref_cnt)) == ref and list(np.asarray(new.has_hash)) == hashed
        block_pool.check_invariants(new)


# ----------------------------------------------------------------------------- worked by hand
def _run(lines):
    return [out for out, _ in iter_trace(json.dumps(x) for x in lines)]


GROUPS = [{"type": "full_attention"}, {"type": "sliding_window", "sliding_window": 3}]


def test_hand_worked_full_and_sliding_trace():
    """Z = 2, W = 3. a's 5 tokens take 3 blocks per group (full 1 2 3, sliding 4 5 6), the two full
    blocks of each cached. Appending 2: 5 computed tokens, so the next query no longer sees the
    first 5 - 3 + 1 = 3 tokens: sliding block 4 (logical 0) is freed first, hashed, to the tail,
    and replaced by the null block; then each group takes one block (7, 8). b shares a's first 3
    blocks: the full group hits 1 2 3, the sliding group needs cdiv(W - 1, Z) = 1 cached block
    before the hit's end, so it hits [0, 0, 6]; b needs one block per group (2) with 1 free: refused."""
    out = _run([{"op": "init", "num_blocks": 9, "block_size": 2, "groups": GROUPS},
                {"op": "add", "req": "a", "tokens": [1, 2, 3, 4, 5]},
                {"op": "append", "req": "a", "tokens": [6, 7]},
                {"op": "add", "req": "b", "tokens": [1, 2, 3, 4, 5, 6, 9]},
                {"op": "free", "req": "a"}])
    assert out[1]["blocks"] == [[1, 2, 3], [4, 5, 6]] and out[1]["cached"] == [1, 2, 4, 5]
    assert out[2]["new_blocks"] == [[7], [8]] and out[2]["blocks"] == [[1, 2, 3, 7], [0, 5, 6, 8]]
    assert out[2]["free_queue"] == [4] and out[2]["cached"] == [1, 2, 3, 4, 5, 6]
    assert not out[3]["ok"] and out[3]["free_queue"] == [4]
    # free: group 0 last block first (7 unhashed to the head, 3 2 1 hashed to the tail), then group 1
    # (8 to the head before 7, then 6 5 to the tail; the null entry is skipped)
    assert out[4]["free_queue"] == [8, 7, 4, 3, 2, 1, 6, 5]


def test_hand_worked_hit_across_the_window():
    """Z = 2, W = 3, caching on. a (8 tokens) is freed; b repeats its 8 tokens: hits are capped at
    (8 - 1) // 2 = 3 blocks. Full hit 1 2 3; sliding: the rightmost cached run of 1 block ending at 3 is
    block 7, so its hit is [0, 0, 7] and the window's skipped hit entries (6 - 3 + 1) // 2 = 2 stay null.
    b then takes one new block per group for its last token, from the head."""
    out = _run([{"op": "init", "num_blocks": 12, "block_size": 2, "groups": GROUPS},
                {"op": "add", "req": "a", "tokens": [1, 2, 3, 4, 5, 6, 7, 8]},
                {"op": "free", "req": "a"},
                {"op": "add", "req": "b", "tokens": [1, 2, 3, 4, 5, 6, 7, 8]}])
    assert out[1]["blocks"] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert out[3]["hit_blocks"] == [[1, 2, 3], [0, 0, 7]] and out[3]["hit_tokens"] == 6
    assert out[3]["blocks"] == [[1, 2, 3, 9], [0, 0, 7, 10]] and out[3]["new_blocks"] == [[9], [10]]


def test_trace_without_groups_prints_what_it_did():
    lines = [{"op": "init", "num_blocks": 6, "block_size": 2}, {"op": "add", "req": "a", "tokens": [1, 2, 3]}]
    assert _run(lines)[1]["blocks"] == [1, 2] and _run(lines)[1]["hit_blocks"] == []


@pytest.mark.parametrize("groups, match", [
    ([], "list of 1 to 64"), ([{"type": "ssm"}], "group 0 must be"), ([{"type": "mamba"}], "mamba_cache_mode"),
    ([{"type": "sliding_window"}], "group 0 must be"), ([{"type": "sliding_window", "sliding_window": 0}], ">= 1"),
    ([{"type": "sliding_window", "sliding_window": 4}, {"type": "sliding_window", "sliding_window": 8}],
     r"different sliding windows \[4, 8\]")])
def test_bad_groups_are_refused_by_name(groups, match):
    with pytest.raises(ReplayError, match=match):
        _run([{"op": "init", "num_blocks": 6, "block_size": 2, "groups": groups}])


def test_host_tier_with_groups_is_refused():
    with pytest.raises(ReplayError, match="host tier serves one group"):
        _run([{"op": "init", "num_blocks": 6, "block_size": 2, "host_blocks": 4, "groups": GROUPS}])


def test_manager_refuses_bad_windows():
    with pytest.raises(KvjaxError, match="window must be an integer >= 1"):
        manager.init(8, 2, 2, windows=(None, -3))


# ----------------------------------------------------------------------------- the batched step
def _same(a, b):  # the same state, whatever ring layout each call sequence left (block_pool.canonical)
    a, b = manager.canonical(a), manager.canonical(b)
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("prefix_caching, windows", [(True, (6, None, 6)), (False, (4,)),
                                                     pytest.param(False, (None, 5), marks=pytest.mark.slow)])
def test_allocate_step_with_windows_equals_one_at_a_time(prefix_caching, windows):
    """Requests of different lengths (two sharing a prefix) decode until the pool runs out: each
    step frees blocks the windows left and takes new ones; the batched step must leave exactly the
    state of allocate_slots one request at a time, and refuse at the same place."""
    z, rng = 2, random.Random(1)
    s = manager.init(34 if None in windows else 16, z, 6, 24, prefix_caching=prefix_caching, windows=windows)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 9], [8] * 3, [4, 4, 4, 4, 4]]
    for r, toks in enumerate(prompts):
        t = jnp.zeros(48, jnp.int32).at[:len(toks)].set(jnp.asarray(toks))
        s, ok = manager.add_request(s, r, t, len(toks))
        hits, nh = manager.get_computed_blocks(s, r)
        s, ok2 = manager.allocate_slots(s, r, len(toks) - int(nh) * z, hits, nh)
        assert bool(ok) and bool(ok2)
    order = jnp.array([2, 0, -1, 3, 1, -1], jnp.int32)
    seq, refused = s, False
    for step in range(36):
        tok = jnp.asarray([rng.randrange(9) for _ in range(6)], jnp.int32)
        s, _ = manager.append_token_step(s, tok, jnp.arange(6) < 4)
        need, fits = manager.step_fits(s, order, jnp.ones(6, jnp.int32))
        s, ok = manager.allocate_step(s, order, jnp.ones(6, jnp.int32))
        oks = []
        for r in (2, 0, 3, 1):
            seq, _ = manager.append_tokens(seq, r, tok[r:r + 1], 1)
            if oks and not oks[-1]:
                oks.append(False)
                continue
            seq, ok1 = manager.allocate_slots(seq, r, 1)
            oks.append(bool(ok1))
        assert [bool(ok[i]) for i in (0, 1, 3, 4)] == oks, f"step {step}"
        assert bool(fits) == all(oks), f"step {step}: step_fits said {bool(fits)}"
        assert _same(s, seq), f"step {step}"
        manager.check_invariants(s)
        if not all(oks):
            refused = True
            break
    assert int(s.reqs.num_skipped.sum()) > 0, "the windows should have freed blocks"
    assert refused == (None in windows), "a full group should run the pool out, a window alone never"


# ----------------------------------------------------------------------------- against the oracle
NUM_BLOCKS, Z = 20, 2
NAMES = [f"r{i}" for i in range(5)]
PREFIXES = [[], [0] * 2, [0, 0, 1, 1], [0, 0, 1, 1, 2, 2, 3], [5, 5, 1, 1], [0, 0, 1]]
tokens = st.builds(lambda p, s: p + s, st.sampled_from(PREFIXES), st.lists(st.integers(0, 3), max_size=7)).filter(bool)


class HybridMachine(RuleBasedStateMachine):
    prefix_caching, windows = True, (None, 3)

    def __init__(self):
        super().__init__()
        self.lib = Replay(NUM_BLOCKS, Z, self.prefix_caching, max_requests=len(NAMES), windows=self.windows)
        self.ref = HybridOracle(NUM_BLOCKS, Z, list(self.windows), self.prefix_caching)

    def live(self):
        return sorted(self.ref.requests)

    @precondition(lambda self: len(self.ref.requests) < len(NAMES))
    @rule(data=st.data(), toks=tokens)
    def add(self, data, toks):
        name = data.draw(st.sampled_from([n for n in NAMES if n not in self.ref.requests]))
        assert self.lib.add(name, toks) == self.ref.add(name, toks)

    @precondition(lambda self: self.ref.requests)
    @rule(data=st.data(), toks=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, data, toks):
        name = data.draw(st.sampled_from(self.live()))
        assert self.lib.append(name, toks) == self.ref.append(name, toks)

    @precondition(lambda self: self.ref.requests)
    @rule(data=st.data())
    def free(self, data):
        name = data.draw(st.sampled_from(self.live()))
        assert self.lib.free(name) == self.ref.free(name)

    @rule(roll=st.integers(0, 5))
    def reset(self, roll):
        if not roll:
            assert self.lib.reset_prefix_cache() == self.ref.reset_prefix_cache()

    @invariant()
    def invariants(self):
        manager.check_invariants(self.lib.state)


class SlidingFirstMachine(HybridMachine):
    windows = (4, None, 4)


class NoCachingMachine(HybridMachine):
    prefix_caching, windows = False, (3,)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=10, stateful_step_count=30, **_SETTINGS)


@pytest.mark.slow
class TestHybridMachineLong(HybridMachine.TestCase):
    """The full run's: twice the default run's examples."""
    settings = settings(max_examples=20, stateful_step_count=30, **_SETTINGS)
TestSlidingFirstMachine = SlidingFirstMachine.TestCase
TestSlidingFirstMachine.settings = settings(max_examples=10, stateful_step_count=25, **_SETTINGS)
TestNoCachingMachine = NoCachingMachine.TestCase
TestNoCachingMachine.settings = settings(max_examples=10, stateful_step_count=25, **_SETTINGS)
