"""vLLM 0.33's KV cache groups: which layers of a hybrid model share a block table
(`vllm/v1/core/kv_cache_planning.py`, `vllm/v1/kv_cache_interface.py`). No JAX.

A layer is full attention (window None) or sliding window (window W: the query at position q sees
the keys q − W < k ≤ q). `windows[i]` is layer i's.

Groups (`kv_cache_groups`: vLLM's `get_kv_cache_groups` for layers of one page size):
- every layer of one type (all full, or all sliding with one window): one group of every layer, its
  page the sum of theirs — the single-group arithmetic of `KVSpec.bytes_per_block`;
- otherwise the layers are bucketed by type in the order each type first appears
  (`_get_kv_cache_groups_uniform_page_size`); the group size is the smallest bucket's layer count,
  or the largest's when that is under 1.5 × the smallest; a bucket of n layers splits into
  cdiv(n, group size) groups, the i-th holding its layers[i::that many] (the last ones padded).
  Their layers' pages must be equal: vLLM would otherwise scale block sizes per group, which one
  block size for every group (kvjax's pool) cannot, so that is refused.

A request of max_model_len tokens holds in each group (`max_memory_usage_bytes` / page): full
attention cdiv(max_model_len, Z) blocks; a sliding window cdiv(min(W − 1 + in-flight tokens,
max_model_len), Z) + 1 (`SlidingWindowSpec.max_admission_blocks_per_request`: the window may start
mid-block, and blocks are freed only once the tokens in flight are processed).

State-space layers (vLLM's `MambaSpec`, kvjax.core.mamba_spec) stand among the windows as `MAMBA`: a
group of Mamba layers holds one state block per request (`mamba_cache_mode="none"`), and its page, one
layer's state, is padded to exactly the attention page, which the attention block size was grown to hold
(`hybrid_block_size`). Every page is then one size, and the layers group as above: Granite-4.0-H's 36
Mamba and 4 attention layers are 9 Mamba groups and 1 attention group of 4 layers each.

`all_full(windows)` is vLLM's fallback without the hybrid manager (`unify_hybrid_kv_cache_specs`,
`--disable-hybrid-kv-cache-manager`): every sliding layer is cached as a full one.

The engine's configuration groups a model's layers with these (kvjax.config.engine.resolve_kv_cache_groups);
what a budget buys for the groups is kvjax.accounting.hybrid's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvjax.core.kv_cache_interface import KVSpec
from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv
from kvjax.utils.checks import check_int


MAMBA = "mamba"  # a Mamba layer's entry among the layer windows


class HybridError(KvjaxError):
    """Layers that vLLM's grouping cannot place with one block size; the message names them."""


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: layers of one attention type, one block table."""

    window: int | str | None  # None: full attention; MAMBA: state-space layers; else the sliding window W
    layers: tuple[int, ...]
    block_bytes: int  # one block of this group: the sum of its layers' pages

    @property
    def kind(self) -> str:
        return "full_attention" if self.window is None else "mamba" if self.window == MAMBA else "sliding_window"

    def blocks_per_request(self, block_size: int, max_model_len: int, in_flight_tokens: int) -> int:
        """Blocks one request of max_model_len tokens holds at most in this group."""
        if self.window is None:
            return cdiv(max_model_len, block_size)
        if self.window == MAMBA:  # one state, whatever the length (MambaSpec.max_memory_usage_bytes / page)
            return 1
        return cdiv(min(self.window - 1 + in_flight_tokens, max_model_len), block_size) + 1


def check_layer_windows(windows: Sequence[int | str | None], num_layers: int) -> tuple[int | str | None, ...]:
    """Each layer's window as a tuple: one per attention layer (num_layers of them), None or an integer
    >= 1, and MAMBA for each state-space layer among them (else HybridError)."""
    windows = tuple(windows)
    if sum(w != MAMBA for w in windows) != num_layers:
        raise HybridError(f"{sum(w != MAMBA for w in windows)} layer windows for {num_layers} layers")
    return tuple(w if w is None or w == MAMBA else check_int(w, f"layer {i}'s sliding window", 1, None, HybridError)
                 for i, w in enumerate(windows))


def all_full(windows: Sequence[int | None]) -> tuple[None, ...]:
    """vLLM's fallback without the hybrid manager: every layer cached as full attention."""
    if MAMBA in windows:  # vLLM: "hybrid SSM models require HMA and will fail at startup without it"
        raise HybridError("a model with Mamba layers needs the hybrid KV cache manager (vLLM has no fallback for it)")
    return (None,) * len(windows)


def kv_cache_groups(spec: KVSpec, windows: Sequence[int | str | None], block_size: int, *,
                    layer_ids: Sequence[int] | None = None, mamba_page: int | None = None) -> tuple[KVGroup, ...]:
    """The KV cache groups of `spec`'s attention layers with these windows (see the module docstring).
    With Mamba layers, windows hold MAMBA at their places (spec's layers are the others, in order),
    mamba_page is one Mamba layer's state bytes, and layer_ids gives each entry's decoder layer
    (default: its place), which the groups list."""
    windows = check_layer_windows(windows, spec.num_layers)
    layer_ids = tuple(range(len(windows))) if layer_ids is None else tuple(layer_ids)
    if len(layer_ids) != len(windows):
        raise HybridError(f"{len(layer_ids)} layer ids for {len(windows)} layer windows")
    attn = iter(range(spec.num_layers))
    pages = [None if w == MAMBA else spec.page_bytes(next(attn), block_size) for w in windows]
    if MAMBA in windows:
        pages = _padded_mamba_pages(pages, mamba_page, block_size)
    buckets: dict[int | str | None, list[int]] = {}
    for i, w in enumerate(windows):
        buckets.setdefault(w, []).append(i)
    if len(buckets) == 1:
        (w, layers), = buckets.items()
        return (KVGroup(w, tuple(layer_ids[j] for j in layers), sum(pages)),)
    if len(set(pages)) > 1:
        sizes = sorted(set(pages))
        raise HybridError(f"hybrid layers with pages of {', '.join(f'{p:,}' for p in sizes)} B: vLLM would give "
                          "each group its own block size, and kvjax's groups share one")
    smallest, largest = min(map(len, buckets.values())), max(map(len, buckets.values()))
    group_size = largest if largest < 1.5 * smallest else smallest
    groups = []
    for w, layers in buckets.items():
        n = cdiv(len(layers), group_size)
        groups += [KVGroup(w, tuple(layer_ids[j] for j in layers[i::n]), len(layers[i::n]) * pages[0])
                   for i in range(n)]
    return tuple(groups)


def _padded_mamba_pages(pages: list, mamba_page: int | None, block_size: int) -> list[int]:
    """Every Mamba layer's page padded to the attention page (vLLM's mamba_page_size_padded), which
    must hold it: the block size is grown to make it so (kvjax.core.mamba_spec.hybrid_block_size)."""
    check_int(mamba_page, "mamba_page (a Mamba layer's state bytes)", 1, None, HybridError)
    attention = max(p for p in pages if p is not None)
    if mamba_page > attention:
        raise HybridError(f"a Mamba state of {mamba_page:,} B does not fit an attention page of {attention:,} B at "
                          f"block size {block_size}: grow it first (kvjax.core.mamba_spec.hybrid_block_size)")
    return [attention if p is None else p for p in pages]
