"""Plain-Python oracle of the kvjax block pool (issue 3), written independently of
`kvjax/core/block_pool.py` and `kvjax/core/kv_cache_manager.py`: lists, dicts and a Python list for the
free queue (head = index 0), the way vLLM V1's `core/block_pool.py` holds them. Only the block hash is shared with the
library (`kvjax.core.kv_cache_utils.block_hash_np`): the hash is a definition, not the thing
under test.

`OraclePool` speaks in request NAMES and whole ops (add / append / free /
reset_prefix_cache), returning the same dict as one output line of `kvjax replay`, so
tests compare the two line for line. `experiments/allocator_bench.py` times it against the
jitted pool, so it stays plain Python: no pytest, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvjax.core.kv_cache_utils import block_hash_np, salt_key


@dataclass
class OracleRequest:
    tokens: list[int]
    salt: str | None = None
    table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    hashes: list[tuple[int, int]] = field(default_factory=list)


class OraclePool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 max_blocks_per_request: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.max_blocks = num_blocks - 1 if max_blocks_per_request is None else max_blocks_per_request
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[tuple[int, int] | None] = [None] * num_blocks
        # hash -> block ids in the order they were cached; a lookup returns the first.
        self.hash_to_blocks: dict[tuple[int, int], list[int]] = {}
        self.free_queue: list[int] = list(range(1, num_blocks))  # block 0 is the null block
        self.requests: dict[str, OracleRequest] = {}

    # ------------------------------------------------------------------ pool primitives
    def _rehash(self, req: OracleRequest) -> None:
        """Hash the blocks that became full since the last call (vLLM hashes a request's
        blocks as its tokens arrive, and only with caching on)."""
        if not self.prefix_caching:
            return
        z = self.block_size
        for j in range(len(req.hashes), len(req.tokens) // z):
            parent = req.hashes[j - 1] if j else (0, 0)
            has_extra, extra = salt_key(req.salt) if j == 0 else (False, (0, 0))
            h = block_hash_np(parent, req.tokens[j * z:(j + 1) * z], has_extra, extra)
            req.hashes.append((int(h[0]), int(h[1])))

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            self.hash_to_blocks[h].remove(b)
            if not self.hash_to_blocks[h]:
                del self.hash_to_blocks[h]
            self.block_hash[b] = None

    def get_new_blocks(self, n: int) -> list[int] | None:
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            b = self.free_queue.pop(0)
            self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self.free_queue.remove(b)
            self.ref_cnt[b] += 1

    def get_computed_blocks(self, req: OracleRequest) -> list[int]:
        if not self.prefix_caching:
            return []
        hits = []
        max_hits = (len(req.tokens) - 1) // self.block_size
        for h in req.hashes[:max_hits]:
            blocks = self.hash_to_blocks.get(h)
            if not blocks:
                break
            hits.append(blocks[0])
        return hits

    def allocate_slots(self, req: OracleRequest, num_new: int, hits: list[int] = ()) -> list[int] | None:
        """Returns the new blocks, or None on failure (nothing changed)."""
        hits = list(hits)
        z = self.block_size
        if hits and (req.table or req.num_computed):
            return None
        total = req.num_computed + len(hits) * z + num_new
        if total > len(req.tokens):
            return None
        need = -(-total // z)
        if need > self.max_blocks:
            return None
        n_new = max(need - len(req.table) - len(hits), 0)
        evictable = sum(1 for b in hits if self.ref_cnt[b] == 0)
        if n_new + evictable > len(self.free_queue):
            return None
        self.touch(hits)
        req.table += hits
        new = self.get_new_blocks(n_new)
        req.table += new
        req.num_computed = total
        req.num_cached = max(req.num_cached, len(hits))
        self.cache_full_blocks(req, total)
        return new

    def cache_full_blocks(self, req: OracleRequest, num_tokens: int) -> None:
        if not self.prefix_caching:
            return
        full = min(num_tokens // self.block_size, len(req.hashes))
        for j in range(req.num_cached, full):
            b, h = req.table[j], req.hashes[j]
            assert self.block_hash[b] is None, f"block {b} cached twice"
            self.block_hash[b] = h
            self.hash_to_blocks.setdefault(h, []).append(b)
        req.num_cached = max(req.num_cached, full)

    def release(self, req: OracleRequest) -> None:
        """vLLM free(): reverse order; unhashed to the head in release order, hashed to the tail."""
        head_pos = 0
        for b in reversed(req.table):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    self.free_queue.insert(head_pos, b)
                    head_pos += 1
                else:
                    self.free_queue.append(b)
        req.table, req.num_computed, req.num_cached = [], 0, 0

    # ------------------------------------------------------------------ replay-level ops
    def add(self, name: str, tokens: list[int], salt: str | None = None) -> dict:
        assert name not in self.requests, name
        req = OracleRequest(tokens=list(tokens), salt=salt)
        if len(tokens) > self.max_blocks * self.block_size:
            return self.view("add", name, False)
        self._rehash(req)
        hits = self.get_computed_blocks(req)
        new = self.allocate_slots(req, len(tokens) - len(hits) * self.block_size, hits)
        if new is None:
            return self.view("add", name, False)
        self.requests[name] = req
        return self.view("add", name, True, hits, new)

    def append(self, name: str, tokens: list[int]) -> dict:
        req = self.requests[name]
        if len(req.tokens) + len(tokens) > self.max_blocks * self.block_size:
            return self.view("append", name, False)
        saved = (list(req.tokens), list(req.hashes))
        req.tokens += tokens
        self._rehash(req)
        new = self.allocate_slots(req, len(tokens))
        if new is None:
            req.tokens, req.hashes = saved
            return self.view("append", name, False)
        return self.view("append", name, True, [], new)

    def free(self, name: str) -> dict:
        self.release(self.requests.pop(name))
        return self.view("free", name, True)

    def reset_prefix_cache(self) -> dict:
        if len(self.free_queue) != self.num_blocks - 1:
            return self.view("reset_prefix_cache", None, False)
        self.block_hash = [None] * self.num_blocks
        self.hash_to_blocks = {}
        return self.view("reset_prefix_cache", None, True)

    # ------------------------------------------------------------------ views
    def view(self, op: str, name: str | None, ok: bool, hits=(), new=()) -> dict:
        req = self.requests.get(name) if name is not None else None
        n_usable = self.num_blocks - 1
        return {
            "op": op, "req": name, "ok": ok,
            "hit_blocks": list(hits), "hit_tokens": len(hits) * self.block_size,
            "new_blocks": list(new), "blocks": list(req.table) if req else [],
            "free_queue": list(self.free_queue), "num_free": len(self.free_queue),
            "ref_cnt": {str(b): c for b, c in enumerate(self.ref_cnt) if c},
            "cached": [b for b in range(self.num_blocks) if self.block_hash[b] is not None],
            "usage": round(1.0 - len(self.free_queue) / n_usable, 6),
        }

    def full_state(self) -> dict:
        """Everything the stateful test compares, keyed by request name."""
        return {
            "free_queue": list(self.free_queue),
            "ref_cnt": list(self.ref_cnt),
            "block_hash": {b: h for b, h in enumerate(self.block_hash) if h is not None},
            "requests": {n: {"blocks": list(r.table), "num_computed": r.num_computed,
                             "num_tokens": len(r.tokens)}
                         for n, r in self.requests.items()},
        }
