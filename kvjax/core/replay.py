"""The jitted block pool driven by a trace of ops, one at a time: the library of `kvjax replay`.

A teaching and testing tool for the vLLM V1 allocator semantics reproduced in
`kvjax/core/kv_cache_manager.py` (vLLM `core/kv_cache_manager.py` get_computed_blocks /
allocate_slots / free) and `kvjax/core/block_pool.py` (`core/block_pool.py`). `iter_trace`
runs a trace, one JSON op per line (`bounded_lines` reads them from a file, a bounded line at a
time), through a `Replay`:

    {"op":"init","num_blocks":11,"block_size":16,"prefix_caching":true}
    {"op":"add","req":"r0","tokens":[...],"salt":"optional cache salt"}
    {"op":"append","req":"r0","tokens":[...]}
    {"op":"free","req":"r0"}
    {"op":"reset_prefix_cache"}

`add` schedules the whole prompt (get_computed_blocks, then allocate_slots for the rest);
`append` treats every earlier token as computed and schedules the new ones;
`free` releases the request's blocks and forgets it. Each op gives one JSON object: op,
req, ok, hit_blocks, hit_tokens, new_blocks, blocks (the request's whole table),
free_queue (head -> tail), num_free, ref_cnt (non-zero only), cached (ids holding a hash),
usage. A failed op gives "ok": false and the unchanged state (a failed add leaves no
request behind, so a later op on that name is an unknown request). Blank lines are skipped.

The host offload tier (`kvjax/kv_offload/manager.py`, vLLM's CPU offloading): `init` may add
"host_blocks": E (default 0 = no tier; needs prefix_caching) and "host_policy": "lru" |
"arc" (default "lru"). The trace then drives the tier by kvjax/core/sched/scheduler.py's rules: `add`
touches all of the request's full-block hashes (resident or not: ARC's ghost hits move p),
takes device hits first, then the host tier's run of the hashes that follow (lookup, the
total still capped at (num_tokens - 1) // Z blocks); those host hits get fresh device blocks
in the same allocate_slots and count as computed, are pinned (prepare_load), and their copy
completes within the op (complete_load), so ref counts are back to 0 between ops. Then, as
every scheduled token counts as computed, the request's full blocks not yet offered are
offered to the tier in order (store, which evicts by policy): on `add` from block 0, device
hits included, or after the host hits when there were any; on `append`, from where the last
offer stopped. When a store wrote anything, the request's earlier blocks are touched too.
`reset_prefix_cache` resets the device prefix cache only: the tier keeps its copies, which
no device block refers to. With a tier, every op's object gains host_hit_blocks (a count), loaded
([[host slot, device block], ...] copied in), stored ([[device block, host slot], ...] newly
written), host_in_use, and host: the tier's lists, LRU end first, resident blocks as their
slot ids, ghost hashes as 16 hex digits (lane 0 then lane 1 of the block hash): {"lru":
[...]} or {"t1": [...], "t2": [...], "b1": [...], "b2": [...], "p": ARC's target size of T1}.

KV cache groups (vLLM's hybrid KV cache manager, kvjax/core/single_type_kv_cache_manager.py):
`init` may carry "groups": [{"type": "full_attention"}, {"type": "sliding_window",
"sliding_window": W}, ...] (in that order; all share block_size; one window size at most;
no host tier; {"type": "mamba"} is a Mamba group, vLLM's MambaManager in mamba_cache_mode "none":
one state block per request, prefix caching off). Every op's hit_blocks, new_blocks and blocks are then one list per group, in
that order, a window's freed blocks as the null block 0; hit_tokens is the hit the groups
agreed on. An `append` first frees the blocks its windows no longer see, and those stay freed
if the allocation is refused (vLLM's order). A trace without "groups" prints what it always did.

Bad input (malformed or non-UTF-8 lines, JSON nested deeper than 32 levels, unknown op or
key, unknown request, double free, a token that is not a non-negative int32, a line over 1 MiB
(so one op carries at most ~150,000 tokens), a pool over 65,536 blocks or 2**20 tokens per request, a host tier over 4,096 blocks, an unknown
host_policy, a host tier without prefix caching, a malformed group) stops the replay with a ReplayError naming
the line number.
"""

from __future__ import annotations

import json
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core import block_pool
from kvjax.core import kv_cache_manager as manager
from kvjax.core import request_table
from kvjax.core import kv_cache_utils as hashing
from kvjax.core.replay_input import (MAX_BLOCKS, MAX_HOST_BLOCKS, MAX_REQUEST_TOKENS, ReplayError, bounded_lines,
                                     encodable, groups_field, int_field, parse_json, req_field, tokens_field, utf8)

__all__ = ["Replay", "ReplayError", "bounded_lines", "host_lists", "iter_trace"]
from kvjax.kv_offload import connector
from kvjax.kv_offload import manager as host_cache

OPS = ("init", "add", "append", "free", "reset_prefix_cache")
_KEYS = {"init": {"num_blocks", "block_size", "prefix_caching", "host_blocks", "host_policy", "groups"},
         "add": {"req", "tokens", "salt"}, "append": {"req", "tokens"}, "free": {"req"}, "reset_prefix_cache": set()}


class Replay:
    """The jitted pool plus request names -> slots. Every op keeps the old state on failure
    (the pool is functional, so "unchanged" is simply not taking the new state)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 max_requests: int = 8, host_blocks: int = 0, host_policy: str = "lru",
                 windows: tuple | None = None):
        if host_blocks and not prefix_caching:
            raise ReplayError(f"host_blocks={host_blocks} needs prefix_caching true "
                              "(host blocks are named by their hashes)")
        if host_blocks and windows is not None:
            raise ReplayError("host_blocks with groups: the host tier serves one group (full attention) only")
        self.grouped = windows is not None  # a trace with "groups": every table is a list per group
        self.state = manager.init(num_blocks, block_size, max_requests, prefix_caching=prefix_caching,
                                  windows=(None,) if windows is None else windows)
        self.slots: dict[str, int] = {}
        self.host_next: dict[str, int] = {}  # per request: the next block to offer the host tier
        self.host = host_cache.init(host_blocks, host_policy) if host_blocks else None  # the offload tier's index

    @property
    def capacity_tokens(self) -> int:
        return self.state.reqs.max_blocks_per_request * self.state.reqs.block_size

    def _pad(self, tokens: list[int]) -> jax.Array:
        a = np.zeros(self.capacity_tokens, np.int32)  # one static length: compiled once
        a[: len(tokens)] = tokens
        return jnp.asarray(a)

    def _free_slot(self) -> int:
        used = set(self.slots.values())
        for r in range(self.state.reqs.max_requests):
            if r not in used:
                return r
        self._grow()
        return self._free_slot()

    def _grow(self) -> None:
        """Double the request slots (a new static size, so one more compile); the pool is kept."""
        old = self.state.reqs
        new = request_table.empty(old.block_size, 2 * old.max_requests, old.max_blocks_per_request, old.num_groups)
        rows = [n.at[: o.shape[0]].set(o) for n, o in zip(jax.tree.leaves(new), jax.tree.leaves(old))]
        self.state = self.state.replace(reqs=jax.tree.unflatten(jax.tree.structure(new), rows))

    def _slot(self, name: str) -> int:
        if name not in self.slots:
            raise ReplayError(f"unknown request {name!r}")
        return self.slots[name]

    def add(self, name: str, tokens: list[int], salt: str | None = None) -> dict:
        if name in self.slots:
            raise ReplayError(f"request {name!r} already exists")
        if len(tokens) > self.capacity_tokens:  # can never fit in the pool: a failed add
            return self.view("add", name, False)
        slot, z = self._free_slot(), self.state.reqs.block_size
        has_salt, key = hashing.salt_key(salt)
        s, ok = manager.add_request(self.state, slot, self._pad(tokens), len(tokens), has_salt,
                                 np.asarray(key, np.uint32))
        hits, nh = manager.get_computed_blocks(s, slot)
        nh = int(nh)
        # The host tier (kvjax.kv_offload.connector, as the scheduler admits): touch, then the
        # hash chain after the device hits, capped like them.
        host, hashes, nx = self.host, None, 0
        if host is not None:
            host, hashes, nx = connector.lookup(host, np.asarray(s.reqs.req_hash[slot]), len(tokens), nh, z)
        # Host hits take fresh blocks and count as computed, so the op allocates nx*Z + the rest.
        s, ok2 = manager.allocate_slots(s, slot, len(tokens) - nh * z, hits, nh)
        if not (bool(ok) and bool(ok2)):
            return self.view("add", name, False)
        if self.grouped:
            self.state, self.slots[name] = s, slot
            tables = self._tables(s, slot)
            return self.view("add", name, True, [list(map(int, h[:nh])) for h in np.asarray(hits)],
                             [t[nh:] for t in tables], hit_tokens=nh * z)
        blocks = manager.request_blocks(s, slot)
        host, loaded = self._load(host, hashes, nx, blocks[nh:nh + nx])
        host, stored, self.host_next[name] = self._store(host, s, slot, connector.first_offer(nh, nx))
        self.state, self.slots[name], self.host = s, slot, host
        return self.view("add", name, True, blocks[:nh], blocks[nh:], nx, loaded, stored)

    def append(self, name: str, tokens: list[int]) -> dict:
        slot = self._slot(name)
        if int(self.state.reqs.num_tokens[slot]) + len(tokens) > self.capacity_tokens:
            return self.view("append", name, False)  # longer than the pool: a failed append
        # A window's skipped blocks are freed first and stay freed if the allocation is refused (vLLM's order).
        self.state = manager.remove_skipped_blocks(self.state, slot)
        held = [int(h) for h in np.asarray(self.state.reqs.num_held[slot])]
        s, ok = manager.append_tokens(self.state, slot, self._pad(tokens), len(tokens))
        s, ok2 = manager.allocate_slots(s, slot, len(tokens))
        if not (bool(ok) and bool(ok2)):
            return self.view("append", name, False)
        if self.grouped:
            self.state = s
            return self.view("append", name, True, None, [t[h:] for t, h in zip(self._tables(s, slot), held)])
        self.host, stored, self.host_next[name] = self._store(self.host, s, slot, self.host_next[name])
        self.state = s
        return self.view("append", name, True, [], manager.request_blocks(s, slot)[held[0]:], stored=stored)

    def free(self, name: str) -> dict:
        slot = self._slot(name)
        s, ok = manager.finish(self.state, slot)
        if not bool(ok):
            raise manager.PoolRefusedError(f"the pool refused to free live request {name!r} (slot {slot})")
        self.state = s
        del self.slots[name]
        self.host_next.pop(name, None)
        return self.view("free", name, True)

    def reset_prefix_cache(self) -> dict:
        """The device prefix cache only: the host tier keeps its copies (no device block refers to them)."""
        s, ok = manager.reset_prefix_cache(self.state)
        self.state = s
        return self.view("reset_prefix_cache", None, bool(ok))

    # ------------------------------------------------------------------ the host tier
    @staticmethod
    def _load(host, hashes: np.ndarray, n: int, blocks: list[int]):
        """The scheduler's _host_load and the engine's loads_done in one: pin hashes[:n] (host
        hits), copy them into device blocks, unpin. -> (new index, [[slot, block]])."""
        if not n:
            return host, []
        host, slots = host_cache.prepare_load(host, hashes, n)
        host, ok = host_cache.complete_load(host, slots, n)
        if not bool(ok):
            raise manager.PoolRefusedError(f"the host tier refused to unpin slots {np.asarray(slots[:n]).tolist()}")
        return host, [[int(x), b] for x, b in zip(np.asarray(slots[:n]), blocks)]

    @staticmethod
    def _store(host, s: manager.KVCacheManager, slot: int, first: int):
        """Offer the tier the request's full blocks from logical block `first` on (every
        scheduled token counts as computed; `host_cache.offer`, as the scheduler does).
        -> (new index, [[block, slot]], the next block to offer)."""
        end = int(s.reqs.num_tokens[slot]) // s.reqs.block_size
        if host is None:
            return host, [], max(first, end)
        host, stored, end = connector.offer(host, np.asarray(s.reqs.req_hash[slot]), first, end)
        blocks = manager.request_blocks(s, slot)
        return host, [[blocks[j], x] for j, x in stored], end

    # ------------------------------------------------------------------ views
    @staticmethod
    def _tables(s: manager.KVCacheManager, slot: int) -> list[list[int]]:
        return [manager.request_blocks(s, slot, g) for g in range(s.reqs.num_groups)]

    def view(self, op: str, name: str | None, ok: bool, hits=(), new=(), host_hits=0, loaded=(),
             stored=(), hit_tokens=None) -> dict:
        s = jax.device_get(self.state)
        p, z = s.pool, s.reqs.block_size
        slot = self.slots.get(name) if name is not None else None
        num_free = int(p.num_free)
        if self.grouped:  # one list per group, the null block as 0
            none = [[] for _ in range(s.reqs.num_groups)]
            hits, new = hits or none, new or none
            blocks = self._tables(s, slot) if slot is not None else none
            hit_tokens = hit_tokens or 0
        else:
            hits, new = [int(b) for b in hits], [int(b) for b in new]
            blocks = manager.request_blocks(s, slot) if slot is not None else []
        out = {
            "op": op, "req": name, "ok": ok,
            "hit_blocks": hits, "hit_tokens": len(hits) * z if hit_tokens is None else hit_tokens,
            "new_blocks": new,
            "blocks": blocks,
            "free_queue": block_pool.free_queue(p), "num_free": num_free,
            "ref_cnt": {str(b): int(c) for b, c in enumerate(p.ref_cnt) if c},
            "cached": [int(b) for b in np.nonzero(p.has_hash)[0]],
            "usage": round(1.0 - num_free / (p.num_blocks - 1), 6),
        }
        if self.host is not None:
            out.update(host_hit_blocks=host_hits, loaded=list(loaded), stored=list(stored),
                       host=host_lists(self.host), host_in_use=int(self.host.valid.sum()))
        return out

    def full_state(self) -> dict:
        """Everything the stateful test compares with the oracle, keyed by request name."""
        s = jax.device_get(self.state)
        p, t = s.pool, s.reqs
        return {
            "free_queue": block_pool.free_queue(p),
            "ref_cnt": [int(c) for c in p.ref_cnt],
            "block_hash": {int(b): (int(p.block_hash[b, 0]), int(p.block_hash[b, 1]))
                           for b in np.nonzero(p.has_hash)[0]},
            "requests": {n: {"blocks": self._tables(s, r) if self.grouped else manager.request_blocks(s, r),
                             "num_computed": int(t.num_computed[r]),
                             "num_tokens": int(t.num_tokens[r])}
                         for n, r in self.slots.items()},
        }


def host_lists(index: host_cache.HostIndex) -> dict:
    """host_cache.entries as JSON: resident entries as their slot ids (ref counts are 0 between
    replay ops), ghost hashes as 16 hex digits, lane 0 then lane 1."""
    out = {}
    for k, v in host_cache.entries(index).items():
        if k == "p":
            out[k] = v
        elif k in ("b1", "b2"):
            out[k] = [f"{lo:08x}{hi:08x}" for lo, hi in v]
        else:
            out[k] = [slot for _, slot, _ in v]
    return out


def _init(op: dict) -> Replay:
    pc = op.get("prefix_caching", True)
    if not isinstance(pc, bool):
        raise ReplayError(f"prefix_caching must be true or false, got {json.dumps(pc)}")
    num_blocks = int_field(op.get("num_blocks"), "num_blocks", 2, MAX_BLOCKS)
    block_size = int_field(op.get("block_size"), "block_size", 1, MAX_REQUEST_TOKENS)
    if (num_blocks - 1) * block_size > MAX_REQUEST_TOKENS:
        raise ReplayError(f"(num_blocks - 1) × block_size = {(num_blocks - 1) * block_size:,} tokens: "
                          f"replay keeps every request's tokens, at most {MAX_REQUEST_TOKENS:,} each")
    host_blocks = int_field(op.get("host_blocks", 0), "host_blocks", 0, MAX_HOST_BLOCKS)
    policy = op.get("host_policy", "lru")
    host_cache.check_policy(policy, ReplayError, "host_policy")
    windows = groups_field(op["groups"], pc) if "groups" in op else None
    return Replay(num_blocks, block_size, pc, host_blocks=host_blocks, host_policy=policy, windows=windows)


def iter_trace(lines: Iterable[str]) -> Iterator[tuple[dict, Replay]]:
    """Run a trace, yielding (output dict, replay) per op. Raises ReplayError whose message
    starts with "line N:" at the first bad line (earlier outputs were already yielded)."""
    replay: Replay | None = None
    freed_on: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            if isinstance(line, bytes):
                line = utf8(line)
            op = parse_json(line)
            if not isinstance(op, dict):
                raise ReplayError(f"expected a JSON object, got {json.dumps(op)[:40]}")
            kind = op.get("op")
            if kind not in OPS:
                raise ReplayError(f"unknown op {json.dumps(kind)} (expected one of {', '.join(OPS)})")
            extra = set(op) - _KEYS[kind] - {"op"}
            if extra:
                raise ReplayError(f"unknown key(s) {sorted(extra)} for op {kind!r}")
            if kind == "init":
                replay = _init(op)
                freed_on = {}
                out = replay.view("init", None, True)
            elif replay is None:
                raise ReplayError(f"op {kind!r} before any init")
            elif kind == "reset_prefix_cache":
                out = replay.reset_prefix_cache()
            else:
                name = req_field(op)
                if kind != "add" and name not in replay.slots:
                    if name in freed_on:
                        raise ReplayError(f"double free or use after free of request {name!r} "
                                          f"(freed on line {freed_on[name]})")
                    raise ReplayError(f"unknown request {name!r}")
                if kind == "add":
                    salt = op.get("salt")
                    if salt is not None and not isinstance(salt, str):
                        raise ReplayError(f"'salt' must be a string, got {json.dumps(salt)}")
                    if salt is not None and not encodable(salt):
                        raise ReplayError("'salt' holds a lone UTF-16 surrogate (it has no UTF-8 bytes to hash)")
                    out = replay.add(name, tokens_field(op), salt)
                    if out["ok"]:
                        freed_on.pop(name, None)
                elif kind == "append":
                    out = replay.append(name, tokens_field(op))
                else:
                    out = replay.free(name)
                    freed_on[name] = lineno
        except ReplayError as e:
            raise ReplayError(f"line {lineno}: {e}") from None
        yield out, replay
