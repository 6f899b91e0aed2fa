"""Plain-Python oracle of the host offload index (`kvjax/kv_offload/manager.py`), written independently
of it the way vLLM's own managers are written (`vllm/v1/kv_offload/lru_manager.py`,
`arc_manager.py`): OrderedDicts from hash to slot (LRU end first), one loop per hash, one
eviction at a time. Only the rules are shared (see host_cache's module docstring): the jitted
index computes victims, ranks and positions in closed form, this walks them step by step.

Hashes are (lo, hi) tuples. Results have the jitted functions' shapes: lists of length A with
-1 / False where a hash was not live, so tests compare the two element for element.
"""

from __future__ import annotations

from collections import OrderedDict

Hash = tuple[int, int]


class OracleHostIndex:
    def __init__(self, num_slots: int, policy: str = "lru"):
        assert policy in ("lru", "arc"), policy
        self.num_slots, self.policy = num_slots, policy
        self.free: set[int] = set(range(num_slots))
        self.ref_cnt = [0] * num_slots
        # LRU: one list; ARC: T1 (seen once) and T2 (seen again). hash -> slot, LRU end first.
        self.lru: OrderedDict[Hash, int] = OrderedDict()
        self.t1: OrderedDict[Hash, int] = OrderedDict()
        self.t2: OrderedDict[Hash, int] = OrderedDict()
        self.b1: OrderedDict[Hash, None] = OrderedDict()  # ghosts: hashes evicted from T1
        self.b2: OrderedDict[Hash, None] = OrderedDict()  # ... and from T2
        self.p = 0  # ARC's target size of T1

    # ------------------------------------------------------------------ helpers
    def _lists(self) -> list[OrderedDict[Hash, int]]:
        return [self.lru] if self.policy == "lru" else [self.t1, self.t2]

    def slot_of(self, h: Hash) -> int | None:
        for lst in self._lists():
            if h in lst:
                return lst[h]
        return None

    def _victim(self, protected: set[Hash]):
        """vLLM's choice of the next block to evict: (list, hash) or None."""
        def oldest(lst):
            return next((h for h, s in lst.items() if self.ref_cnt[s] == 0 and h not in protected), None)
        if self.policy == "lru":
            h = oldest(self.lru)
            return None if h is None else (self.lru, h)
        if len(self.t1) >= self.p:
            h = oldest(self.t1)
            if h is not None:
                return self.t1, h
        h = oldest(self.t2)
        return None if h is None else (self.t2, h)

    # ------------------------------------------------------------------ operations
    def lookup(self, hashes: list[Hash], n: int) -> int:
        hits = 0
        for h in hashes[:n]:
            if self.slot_of(h) is None:
                break
            hits += 1
        return hits

    def touch(self, hashes: list[Hash], n: int | None = None, fresh: frozenset = frozenset()) -> None:
        """vLLM's touch: last hash first, each moved to the MRU end. fresh: just stored, not
        yet loadable (ARC keeps those in T1)."""
        for h in reversed(list(hashes[:n])):
            if self.policy == "lru":
                if h in self.lru:
                    self.lru.move_to_end(h)
            elif h in self.t1:
                if h in fresh:
                    self.t1.move_to_end(h)
                else:
                    self.t2[h] = self.t1.pop(h)
            elif h in self.t2:
                self.t2.move_to_end(h)
            elif h in self.b1:
                self.p = min(self.p + max(1, len(self.b2) // len(self.b1)), self.num_slots)
                self.b1.move_to_end(h)
            elif h in self.b2:
                self.p = max(self.p - max(1, len(self.b1) // len(self.b2)), 0)
                self.b2.move_to_end(h)

    def prepare_load(self, hashes: list[Hash], n: int) -> list[int]:
        out = [-1] * len(hashes)
        for k, h in enumerate(hashes[:n]):
            s = self.slot_of(h)
            if s is not None:
                self.ref_cnt[s] += 1
                out[k] = s
        return out

    def complete_load(self, slots: list[int], n: int) -> bool:
        live = [s for s in slots[:n] if s != -1]
        if any(not 0 <= s < self.num_slots for s in live):
            return False
        if any(self.ref_cnt[s] < live.count(s) for s in live):
            return False
        for s in live:
            self.ref_cnt[s] -= 1
        return True

    def store(self, hashes: list[Hash], mask: list[bool]) -> tuple[list[int], list[bool]]:
        keys = [h for h, m in zip(hashes, mask) if m]
        to_store: list[Hash] = []
        for h in keys:
            if self.slot_of(h) is None and h not in to_store:
                to_store.append(h)
        protected = set(keys)  # vLLM cpu/manager.py: a store never evicts its own hashes
        for _ in range(len(to_store) - len(self.free)):
            victim = self._victim(protected)
            if victim is None:
                break
            lst, h = victim
            self.free.add(lst.pop(h))
            if lst is self.t1:
                self.b1[h] = None
            elif lst is self.t2:
                self.b2[h] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.num_slots:
                ghost.popitem(last=False)
        done = to_store[:len(self.free)]
        for h in done:
            s = min(self.free)
            self.free.remove(s)
            (self.lru if self.policy == "lru" else self.t1)[h] = s
            self.b1.pop(h, None)
            self.b2.pop(h, None)
        if done:  # the connector touches only when something new was stored
            self.touch([h for h in keys if self.slot_of(h) is not None], fresh=frozenset(done))
        slots, stored, seen = [], [], set()
        for h, m in zip(hashes, mask):
            s = self.slot_of(h) if m else None
            slots.append(-1 if s is None else s)
            stored.append(bool(m) and h in done and h not in seen)
            if m:
                seen.add(h)
        return slots, stored

    # ------------------------------------------------------------------ views
    def entries(self) -> dict:
        """Same shape as kvjax.kv_offload.manager.entries."""
        def listed(lst):
            return [(h, s, self.ref_cnt[s]) for h, s in lst.items()]
        if self.policy == "lru":
            return {"lru": listed(self.lru)}
        return {"t1": listed(self.t1), "t2": listed(self.t2), "b1": list(self.b1), "b2": list(self.b2),
                "p": self.p}
