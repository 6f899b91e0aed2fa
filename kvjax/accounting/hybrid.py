"""vLLM 0.33's KV cache arithmetic for hybrid models: the layers grouped into KV cache groups, one
block table each, all drawing on one shared block pool (`vllm/v1/core/kv_cache_planning.py`,
`vllm/v1/kv_cache_interface.py`, `vllm/v1/core/kv_cache_utils.py`). No JAX.

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

A block is one page for every layer slot of a group, so bytes per block are the largest group's
pages (`_get_kv_cache_bytes_per_block`), and num_blocks = budget // bytes per block
(`get_kv_cache_config_from_groups`), block 0 among them as the null block.

A request of max_model_len tokens holds in each group (`max_memory_usage_bytes` / page): full
attention cdiv(max_model_len, Z) blocks; a sliding window cdiv(min(W − 1 + in-flight tokens,
max_model_len), Z) + 1 (`SlidingWindowSpec.max_admission_blocks_per_request`: the window may start
mid-block, and blocks are freed only once the tokens in flight are processed), in-flight tokens
being max_concurrent_batches × max_num_batched_tokens (`VllmConfig.max_in_flight_tokens`; 1 batch
without async scheduling or pipeline parallelism). Max concurrency is num_blocks over their sum
(`get_max_concurrency_for_kv_cache_config`), the KV cache size in tokens int(max concurrency ×
max_model_len) (`get_kv_cache_capacity`).

`all_full(windows)` is vLLM's fallback without the hybrid manager (`unify_hybrid_kv_cache_specs`,
`--disable-hybrid-kv-cache-manager`): every sliding layer is cached as a full one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvjax.core.kv_cache_interface import KVSpec
from kvjax.errors import KvjaxError, check_int
from kvjax.math_utils import cdiv


class HybridError(KvjaxError):
    """Layers that vLLM's grouping cannot place with one block size; the message names them."""


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: layers of one attention type, one block table."""

    window: int | None  # None: full attention; else the sliding window W
    layers: tuple[int, ...]
    block_bytes: int  # one block of this group: the sum of its layers' pages

    @property
    def kind(self) -> str:
        return "full_attention" if self.window is None else "sliding_window"

    def blocks_per_request(self, block_size: int, max_model_len: int, in_flight_tokens: int) -> int:
        """Blocks one request of max_model_len tokens holds at most in this group."""
        if self.window is None:
            return cdiv(max_model_len, block_size)
        return cdiv(min(self.window - 1 + in_flight_tokens, max_model_len), block_size) + 1


@dataclass(frozen=True)
class GroupPlan:
    """The pool a budget buys for a grouping, and what it holds (vLLM's figures)."""

    groups: tuple[KVGroup, ...]
    block_size: int
    bytes_per_block: int
    num_blocks: int  # block 0, the null block, among them
    blocks_per_request: tuple[int, ...]  # per group
    max_model_len: int
    in_flight_tokens: int  # max_concurrent_batches × max_num_batched_tokens

    @property
    def max_concurrency(self) -> float:
        """vLLM's: num_blocks / the blocks one max_model_len request holds over all groups."""
        return self.num_blocks / sum(self.blocks_per_request)

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's "KV cache size: N tokens": int(max concurrency × max_model_len)."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def admitted(self) -> int:
        """Requests of max_model_len the pool admits at once: its usable blocks (the null block
        aside) over the blocks each holds."""
        return (self.num_blocks - 1) // sum(self.blocks_per_request)


def check_windows(windows: Sequence[int | None], num_layers: int) -> tuple[int | None, ...]:
    if len(windows) != num_layers:
        raise HybridError(f"{len(windows)} layer windows for {num_layers} layers")
    return tuple(None if w is None else check_int(w, f"layer {i}'s sliding window", 1, None, HybridError)
                 for i, w in enumerate(windows))


def all_full(windows: Sequence[int | None]) -> tuple[None, ...]:
    """vLLM's fallback without the hybrid manager: every layer cached as full attention."""
    return (None,) * len(windows)


def kv_cache_groups(spec: KVSpec, windows: Sequence[int | None], block_size: int) -> tuple[KVGroup, ...]:
    """The KV cache groups of `spec`'s layers with these windows (see the module docstring)."""
    windows = check_windows(windows, spec.num_layers)
    pages = [spec.page_bytes(i, block_size) for i in range(spec.num_layers)]
    buckets: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        buckets.setdefault(w, []).append(i)
    if len(buckets) == 1:
        (w, layers), = buckets.items()
        return (KVGroup(w, tuple(layers), sum(pages)),)
    if len(set(pages)) > 1:
        sizes = sorted(set(pages))
        raise HybridError(f"hybrid layers with pages of {', '.join(f'{p:,}' for p in sizes)} B: vLLM would give "
                          "each group its own block size, and kvjax's groups share one")
    smallest, largest = min(map(len, buckets.values())), max(map(len, buckets.values()))
    group_size = largest if largest < 1.5 * smallest else smallest
    groups = []
    for w, layers in buckets.items():
        n = cdiv(len(layers), group_size)
        groups += [KVGroup(w, tuple(layers[i::n]), len(layers[i::n]) * pages[0]) for i in range(n)]
    return tuple(groups)


def plan_groups(spec: KVSpec, windows: Sequence[int | None], budget_bytes: int, *, block_size: int,
                max_model_len: int, max_num_batched_tokens: int, max_concurrent_batches: int = 1) -> GroupPlan:
    """The pool budget_bytes buy for these layers, and its concurrency at max_model_len."""
    for name, value in (("budget_bytes", budget_bytes), ("block_size", block_size), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_concurrent_batches", max_concurrent_batches)):
        check_int(value, name, 0 if name == "budget_bytes" else 1, None, HybridError)
    groups = kv_cache_groups(spec, windows, block_size)
    per_block = max(g.block_bytes for g in groups)
    in_flight = max_concurrent_batches * max_num_batched_tokens
    return GroupPlan(groups, block_size, per_block, budget_bytes // per_block,
                     tuple(g.blocks_per_request(block_size, max_model_len, in_flight) for g in groups), max_model_len,
                     in_flight)
