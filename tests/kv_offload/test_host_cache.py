"""Tests of kvjax/kv_offload/manager.py, the host offload tier's index: hand-worked LRU and ARC traces,
bad input, and a hypothesis state machine driving random store / lookup / touch /
prepare_load / complete_load through the jitted index and the plain-Python oracle
(kvjax/testing/host_oracle.py), comparing every result and the full state after every op.

Every call passes N = 4 hashes, so each jitted op compiles once per policy."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.errors import KvjaxError
from kvjax.kv_offload import manager as host_cache
from kvjax.testing.host_oracle import OracleHostIndex

N = 4


def key(k: int) -> tuple[int, int]:
    """Hash number k: lanes chosen so distinct hashes often share one lane (and 0 is (0, 0))."""
    return (k % 3, k // 3)


class Both:
    """The jitted index and the oracle side by side: every op runs on both, the results and
    the full state must agree, and the index's invariants must hold after it."""

    def __init__(self, h: int, policy: str):
        self.lib, self.ref = host_cache.init(h, policy), OracleHostIndex(h, policy)

    @staticmethod
    def arr(ks):
        return jnp.asarray([key(k) for k in ks] + [(9, 9)] * (N - len(ks)), jnp.uint32)

    def check(self, got, want):
        assert got == want, f"result differs:\n lib    {got}\n oracle {want}"
        assert host_cache.entries(self.lib) == self.ref.entries()
        host_cache.check_invariants(self.lib)
        return got

    def store(self, ks, mask=None):
        mask = [True] * len(ks) + [False] * (N - len(ks)) if mask is None else mask
        self.lib, slots, stored = host_cache.store(self.lib, self.arr(ks), jnp.asarray(mask))
        want = self.ref.store([key(k) for k in ks] + [(9, 9)] * (N - len(ks)), mask)
        return self.check((slots.tolist(), stored.tolist()), want)

    def lookup(self, ks, n=None):
        n = len(ks) if n is None else n
        return self.check(int(host_cache.lookup(self.lib, self.arr(ks), n)), self.ref.lookup([key(k) for k in ks], n))

    def touch(self, ks, n=None):
        n = len(ks) if n is None else n
        self.lib = host_cache.touch(self.lib, self.arr(ks), n)
        self.ref.touch([key(k) for k in ks], n)
        self.check(None, None)

    def prepare_load(self, ks, n=None):
        n = len(ks) if n is None else n
        self.lib, slots = host_cache.prepare_load(self.lib, self.arr(ks), n)
        return self.check(slots.tolist(), self.ref.prepare_load([key(k) for k in ks] + [(9, 9)] * (N - len(ks)), n))

    def complete_load(self, slots, n=None):
        n = len(slots) if n is None else n
        padded = list(slots) + [-1] * (N - len(slots))
        self.lib, ok = host_cache.complete_load(self.lib, jnp.asarray(padded, jnp.int32), n)
        return self.check(bool(ok), self.ref.complete_load(padded, n))

    def entries(self):
        return host_cache.entries(self.lib)


def hashes_of(listed):
    """The hash numbers of an entries() list, LRU end first (resident or ghost entries)."""
    return [3 * e[0][1] + e[0][0] if isinstance(e[0], tuple) else 3 * e[1] + e[0] for e in listed]


A, B, C, D, E, F, G, H_, I, J = range(10)  # hash numbers (H_: H names the slot count)


# ----------------------------------------------------------------------------- LRU
def test_lru_store_lookup_touch_evict():
    x = Both(4, "lru")
    assert x.store([A, B, C, D]) == ([0, 1, 2, 3], [True] * 4)
    assert hashes_of(x.entries()["lru"]) == [D, C, B, A]  # touched last to first: A most recent
    assert x.lookup([A, B, 20, C]) == 2 and x.lookup([A, B, 20, C], 1) == 1 and x.lookup([20, A]) == 0
    x.touch([C, 20])
    assert hashes_of(x.entries()["lru"]) == [D, B, A, C]
    assert x.store([E]) == ([3, -1, -1, -1], [True, False, False, False])  # D's slot
    assert hashes_of(x.entries()["lru"]) == [B, A, C, E]
    assert x.prepare_load([B]) == [1, -1, -1, -1]
    assert x.store([F])[0][0] == 0  # B (ref 1) is skipped: A is evicted instead
    assert hashes_of(x.entries()["lru"]) == [B, C, E, F]
    assert x.complete_load([1]) is True
    before = x.entries()
    assert x.complete_load([1]) is False and x.entries() == before  # ref would go below 0
    assert x.complete_load([4]) is False and x.entries() == before  # no slot 4


def test_lru_store_protects_and_touches_its_resident_hashes():
    x = Both(4, "lru")
    x.store([A, B, C, D])
    assert x.store([D, E]) == ([3, 2, -1, -1], [False, True, False, False])  # D is LRU but protected
    assert hashes_of(x.entries()["lru"]) == [B, A, E, D]


def test_lru_pinned_blocks_are_never_evicted():
    x = Both(4, "lru")
    x.store([A, B, C, D])
    x.prepare_load([A, B, C, D])
    x.prepare_load([A, A])  # a repeat counts twice
    before = x.entries()
    assert x.store([E, F]) == ([-1, -1, -1, -1], [False] * 4)
    assert x.entries() == before
    assert [r for _, _, r in before["lru"]] == [1, 1, 1, 3]
    assert x.complete_load([0, 0, 0]) is True
    assert x.store([E, F, G]) == ([0, -1, -1, -1], [True, False, False, False])  # only A is free


def test_store_repeat_and_unmasked_entries():
    for policy in ("lru", "arc"):
        x = Both(4, policy)
        assert x.store([A, A, B, A], [True, True, False, True]) == ([0, 0, -1, 0], [True, False, False, False])
        lst = x.entries()["lru" if policy == "lru" else "t1"]
        assert hashes_of(lst) == [A]  # stored once; an ARC repeat is not a second use (stays in T1)


# ----------------------------------------------------------------------------- ARC
def test_a_store_with_nothing_new_touches_nothing():
    """vLLM's connector touches after a store only when the store wrote something."""
    x = Both(4, "lru")
    x.store([A, B])  # appended A, B, then touched B, A: A most recent
    x.store([C])
    assert hashes_of(x.entries()["lru"]) == [B, A, C]
    x.store([B])  # resident: nothing written, so B is not moved either
    assert hashes_of(x.entries()["lru"]) == [B, A, C]
    y = Both(4, "arc")
    y.store([A, B])
    y.store([A])  # not a second use: A stays in T1
    assert hashes_of(y.entries()["t1"]) == [B, A] and y.entries()["t2"] == []


def arc_with_frequent_a_b():
    x = Both(4, "arc")
    x.store([A, B])
    x.touch([A, B])  # second use: T1 -> T2
    x.store([C, D])
    e = x.entries()
    assert hashes_of(e["t1"]) == [D, C] and hashes_of(e["t2"]) == [B, A] and e["p"] == 0
    return x


def test_arc_scan_does_not_evict_frequent_blocks():
    x = arc_with_frequent_a_b()
    for batch in ([E, F], [G, H_], [I, J]):  # a scan of blocks used once
        x.store(batch)
    e = x.entries()
    assert hashes_of(e["t2"]) == [B, A] and hashes_of(e["t1"]) == [J, I]
    assert hashes_of(e["b1"]) == [F, E, H_, G]  # the ghost list keeps the H most recent victims
    assert x.lookup([A, B]) == 2
    y = Both(4, "lru")  # the same trace under LRU loses A and B
    for batch in ([A, B], [A, B], [C, D], [E, F], [G, H_], [I, J]):
        y.store(batch)
    assert y.lookup([A, B]) == 0


def test_arc_ghost_hits_move_p():
    x = arc_with_frequent_a_b()
    x.store([E, F])  # |T1| = 2 >= p = 0: both victims from T1
    e = x.entries()
    assert hashes_of(e["b1"]) == [D, C] and hashes_of(e["t1"]) == [F, E] and [s for _, s, _ in e["t1"]] == [3, 2]
    x.touch([C])
    assert x.entries()["p"] == 1  # B1 hit: + max(1, |B2| // |B1|) = + 1
    x.touch([D])  # p = 2, and D moves to B1's MRU end
    x.store([G])  # |T1| = 2 >= p = 2: from T1
    assert hashes_of(x.entries()["b1"]) == [C, D, F] and hashes_of(x.entries()["t1"]) == [E, G]
    x.touch([C, D])  # walked D then C: B1 becomes F, D, C
    assert x.entries()["p"] == 4  # capped at H
    x.store([H_])  # |T1| = 2 < p: the victim is T2's LRU block, B
    e = x.entries()
    assert hashes_of(e["b2"]) == [B] and hashes_of(e["t2"]) == [A] and hashes_of(e["t1"]) == [E, G, H_]
    x.touch([B])
    assert x.entries()["p"] == 1  # B2 hit: - max(1, |B1| // |B2|) = - 3
    x.store([C])  # a ghost that is stored again leaves B1 and enters T1
    e = x.entries()
    assert hashes_of(e["b1"]) == [F, D, E] and hashes_of(e["t1"])[-1] == C  # E the T1 victim


def test_arc_store_promotes_resident_t1_hashes():
    x = Both(4, "arc")
    x.store([A, B])
    assert x.store([A, C]) == ([0, 2, -1, -1], [False, True, False, False])
    e = x.entries()
    assert hashes_of(e["t1"]) == [B, C] and hashes_of(e["t2"]) == [A]


def test_arc_does_not_fall_back_from_t2_to_t1():
    """vLLM's rule: with |T1| < p the victim must come from T2; a pinned T2 fails the store even
    though T1 holds an evictable block."""
    x = Both(2, "arc")
    x.store([A, B])
    x.touch([A])
    x.store([C])  # evicts B (T1) -> B1
    x.touch([B])
    x.touch([B])
    assert x.entries()["p"] == 2
    x.prepare_load([A])
    assert x.store([D]) == ([-1, -1, -1, -1], [False] * 4)
    assert hashes_of(x.entries()["t1"]) == [C]


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("h", [0, -1, 2.0, True, "4", None])
def test_init_rejects_bad_sizes(h):
    with pytest.raises(KvjaxError, match=f"num_host_blocks must be an int >= 1, got {h!r}"):
        host_cache.init(h)


@pytest.mark.parametrize("policy", ["lfu", "LRU", None, 1])
def test_init_rejects_bad_policies(policy):
    with pytest.raises(KvjaxError, match="policy must be one of"):
        host_cache.init(4, policy)


def test_bad_hash_arrays():
    s = host_cache.init(4)
    with pytest.raises(KvjaxError, match=r"hashes must be u32\[N, 2\]"):
        host_cache.lookup(s, jnp.zeros((4, 2), jnp.int32), 1)
    with pytest.raises(KvjaxError, match=r"hashes must be u32\[N, 2\]"):
        host_cache.store(s, jnp.zeros((4,), jnp.uint32), jnp.ones(4, bool))


# ----------------------------------------------------------------------------- stateful
def machine(policy: str, slots: int, num_keys: int):
    """A state machine over `slots` host slots and hashes 0..num_keys-1."""
    ks = st.lists(st.integers(0, num_keys - 1), min_size=N, max_size=N)
    n_ = st.integers(0, N)

    class HostMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.x = Both(slots, policy)
            self.loads: list[list[int]] = []

        @rule(ks=ks, mask=st.lists(st.booleans(), min_size=N, max_size=N))
        def store(self, ks, mask):
            self.x.store(ks, mask)

        @rule(ks=ks, n=n_)
        def lookup(self, ks, n):
            self.x.lookup(ks, n)

        @rule(ks=ks, n=n_)
        def touch(self, ks, n):
            self.x.touch(ks, n)

        @rule(ks=ks, n=n_)
        def prepare_load(self, ks, n):
            loaded = self.x.prepare_load(ks, n)
            if any(s >= 0 for s in loaded):
                self.loads.append(loaded)

        @precondition(lambda self: self.x.ref.b1 or self.x.ref.b2)
        @rule(data=st.data(), n=n_)
        def touch_ghosts(self, data, n):
            """ARC: touch hashes drawn from the ghost lists, so p moves both ways often."""
            ghosts = [3 * hi + lo for lo, hi in [*self.x.ref.b1, *self.x.ref.b2]]
            self.x.touch(data.draw(st.lists(st.sampled_from(ghosts), min_size=N, max_size=N)), n)

        @precondition(lambda self: self.loads)
        @rule(data=st.data())
        def complete_load(self, data):
            loaded = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
            assert self.x.complete_load(loaded) is True

        @rule(arbitrary=st.lists(st.integers(-1, slots + 1), min_size=N, max_size=N), n=n_)
        def complete_load_any(self, arbitrary, n):
            """Arbitrary slots: may fail (state unchanged) or end someone's load early."""
            if self.x.complete_load(arbitrary, n):
                self.loads = []  # the recorded loads may no longer hold

        @invariant()
        def capacity(self):
            e = self.x.entries()
            assert sum(len(v) for k, v in e.items() if k in ("lru", "t1", "t2")) <= slots
            assert all(len(e.get(b, [])) <= slots for b in ("b1", "b2"))

    return HostMachine


_fast = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
# LRU: 9 hashes for 4 slots, so hits, misses and evictions are all common. ARC: 11 hashes, so
# enough stay off the cache for B1 / B2 to fill up and be trimmed.
TestLruStateful = machine("lru", 4, 9).TestCase
TestLruStateful.settings = settings(max_examples=80, stateful_step_count=40, **_fast)
TestArcStateful = machine("arc", 4, 11).TestCase
TestArcStateful.settings = settings(max_examples=60, stateful_step_count=40, **_fast)


@pytest.mark.slow
class TestArcStatefulLong(machine("arc", 4, 11).TestCase):
    """The full run's: twice the default run's examples."""
    settings = settings(max_examples=120, stateful_step_count=40, **_fast)
# ARC on 2 slots: T1 is often empty, so T2 victims and B2 trims are common too.
TestArcSmallStateful = machine("arc", 2, 6).TestCase
TestArcSmallStateful.settings = settings(max_examples=50, stateful_step_count=40, **_fast)
