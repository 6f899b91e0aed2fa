"""Plain-Python oracle of kvjax's KV cache groups, written from vLLM 0.33's own code and
independently of `kvjax/core/kv_cache_manager.py` and `kvjax/core/single_type_kv_cache_manager.py`:
one list per group per request (0 for the null block), a Python list for the free queue (head =
index 0), and the steps of vLLM's `KVCacheManager.allocate_slots` in its order:
`remove_skipped_blocks`, `get_num_blocks_to_allocate` per group, `add_local_computed_blocks`,
`allocate_new_blocks`, `cache_blocks`; `find_longest_cache_hit` as the hybrid coordinator runs
it (full groups left to right, then the sliding groups right to left within that length); `free`
group by group. Only the block hash is shared with the library (`block_hash_np`).

A Mamba group (windows entry "mamba": vLLM's MambaManager with mamba_cache_mode "none", prefix caching
off) runs the same steps with its own block size, max_model_len (here the most tokens a request may
hold), and MambaManager's skipped tokens, computed − 1.

`HybridOracle` speaks in request names and whole ops (add / append / free / reset_prefix_cache)
and returns one `kvjax replay` line of a grouped trace, so tests compare the two line for line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvjax.core.kv_cache_utils import block_hash_np, salt_key


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Request:
    tokens: list[int]
    salt: str | None
    tables: list[list[int]]
    hashes: list[tuple[int, int]] = field(default_factory=list)
    num_computed: int = 0
    num_cached: list[int] | None = None  # vLLM's num_cached_block entries; None = not tracked yet


class HybridOracle:
    def __init__(self, num_blocks: int, block_size: int, windows: list[int | None], prefix_caching: bool = True,
                 max_blocks_per_request: int | None = None):
        self.num_blocks, self.block_size, self.windows = num_blocks, block_size, list(windows)
        self.prefix_caching = prefix_caching
        self.max_blocks = num_blocks - 1 if max_blocks_per_request is None else max_blocks_per_request
        assert not (prefix_caching and "mamba" in self.windows), "Mamba prefix caching requires mamba_cache_mode='align'"
        # each group's block size: a Mamba group's is max_model_len (MambaSpec.block_size in mode "none")
        self.sizes = [self.max_blocks * block_size if w == "mamba" else block_size for w in self.windows]
        self.ref_cnt = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks  # (hash, group) a block is cached under
        self.cached: dict[tuple, list[int]] = {}  # (hash, group) -> blocks, oldest first
        self.free_queue = list(range(1, num_blocks))
        self.requests: dict[str, _Request] = {}

    # ------------------------------------------------------------------ block pool
    def _evict(self, b: int) -> None:
        key = self.block_key[b]
        if key is not None:
            self.cached[key].remove(b)
            if not self.cached[key]:
                del self.cached[key]
            self.block_key[b] = None

    def get_new_blocks(self, n: int) -> list[int]:
        assert n <= len(self.free_queue)
        out, self.free_queue = self.free_queue[:n], self.free_queue[n:]
        for b in out:
            self._evict(b)
            self.ref_cnt[b] = 1
        return out

    def touch(self, blocks) -> None:
        for b in blocks:
            if b == 0:
                continue
            if self.ref_cnt[b] == 0:
                self.free_queue.remove(b)
            self.ref_cnt[b] += 1

    def free_blocks(self, ordered) -> None:
        first, last = [], []
        for b in ordered:
            if b == 0:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                (first if self.block_key[b] is None else last).append(b)
        self.free_queue = first + self.free_queue + last

    def get_cached_block(self, h, groups) -> list[int] | None:
        out = []
        for g in groups:
            blocks = self.cached.get((h, g))
            if not blocks:
                return None
            out.append(blocks[0])
        return out

    # ------------------------------------------------------------------ single-type managers
    def skipped_tokens(self, g: int, computed: int) -> int:
        w = self.windows[g]
        if w == "mamba":  # MambaManager.get_num_skipped_tokens
            return max(0, computed - 1)
        return 0 if w is None else max(0, computed - w + 1)

    def remove_skipped_blocks(self, req: _Request, computed: int) -> None:
        for g, table in enumerate(req.tables):
            n = min(self.skipped_tokens(g, computed) // self.sizes[g], len(table))
            freed = []
            for i in range(n - 1, -1, -1):
                if table[i] == 0:
                    break
                freed.append(table[i])
                table[i] = 0
            self.free_blocks(freed)

    def find_longest_cache_hit(self, hashes, max_length: int) -> tuple[list[list[int]], int]:
        z = self.block_size
        full = [g for g, w in enumerate(self.windows) if w is None]
        slides = [g for g, w in enumerate(self.windows) if w is not None]
        hits: dict[int, list[int]] = {}
        length = max_length
        if full:  # FullAttentionManager: left to right
            runs = [[] for _ in full]
            for h in hashes[:max_length // z]:
                found = self.get_cached_block(h, full)
                if not found:
                    break
                for run, b in zip(runs, found):
                    run.append(b)
            hits.update(zip(full, runs))
            length = len(runs[0]) * z
        if slides:  # SlidingWindowManager: right to left, within the full groups' hit
            need = _cdiv(self.windows[slides[0]] - 1, z)
            n = length // z
            runs = [[0] * n for _ in slides]
            count, matched = 0, False
            for i in range(n - 1, -1, -1):
                found = self.get_cached_block(hashes[i], slides)
                if found:
                    for run, b in zip(runs, found):
                        run[i] = b
                    count += 1
                    if count >= need:
                        runs = [run[:i + count] for run in runs]
                        matched = True
                        break
                else:
                    count = 0
            if not matched:
                runs = [run[:count] for run in runs]
            hits.update(zip(slides, runs))
            length = len(runs[0]) * z
            for g in full:  # the coordinator truncates the full groups to the agreed length
                hits[g] = hits[g][:length // z]
        return [hits[g] for g in range(len(self.windows))], length

    def num_blocks_to_allocate(self, req: _Request, g: int, num_tokens: int, hits: list[int], total: int) -> int:
        z, table = self.sizes[g], req.tables[g]
        required = _cdiv(num_tokens, z)
        if req.num_cached is not None:
            return max(required - len(table), 0)
        skipped = self.skipped_tokens(g, total) // z
        new = max(required - max(skipped, len(hits) + len(table)), 0)
        rest = hits[max(0, skipped - len(table)):]
        return new + sum(1 for b in rest if b != 0 and self.ref_cnt[b] == 0)

    # ------------------------------------------------------------------ KVCacheManager
    def allocate_slots(self, req: _Request, num_new: int, hits=None, hit_tokens: int = 0) -> list[list[int]] | None:
        z = self.block_size
        total = req.num_computed + hit_tokens
        groups = range(len(self.windows))
        hits = hits if hits is not None else [[] for _ in groups]
        self.remove_skipped_blocks(req, total)
        need_tokens = total + num_new
        if _cdiv(need_tokens, z) > self.max_blocks or need_tokens > len(req.tokens):
            return None
        need = sum(self.num_blocks_to_allocate(req, g, need_tokens, hits[g], total) for g in groups)
        if need > len(self.free_queue):
            return None
        if req.num_cached is None:  # add_local_computed_blocks, group by group
            req.num_cached = []
            for g in groups:
                skipped = self.skipped_tokens(g, total) // self.sizes[g]
                rest = hits[g][skipped:]
                if self.prefix_caching:
                    self.touch(rest)
                req.tables[g] = [0] * skipped + rest
                req.num_cached.append(len(req.tables[g]))
        new = []
        for g in groups:
            got = self.get_new_blocks(max(_cdiv(need_tokens, self.sizes[g]) - len(req.tables[g]), 0))
            req.tables[g] += got
            new.append(got)
        req.num_computed = need_tokens
        if self.prefix_caching:
            for g in groups:  # cache_blocks, skipping nulls and what reachable_block_mask masks
                full = min(need_tokens, len(req.hashes) * z) // z
                w = self.windows[g]
                reachable = w is None or _cdiv(w - 1, z) >= 1  # (i % 1) >= 1 - need: need >= 1
                for j in range(req.num_cached[g], full):
                    b = req.tables[g][j]
                    if b == 0 or not reachable:
                        continue
                    assert self.block_key[b] is None, f"block {b} cached twice"
                    key = (req.hashes[j], g)
                    self.block_key[b] = key
                    self.cached.setdefault(key, []).append(b)
                req.num_cached[g] = max(req.num_cached[g], full)
        return new

    def free_request(self, req: _Request) -> None:
        for g, table in enumerate(req.tables):
            head = 0
            while head < len(table) and table[head] == 0:  # trim_null_head
                head += 1
            self.free_blocks(list(reversed(table[head:])))
            req.tables[g] = []
        req.num_computed, req.num_cached = 0, None

    # ------------------------------------------------------------------ replay-level ops
    def _rehash(self, req: _Request) -> None:
        if not self.prefix_caching:
            return
        z = self.block_size
        for j in range(len(req.hashes), len(req.tokens) // z):
            parent = req.hashes[j - 1] if j else (0, 0)
            has_extra, extra = salt_key(req.salt) if j == 0 else (False, (0, 0))
            h = block_hash_np(parent, req.tokens[j * z:(j + 1) * z], has_extra, extra)
            req.hashes.append((int(h[0]), int(h[1])))

    def add(self, name: str, tokens: list[int], salt: str | None = None) -> dict:
        assert name not in self.requests, name
        req = _Request(list(tokens), salt, [[] for _ in self.windows])
        if len(tokens) > self.max_blocks * self.block_size:
            return self.view("add", name, False)
        self._rehash(req)
        hits, length = ([[] for _ in self.windows], 0)
        if self.prefix_caching:
            hits, length = self.find_longest_cache_hit(req.hashes, len(tokens) - 1)
        new = self.allocate_slots(req, len(tokens) - length, hits, length)
        if new is None:
            return self.view("add", name, False)
        self.requests[name] = req
        return self.view("add", name, True, hits, length, new)

    def append(self, name: str, tokens: list[int]) -> dict:
        req = self.requests[name]
        if len(req.tokens) + len(tokens) > self.max_blocks * self.block_size:
            return self.view("append", name, False)
        saved = (list(req.tokens), list(req.hashes))
        req.tokens += tokens
        self._rehash(req)
        new = self.allocate_slots(req, len(tokens))
        if new is None:  # the tokens go; the window's freed blocks stay freed
            req.tokens, req.hashes = saved
            return self.view("append", name, False)
        return self.view("append", name, True, None, 0, new)

    def free(self, name: str) -> dict:
        self.free_request(self.requests.pop(name))
        return self.view("free", name, True)

    def reset_prefix_cache(self) -> dict:
        if len(self.free_queue) != self.num_blocks - 1:
            return self.view("reset_prefix_cache", None, False)
        self.block_key = [None] * self.num_blocks
        self.cached = {}
        return self.view("reset_prefix_cache", None, True)

    def view(self, op: str, name: str | None, ok: bool, hits=None, length: int = 0, new=None) -> dict:
        req = self.requests.get(name) if name is not None else None
        none = [[] for _ in self.windows]
        return {
            "op": op, "req": name, "ok": ok, "hit_blocks": hits or none, "hit_tokens": length,
            "new_blocks": new or none, "blocks": [list(t) for t in req.tables] if req else none,
            "free_queue": list(self.free_queue), "num_free": len(self.free_queue),
            "ref_cnt": {str(b): c for b, c in enumerate(self.ref_cnt) if c},
            "cached": [b for b in range(self.num_blocks) if self.block_key[b] is not None],
            "usage": round(1.0 - len(self.free_queue) / (self.num_blocks - 1), 6),
        }
