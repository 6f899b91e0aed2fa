"""What differs between KV cache groups: vLLM V1's `core/single_type_kv_cache_manager.py`
(FullAttentionManager, SlidingWindowManager) and the hit agreement of
`core/kv_cache_coordinator.py` (HybridKVCacheCoordinator), as array functions.

A model whose layers mix full and sliding-window attention keeps one block table per KV cache
group (kvjax.core.kv_cache_groups groups the layers), all drawing on one block pool. A group is
named by its window: None for full attention, W for a sliding window in which a query at
position q sees keys q - W < k <= q. The rules, as vLLM 0.33 states them:

* Skipped tokens. Once `computed` tokens are computed, a sliding group's next query no longer
  sees the first max(0, computed - W + 1) of them (`get_num_skipped_tokens`); the whole blocks
  among them are freed, last first, and their table entries become the null block 0
  (`remove_skipped_blocks`, run at the start of every allocation). The table keeps its length:
  logical block j stays at entry j, so `num_held` counts the nulls too, and the nulls are
  always a leading run (`num_skipped`). Full attention skips nothing.
* Hits. A full group's hit is the leading run of cached blocks (left to right). A sliding
  group needs only the last cdiv(W - 1, Z) blocks before its hit's end to be cached: it scans
  right to left for the rightmost run of that many cached blocks (the blocks before the run
  are nulls in the hit), else takes the leading run of cached blocks if that is shorter
  (`find_longest_cache_hit`). Several groups of one kind hit together only where every one of
  them holds the block for the hash (the pool keys its cache by hash and group).
* Caching. A sliding group caches its full blocks as a full group does, unless its hits
  need no block at all (W = 1: cdiv(W - 1, Z) = 0), when vLLM's `reachable_block_mask` keeps
  every block out of the cache.
* Agreement. The full groups' hit bounds the sliding groups' search, which can only shorten
  it, and the full groups keep the blocks of the agreed length (vLLM's "simple hybrid": one
  full and one other kind of group, one pass). kvjax accepts at most one sliding window per
  model, which is every hybrid model vLLM serves with attention only (Gemma 2 and 3, gpt-oss,
  Cohere 2, Qwen with max_window_layers; Mistral's single all-sliding group).

* Mamba groups (vLLM's MambaManager with `mamba_cache_mode="none"`, windows entry `MAMBA`): a
  request holds one state block in each from its first allocation to its end (the group's block
  size is max_model_len, so cdiv(tokens, it) is 1), skips nothing, caches nothing and hits nothing:
  vLLM's none mode runs with prefix caching off ("Mamba prefix caching requires
  mamba_cache_mode='align'"), so a pool with a Mamba group refuses prefix caching.

Axes: the kvjax package docstring's legend; here G is the KV cache groups.
"""
from __future__ import annotations

import jax.numpy as jnp

from kvjax.core.kv_cache_groups import MAMBA
from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv
from kvjax.utils.checks import is_int


def check_windows(windows, prefix_caching: bool = False) -> tuple[int | str | None, ...]:
    """The groups' windows as a tuple (None: full attention, MAMBA: a Mamba group), refused by name
    when malformed, when two sliding groups have different windows, or when a Mamba group would be
    prefix-cached."""
    if not isinstance(windows, (tuple, list)) or not windows:
        raise KvjaxError(f"windows must be a non-empty tuple of None (full attention) or window sizes, "
                         f"got {windows!r}")
    if MAMBA in windows and prefix_caching:
        raise KvjaxError("prefix caching with Mamba groups needs vLLM's mamba_cache_mode='align', which kvjax does "
                         "not implement; vLLM's 'none' mode, kvjax's, runs without prefix caching")
    if all(w == MAMBA for w in windows):
        raise KvjaxError("every group is a Mamba group: an attention-free pool is not supported")
    for w in windows:
        if w is not None and w != MAMBA and (not is_int(w) or w < 1):
            raise KvjaxError(f"a group's sliding window must be an integer >= 1 (or None for full attention), "
                             f"got {w!r}")
    sizes = sorted({int(w) for w in windows if w is not None and w != MAMBA})
    if len(sizes) > 1:
        raise KvjaxError(f"groups with different sliding windows {sizes} are not supported: vLLM's hybrid "
                         "coordinator needs a fixed-point search for them, and no attention-only model has them")
    return tuple(w if w is None or w == MAMBA else int(w) for w in windows)


def sliding_window(windows: tuple[int | str | None, ...]) -> int | None:
    """The one sliding window among the groups, None when none slides."""
    return next((w for w in windows if w is not None and w != MAMBA), None)


def caches(windows: tuple[int | str | None, ...], block_size: int) -> tuple[bool, ...]:
    """Whether each group puts its full blocks in the prefix cache (all but W = 1 and Mamba groups)."""
    return tuple(w is None or (w != MAMBA and cdiv(w - 1, block_size) >= 1) for w in windows)


def blocks_wanted(windows: tuple[int | str | None, ...], total, block_size: int):
    """The table entries each group needs for `total` tokens (i32[...]): cdiv(total, Z) for
    attention, one state block for a Mamba group once there is a token. -> i32[..., G]."""
    t = jnp.asarray(total, jnp.int32)[..., None]
    mamba = jnp.asarray([w == MAMBA for w in windows])
    return jnp.where(mamba, (t > 0).astype(jnp.int32), cdiv(t, block_size)).astype(jnp.int32)


def skipped_blocks(windows: tuple[int | None, ...], computed, block_size: int):
    """The leading blocks each group no longer attends to once `computed` tokens (i32[...]) are
    computed: max(0, computed - W + 1) // Z for a sliding group, 0 for full. -> i32[..., G]."""
    w = jnp.asarray([0 if x is None or x == MAMBA else x for x in windows], jnp.int32)
    slides = jnp.asarray([x is not None and x != MAMBA for x in windows])
    c = jnp.asarray(computed, jnp.int32)[..., None]
    return jnp.where(slides, jnp.maximum(c - w + 1, 0) // block_size, 0).astype(jnp.int32)


def removal(windows, num_skipped, num_held, computed, block_size: int, max_blocks: int):
    """The table entries `remove_skipped_blocks` frees: entries num_skipped .. e - 1 of each
    group, e = the skipped blocks capped at the entries held. num_skipped, num_held: i32[..., G];
    computed: i32[...]. -> (live bool[..., G, M], the new num_skipped i32[..., G])."""
    end = jnp.maximum(num_skipped, jnp.minimum(skipped_blocks(windows, computed, block_size), num_held))
    j = jnp.arange(max_blocks)
    return (j >= num_skipped[..., None]) & (j < end[..., None]), end


def hit_length(windows, found, max_hits, block_size: int):
    """The hit the groups agree on. found: bool[G, M], group g holds a cached block for the
    request's j-th block hash; max_hits: the most blocks a hit may cover. -> (hit blocks i32[],
    the first entry a sliding group takes i32[]: its entries before are nulls)."""
    m = found.shape[1]
    j = jnp.arange(m)
    full = [g for g, w in enumerate(windows) if w is None]
    length = jnp.asarray(max_hits, jnp.int32)
    if full:  # the full groups' leading run, bounded by max_hits
        run = jnp.cumprod(found[jnp.asarray(full)].all(axis=0) & (j < length))
        length = run.sum(dtype=jnp.int32)
    w = sliding_window(windows)
    if w is None:
        return length, jnp.int32(0)
    need = max(cdiv(w - 1, block_size), 1)  # vLLM's contiguous blocks; W = 1 finds the same with 1
    slides = jnp.asarray([g for g, x in enumerate(windows) if x is not None])
    ok = found[slides].all(axis=0) & (j < length)  # bool[M]
    count = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(ok, dtype=jnp.int32)])  # count[e] = sum ok[:e]
    e = jnp.arange(m + 1)
    ends = (e >= need) & (e <= length) & (count - count[jnp.maximum(e - need, 0)] == need)
    right = jnp.max(jnp.where(ends, e, 0)).astype(jnp.int32)  # the rightmost run's end, 0 if none
    leading = jnp.cumprod(ok).sum(dtype=jnp.int32)  # no run: the leading cached blocks (fewer than need)
    return jnp.where(right > 0, right, leading), jnp.where(right > 0, right - need, 0).astype(jnp.int32)
