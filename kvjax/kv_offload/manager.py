"""The host-memory offload tier's index and eviction policy: vLLM V1's CPU offloading
(OffloadingConnector, `--kv_offloading_backend native`) as pure functions over a pytree.

E host slots each hold one offloaded KV block, named by its chained block hash (two uint32
lanes, `kvjax/core/kv_cache_utils.py`). This module decides WHICH slot holds WHICH hash and what to evict;
copying the KV bytes is the caller's job. The rules, from vLLM's `vllm/v1/kv_offload/`
(`abstract.py`, `lru_manager.py`, `arc_manager.py`, `cpu/manager.py`) and the scheduler side
of `distributed/kv_transfer/kv_connector/v1/offloading_connector.py`:

* lookup  = how many of the hashes, from the first, are all resident (a pure query).
* touch   = walk the hashes LAST to FIRST, moving each resident one to the MRU end, so the
            first block of a prefix ends most recent and a prefix is evicted from its tail.
            ARC: a T1 hit moves to T2's MRU end, a T2 hit to T2's MRU end; a hash in ghost
            list B1 raises the target p by max(1, |B2| // |B1|) (at most E), one in B2 lowers
            it by max(1, |B1| // |B2|) (at least 0), in that walk order, and moves to its
            ghost list's MRU end (`arc_manager.py`). A hash in none of the lists is ignored:
            the connector touches all of a request's block hashes, resident or not.
* prepare_load / complete_load = ref count +1 / -1: a block with ref count > 0 (a load in
            flight) is never evicted.
* store   = vLLM's prepare_store, complete_store and the touch its connector calls right after:
            masked hashes not yet resident are stored, in order; the victims are chosen first,
            as many as the free slots lack: LRU the least recent evictable; ARC from T1's LRU
            end while |T1| >= p and T1 has an evictable block, else from T2's LRU end (vLLM
            does not fall back from T2 to T1, and neither do we). Evictable = ref count 0 and
            not among the masked hashes (`cpu/manager.py` protects a store's own hashes). ARC
            victims go to the MRU end of B1 / B2, each ghost list then trimmed to its E most
            recent; a stored hash enters T1 (never T2) and leaves the ghost lists. Then, if
            any hash was newly stored, all masked resident hashes are touched; the ones just
            stored stay in T1 (vLLM's touch sees them not yet loadable, so not a second use).
            (The connector then touches the request's earlier blocks too: the caller's
            touch, kvjax.core.sched.scheduler.)

Where kvjax differs from vLLM: vLLM's prepare_store is all-or-nothing (None when it cannot
evict enough); here the hashes are stored in order until no victim is left and the rest are
not stored. A hash repeated in one store is stored once (vLLM, silent on repeats, would
allocate two slots and leak one); the repeat is not a second use, as vLLM's touch rule for
not-yet-loadable blocks says. p is an integer, as in `arc_manager.py` (`cpu/policies/arc.py`
later made it a float). Free slots are taken lowest id first (vLLM's ids come from a free
list; slot ids are not part of the policy).

ARC and its paper (Megiddo & Modha, FAST 2003). vLLM's code is explicit on every ARC rule
used here, so none comes from the paper; where vLLM departs from it, kvjax follows vLLM:
each ghost list is bounded by E (the paper bounds |T1| + |B1| <= E and all four by 2E); a
ghost hit only moves p (the paper also fetches the block into T2; here it re-enters T1 when
next stored); T1 is chosen when |T1| >= p (the paper: |T1| > p, or = p on a B2 hit); p
moves by integer max(1, ratio) (the paper: a real ratio); the paper has no pinned blocks.

Every list is held as positions, with `kvjax/core/block_pool.py`'s list primitives: each slot has its position in
the LRU list (ARC: in T1 or in T2), 0 = LRU end, INT32_MAX = not in it; each ghost cell
its position in B1 or B2. Removing entries is a cumulative sum, appending is length + rank,
and the k oldest evictable blocks are those whose rank among evictable ones is < k, so every
op is a fixed number of O(E + A*E) vector ops. Victims need no loop either: with p fixed
during a store, ARC takes k1 = min(need, a1, max(|T1| - p + 1, 0)) from T1 (a1 its evictable
blocks) and the rest from T2. Only touch's p walk is sequential (each step clamps to
[0, E]): a lax.fori_loop over the A hashes, a scalar per step.

Axes: the kvjax package docstring's legend; A is the hashes (or slots) one operation is handed,
zero padded (`pad_hashes`), and each ARC ghost list has E cells.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.core.block_pool import NOT_LISTED, close_up, count_before, first_holders, ordered
from kvjax.errors import KvjaxError, require
from kvjax.math_utils import pow2_bucket
from kvjax.utils.checks import is_int, show_value

POLICIES = ("lru", "arc")


@struct.dataclass
class HostIndex:
    """Which hash each host slot holds, its in-flight loads, and the eviction order."""

    num_slots: int = struct.field(pytree_node=False)  # E
    policy: str = struct.field(pytree_node=False)  # "lru" | "arc"
    block_hash: jax.Array  # u32[E, 2] hash held by the slot; 0 when not valid
    valid: jax.Array  # bool[E] slot holds a block (resident); False = free
    ref_cnt: jax.Array  # i32[E] loads in flight from the slot; > 0 protects it from eviction
    pos: jax.Array  # i32[2, E] position in list 0 (LRU; ARC T1) / 1 (ARC T2); 0 = LRU end
    ghost_hash: jax.Array  # u32[2, E, 2] ARC B1 (row 0) and B2 (row 1) hashes; LRU: u32[2, 0, 2]
    ghost_pos: jax.Array  # i32[2, E] position in B1 / B2 (0 = oldest); INT32_MAX = empty cell
    target: jax.Array  # i32[] ARC's target size p of T1, in [0, E]; 0 for LRU


def pad_hashes(rows, size: int | None = None) -> np.ndarray:
    """Block hashes u32[n, 2] zero padded to `size` rows (default: a power of two), the A of
    every operation here, whose jitted forms compile once per A. Pass n (or a mask) for the
    live rows."""
    rows = np.asarray(rows, np.uint32).reshape(-1, 2)
    out = np.zeros((pow2_bucket(len(rows)) if size is None else size, 2), np.uint32)
    out[: len(rows)] = rows
    return out


def check_policy(policy, error: type = KvjaxError, name: str = "policy", show=json.dumps, got=show_value) -> str:
    """The host tier's eviction policies, vLLM's kv_offloading ones: "lru" or "arc". The message
    names `name`, the choices written by `show`, the value by `got`."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise error(f"{name} must be one of {', '.join(map(show, POLICIES))}, got {got(policy)}")
    return policy


def init(num_host_blocks: int, policy: str = "lru") -> HostIndex:
    """An empty index of num_host_blocks slots, evicting by policy ("lru" or "arc")."""
    if not is_int(num_host_blocks) or num_host_blocks < 1:
        raise KvjaxError(f"num_host_blocks must be an int >= 1, got {num_host_blocks!r}")
    h = int(num_host_blocks)
    check_policy(policy)
    g = h if policy == "arc" else 0
    return HostIndex(num_slots=h, policy=policy, block_hash=jnp.zeros((h, 2), jnp.uint32),
                     valid=jnp.zeros(h, bool), ref_cnt=jnp.zeros(h, jnp.int32),
                     pos=jnp.full((2, h), NOT_LISTED, jnp.int32), ghost_hash=jnp.zeros((2, g, 2), jnp.uint32),
                     ghost_pos=jnp.full((2, g), NOT_LISTED, jnp.int32), target=jnp.zeros((), jnp.int32))


# ------------------------------------------------------------------ list primitives
def _length(pos):
    return (pos < NOT_LISTED).sum(dtype=jnp.int32)


def _rank(pos, sub):
    """Order of the listed sub entries (0 = nearest the LRU end); INT32_MAX for the others."""
    return jnp.where(sub & (pos < NOT_LISTED), count_before(pos, sub), NOT_LISTED)


def _suffix_rank(sel):
    """rank[k] = number of selected entries after k: the order of a last-to-first walk."""
    c = jnp.cumsum(sel[::-1].astype(jnp.int32))[::-1]
    return c - sel


def _check_hashes(hashes) -> None:
    if hashes.ndim != 2 or hashes.shape[1] != 2 or hashes.dtype != jnp.uint32:
        raise KvjaxError(f"hashes must be u32[N, 2], got {hashes.dtype}{list(hashes.shape)}")


def _same(a, b):
    """bool[len(a), len(b)]: hash a[i] == hash b[j]. a, b: u32[.., 2]."""
    return (a[:, None, 0] == b[None, :, 0]) & (a[:, None, 1] == b[None, :, 1])


def _find(state: HostIndex, hashes):
    """The slot holding each hash (the lowest, were there two). hashes: u32[A, 2] -> (slot i32[A],
    resident bool[A]). A search of the sorted hashes (block_pool.first_holders): O(E log A), not
    A × E comparisons (0.7 s a store of 1,024 hashes in 209,715 slots on a 2-core CPU)."""
    return first_holders(state.block_hash, state.valid, hashes)


def _first(hashes, live):
    """bool[A]: live and no earlier live entry holds the same hash."""
    n = hashes.shape[0]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [k, j]: j before k
    return live & ~(_same(hashes, hashes) & earlier & live[None, :]).any(axis=1)


def _move_to_mru(state: HostIndex, slot, sel, fresh):
    """vLLM's touch walk for resident hashes: slot i32[A], sel bool[A] first occurrences to
    touch; fresh bool[A] just stored (ARC keeps those in T1). Each touched block goes to the
    MRU end of its new list, the first hash last (most recent)."""
    h = state.num_slots
    at = lambda m: jnp.where(m, slot, h)  # noqa: E731 - scatter index, out of range = dropped
    to0 = sel & fresh if state.policy == "arc" else sel  # ends in list 0 (LRU / T1)
    to1 = sel & ~to0  # ends in T2
    moved = jnp.zeros(h, bool).at[at(sel)].set(True, mode="drop")
    join0 = jnp.zeros(h, bool).at[at(to0)].set(True, mode="drop")
    join1 = jnp.zeros(h, bool).at[at(to1)].set(True, mode="drop")
    rank0 = jnp.zeros(h, jnp.int32).at[at(to0)].set(_suffix_rank(to0), mode="drop")
    rank1 = jnp.zeros(h, jnp.int32).at[at(to1)].set(_suffix_rank(to1), mode="drop")
    p0, p1 = close_up(state.pos[0], moved), close_up(state.pos[1], moved)
    p0 = jnp.where(join0, _length(p0) + rank0, p0)
    p1 = jnp.where(join1, _length(p1) + rank1, p1)
    return state.replace(pos=jnp.stack([p0, p1]))


# ------------------------------------------------------------------ the operations
@jax.jit
def lookup(state: HostIndex, hashes, n):
    """Number of leading hashes among hashes[:n] (u32[A, 2]) that are all resident. -> i32[]."""
    _check_hashes(hashes)
    _, resident = _find(state, hashes)
    live = jnp.arange(hashes.shape[0]) < n
    return jnp.cumprod((resident & live).astype(jnp.int32)).sum(dtype=jnp.int32)


@jax.jit
def touch(state: HostIndex, hashes, n):
    """Mark hashes[:n] as just used (module docstring); ARC ghost hits move p. -> state."""
    _check_hashes(hashes)
    live = jnp.arange(hashes.shape[0]) < n
    slot, resident = _find(state, hashes)
    state = _move_to_mru(state, slot, _first(hashes, live & resident), jnp.zeros_like(live))
    if state.policy != "arc":
        return state
    g = live & ~resident
    in_b1 = g & (_same(hashes, state.ghost_hash[0]) & (state.ghost_pos[0] < NOT_LISTED)[None, :]).any(1)
    in_b2 = g & (_same(hashes, state.ghost_hash[1]) & (state.ghost_pos[1] < NOT_LISTED)[None, :]).any(1)
    len1, len2 = _length(state.ghost_pos[0]), _length(state.ghost_pos[1])
    up, down = jnp.maximum(1, len2 // jnp.maximum(len1, 1)), jnp.maximum(1, len1 // jnp.maximum(len2, 1))
    step = jnp.where(in_b1, up, jnp.where(in_b2, -down, 0))  # i32[A]
    last = hashes.shape[0] - 1  # the walk runs last to first; each step clamps to [0, E]
    p = jax.lax.fori_loop(0, hashes.shape[0],
                          lambda i, p: jnp.clip(p + step[last - i], 0, state.num_slots), state.target)
    ghost_pos = jnp.stack([_ghost_to_mru(state.ghost_hash[r], state.ghost_pos[r], hashes, hit)
                           for r, hit in ((0, in_b1), (1, in_b2))])
    return state.replace(target=p, ghost_pos=ghost_pos)


def _ghost_to_mru(ghash, gpos, hashes, hit):
    """A ghost hit also moves its ghost entry to its list's MRU end, in the walk's order (the
    first hash ends most recent), so the ghost list keeps its recently asked-for entries."""
    g = gpos.shape[0]
    match = _same(hashes, ghash) & (gpos < NOT_LISTED)[None, :]  # bool[A, E]
    cell = jnp.where(hit, jnp.argmax(match, axis=1), g)
    sel = _first(hashes, hit)
    moved = jnp.zeros(g, bool).at[cell].set(True, mode="drop")
    rank = jnp.zeros(g, jnp.int32).at[jnp.where(sel, cell, g)].set(_suffix_rank(sel), mode="drop")
    gpos = close_up(gpos, moved)
    return jnp.where(moved, _length(gpos) + rank, gpos)


@jax.jit
def prepare_load(state: HostIndex, hashes, n):
    """Ref count +1 for each resident hash of hashes[:n] (a repeat counts twice), protecting
    it from eviction until complete_load. -> (state, slots i32[A]; -1 = not resident)."""
    _check_hashes(hashes)
    slot, resident = _find(state, hashes)
    hit = resident & (jnp.arange(hashes.shape[0]) < n)
    ref = state.ref_cnt.at[jnp.where(hit, slot, state.num_slots)].add(1, mode="drop")
    return state.replace(ref_cnt=ref), jnp.where(hit, slot, -1)


@jax.jit
def complete_load(state: HostIndex, slots, n):
    """Ref count -1 for slots[:n] (i32[A]; -1 entries are skipped). Fails, changing nothing,
    when a slot is out of range or would drop below 0. -> (state, ok)."""
    h = state.num_slots
    live = (jnp.arange(slots.shape[0]) < n) & (slots != -1)
    in_range = (slots >= 0) & (slots < h)
    cnt = jnp.zeros(h, jnp.int32).at[jnp.where(live & in_range, slots, h)].add(1, mode="drop")
    ok = (in_range | ~live).all() & (state.ref_cnt >= cnt).all()
    return state.replace(ref_cnt=jnp.where(ok, state.ref_cnt - cnt, state.ref_cnt)), ok


def _ghost_push(ghash, gpos, victims, vrank, block_hash):
    """Append the victims (bool[E] over slots, vrank their order) at one ghost list's MRU
    end, keeping its E most recent (dropping the oldest first leaves the same entries)."""
    g = gpos.shape[0]
    k = victims.sum(dtype=jnp.int32)
    gpos = close_up(gpos, gpos < _length(gpos) + k - g)
    free = gpos == NOT_LISTED
    cell_of = jnp.zeros(g, jnp.int32).at[jnp.where(free, jnp.cumsum(free) - 1, g)].set(
        jnp.arange(g, dtype=jnp.int32), mode="drop")  # the r-th empty cell
    cell = jnp.where(victims, cell_of[jnp.where(victims, vrank, 0)], g)
    return ghash.at[cell].set(block_hash, mode="drop"), gpos.at[cell].set(_length(gpos) + vrank, mode="drop")


@jax.jit
def store(state: HostIndex, hashes, mask):
    """Store the masked hashes (u32[A, 2], bool[A]) per the module docstring.
    -> (state, slots i32[A]: the slot each masked hash is resident in afterwards, -1 if not;
    stored bool[A]: newly written, i.e. the caller copies that block's KV to slots[k])."""
    _check_hashes(hashes)
    h, mask = state.num_slots, mask.astype(bool)
    slot, resident = _find(state, hashes)
    first = _first(hashes, mask)
    want = first & ~resident  # bool[A] to store, in order
    order = jnp.cumsum(want) - 1  # i32[A] 0.. among want
    protected = jnp.zeros(h, bool).at[jnp.where(mask & resident, slot, h)].set(True, mode="drop")
    num_free = h - state.valid.sum(dtype=jnp.int32)
    need = jnp.maximum(want.sum(dtype=jnp.int32) - num_free, 0)
    evictable = state.valid & (state.ref_cnt == 0) & ~protected  # bool[E]
    r0, r1 = _rank(state.pos[0], evictable), _rank(state.pos[1], evictable)
    if state.policy == "lru":
        k0, k1 = need, jnp.zeros((), jnp.int32)
    else:  # p is fixed during a store, so the T1 / T2 split has a closed form
        a0 = (evictable & (state.pos[0] < NOT_LISTED)).sum(dtype=jnp.int32)
        a1 = (evictable & (state.pos[1] < NOT_LISTED)).sum(dtype=jnp.int32)
        k0 = jnp.minimum(jnp.minimum(need, a0), jnp.maximum(_length(state.pos[0]) - state.target + 1, 0))
        k1 = jnp.minimum(need - k0, a1)
    v0, v1 = r0 < k0, r1 < k1  # bool[E] victims from list 0 / 1, oldest first
    gh, gp = state.ghost_hash, state.ghost_pos
    if state.policy == "arc":
        b1 = _ghost_push(gh[0], gp[0], v0, r0, state.block_hash)
        b2 = _ghost_push(gh[1], gp[1], v1, r1, state.block_hash)
        gh, gp = jnp.stack([b1[0], b2[0]]), jnp.stack([b1[1], b2[1]])
    gone = v0 | v1
    valid = state.valid & ~gone
    pos = jnp.stack([close_up(state.pos[0], v0), close_up(state.pos[1], v1)])
    # Take the lowest free slots, in order, for as many hashes as there are slots.
    free = ~valid
    free_list = jnp.zeros(h, jnp.int32).at[jnp.where(free, jnp.cumsum(free) - 1, h)].set(
        jnp.arange(h, dtype=jnp.int32), mode="drop")
    stored = want & (order < free.sum(dtype=jnp.int32))
    new_slot = jnp.where(stored, free_list[jnp.clip(order, 0, h - 1)], h)
    block_hash = jnp.where(gone[:, None], jnp.uint32(0), state.block_hash).at[new_slot].set(hashes, mode="drop")
    valid = valid.at[new_slot].set(True, mode="drop")
    rank = jnp.zeros(h, jnp.int32).at[new_slot].set(order, mode="drop")
    joined = jnp.zeros(h, bool).at[new_slot].set(True, mode="drop")
    pos = pos.at[0].set(jnp.where(joined, _length(pos[0]) + rank, pos[0]))  # LRU / T1 tail, in order
    if state.policy == "arc":  # a stored hash leaves the ghost lists
        hit = (_same(gh.reshape(-1, 2), hashes) & stored[None, :]).any(1).reshape(gp.shape)
        gp = jnp.stack([close_up(gp[0], hit[0]), close_up(gp[1], hit[1])])
        gh = jnp.where((gp < NOT_LISTED)[..., None], gh, jnp.uint32(0))
    state = state.replace(block_hash=block_hash, valid=valid, pos=pos, ghost_hash=gh, ghost_pos=gp)
    slot, resident = _find(state, hashes)
    state = _move_to_mru(state, slot, first & resident & stored.any(), stored)  # no touch if nothing new
    return state, jnp.where(mask & resident, slot, -1), stored


def offer(state: HostIndex, rows, first: int):
    """vLLM's connector storing one request's new blocks: store rows[first:] and, when that
    wrote anything, touch rows[:first] too (the connector touches the request's whole prefix;
    store already touched the new ones). rows: u32[end, 2], the request's full-block hashes
    in order (host side). -> (state, slots i32[end - first], stored bool[end - first]), as
    store returns them for rows[first:]."""
    rows = np.asarray(rows, np.uint32).reshape(-1, 2)
    n = len(rows) - first
    state, slots, stored = store(state, pad_hashes(rows[first:]), np.arange(pow2_bucket(n)) < n)
    slots, stored = np.asarray(slots)[:n], np.asarray(stored)[:n]
    if first > 0 and stored.any():
        state = touch(state, pad_hashes(rows[:first]), first)
    return state, slots, stored


# ----------------------------------------------------------------------------- host views
def _key(row) -> tuple[int, int]:
    return int(row[0]), int(row[1])


def entries(state: HostIndex) -> dict:
    """Every list in policy order, LRU end first (host side). Resident entries are
    (hash, slot, ref_cnt); ghost entries are hashes. LRU: {"lru"}; ARC: {"t1", "t2", "b1",
    "b2", "p"}."""
    s = jax.device_get(state)
    pos, bh, ref = np.asarray(s.pos), np.asarray(s.block_hash), np.asarray(s.ref_cnt)
    listed = [[(_key(bh[i]), i, int(ref[i])) for i in ordered(pos[r])] for r in (0, 1)]
    if s.policy == "lru":
        return {"lru": listed[0]}
    gp, gh = np.asarray(s.ghost_pos), np.asarray(s.ghost_hash)
    ghosts = [[_key(gh[r][i]) for i in ordered(gp[r])] for r in (0, 1)]
    return {"t1": listed[0], "t2": listed[1], "b1": ghosts[0], "b2": ghosts[1], "p": int(s.target)}


def check_invariants(state: HostIndex) -> None:
    """Check the index's own invariants on the host; raise AssertionError naming the likely cause."""
    s = jax.device_get(state)
    h, valid, ref = s.num_slots, np.asarray(s.valid), np.asarray(s.ref_cnt)
    pos, bh = np.asarray(s.pos), np.asarray(s.block_hash)
    for r in (0, 1):
        listed = pos[r][pos[r] < NOT_LISTED]
        require(sorted(listed.tolist()) == list(range(len(listed))),
                f"list {r}'s positions are not exactly 0..len-1 (a remove or append miscounted)")
    in_lists = (pos < NOT_LISTED).sum(axis=0)
    require((in_lists == valid).all(), f"slots {np.flatnonzero(in_lists != valid)} are valid iff in exactly one list")
    require(s.policy == "arc" or not (pos[1] < NOT_LISTED).any(), "an LRU index put a slot in list 1")
    require((ref >= 0).all() and not ref[~valid].any(), "negative ref_cnt, or a free slot with loads in flight")
    require(not bh[~valid].any(), "a free slot still holds a hash (an eviction did not clear it)")
    keys = [_key(bh[i]) for i in np.flatnonzero(valid)]
    require(len(set(keys)) == len(keys), "one hash is resident in two slots (store did not check residency)")
    if s.policy != "arc":
        return
    require(0 <= int(s.target) <= h, f"ARC target p = {int(s.target)} outside [0, {h}]")
    gp, gh = np.asarray(s.ghost_pos), np.asarray(s.ghost_hash)
    ghosts = []
    for r in (0, 1):
        listed = gp[r][gp[r] < NOT_LISTED]
        require(sorted(listed.tolist()) == list(range(len(listed))), f"ghost list B{r + 1}'s positions are broken")
        require(not gh[r][gp[r] == NOT_LISTED].any(), f"an empty B{r + 1} cell still holds a hash")
        ghosts += [_key(gh[r][i]) for i in np.flatnonzero(gp[r] < NOT_LISTED)]
    require(len(set(ghosts)) == len(ghosts), "a hash is twice in the ghost lists")
    require(not set(ghosts) & set(keys), "a resident hash is also a ghost (store did not drop it from B1/B2)")
