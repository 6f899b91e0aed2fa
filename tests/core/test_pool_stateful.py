"""Hypothesis drives random add / append / free / reset_prefix_cache sequences through the
jitted pool (via kvjax.core.replay.Replay, as `kvjax replay` does) and the plain-Python oracle,
comparing every op's output and the full state after it, and checking the pool's
invariants. Sizes are fixed so every jitted op compiles once for the whole run.

Op budget: caching on 80 examples x <= 50 steps, caching off 20 x 30: ~3,000 ops."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.core import block_pool
from kvjax.core import kv_cache_manager as manager
from kvjax.core.replay import Replay
from kvjax.testing.pool_oracle import OraclePool

NUM_BLOCKS, Z = 16, 4
NAMES = [f"r{i}" for i in range(6)]
# Shared prefixes make prefix hits, duplicate hashes and evictions of shared blocks common.
PREFIXES = [[], [0] * 4, [0] * 4 + [1] * 4, [0] * 4 + [1] * 4 + [2] * 4, [5] * 4 + [1] * 4, [0, 0, 1]]
tokens = st.builds(lambda p, s: p + s, st.sampled_from(PREFIXES),
                   st.lists(st.integers(0, 3), max_size=9)).filter(bool)


class PoolMachine(RuleBasedStateMachine):
    prefix_caching = True

    def __init__(self):
        super().__init__()
        self.lib = Replay(NUM_BLOCKS, Z, self.prefix_caching, max_requests=len(NAMES))
        self.ref = OraclePool(NUM_BLOCKS, Z, self.prefix_caching)
        self.ops = 0

    def compare(self, got, want):
        self.ops += 1
        assert got == want, f"op output differs:\n lib    {got}\n oracle {want}"

    def live(self):
        return sorted(self.ref.requests)

    @precondition(lambda self: len(self.ref.requests) < len(NAMES))
    @rule(data=st.data(), toks=tokens, salt=st.sampled_from([None, None, None, "s"]))
    def add(self, data, toks, salt):
        name = data.draw(st.sampled_from([n for n in NAMES if n not in self.ref.requests]))
        self.compare(self.lib.add(name, toks, salt), self.ref.add(name, toks, salt))

    @precondition(lambda self: self.ref.requests)
    @rule(data=st.data(), toks=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, data, toks):
        name = data.draw(st.sampled_from(self.live()))
        self.compare(self.lib.append(name, toks), self.ref.append(name, toks))

    @precondition(lambda self: self.ref.requests)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def decode(self, data, tok):
        """One sampled token, as a decode step appends."""
        name = data.draw(st.sampled_from(self.live()))
        self.compare(self.lib.append(name, [tok]), self.ref.append(name, [tok]))

    @precondition(lambda self: self.ref.requests)
    @rule(data=st.data())
    def free(self, data):
        name = data.draw(st.sampled_from(self.live()))
        self.compare(self.lib.free(name), self.ref.free(name))

    @rule(roll=st.integers(0, 5))
    def reset(self, roll):
        if roll:  # a rare op: left uniform with the others it would wipe the cache too often
            return
        self.compare(self.lib.reset_prefix_cache(), self.ref.reset_prefix_cache())

    @invariant()
    def same_full_state(self):
        assert self.lib.full_state() == self.ref.full_state()

    @invariant()
    def pool_invariants(self):
        s = jax.device_get(self.lib.state)
        ref = np.asarray(s.pool.ref_cnt)
        assert (ref >= 0).all()
        queue = block_pool.free_queue(s.pool)
        assert set(queue) == {b for b in range(1, NUM_BLOCKS) if ref[b] == 0}, "in queue iff ref_cnt 0"
        assert len(queue) + int((ref[1:] > 0).sum()) == NUM_BLOCKS - 1, "free + held != P - 1"
        # A block in several tables must be a cached prefix block, at one logical position,
        # and every table holding it counts in ref_cnt.
        where = collections.defaultdict(list)
        for name, r in self.lib.slots.items():
            for j, b in enumerate(manager.request_blocks(s, r)):
                where[b].append(j)
        for b, js in where.items():
            assert len(js) == ref[b]
            if len(js) > 1:
                assert s.pool.has_hash[b] and len(set(js)) == 1, f"block {b} shared at {js} without a hit"
        manager.check_invariants(s)  # the library's own checker: queue keys, null block, counts

    def teardown(self):
        for name in self.live():
            self.compare(self.lib.free(name), self.ref.free(name))
        s = self.lib.state.pool
        assert int(s.num_free) == NUM_BLOCKS - 1 and not bool(s.ref_cnt.any()), "blocks leaked"
        assert self.lib.full_state() == self.ref.full_state()


class NoCacheMachine(PoolMachine):
    prefix_caching = False


_fast = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPoolStateful = PoolMachine.TestCase
TestPoolStateful.settings = settings(max_examples=40, stateful_step_count=50, **_fast)


@pytest.mark.slow
class TestPoolStatefulLong(PoolMachine.TestCase):
    """The full run's: twice the default run's examples."""
    settings = settings(max_examples=80, stateful_step_count=50, **_fast)
TestNoCacheStateful = NoCacheMachine.TestCase
TestNoCacheStateful.settings = settings(max_examples=20, stateful_step_count=30, **_fast)
