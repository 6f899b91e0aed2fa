"""The paged KV cache: a pytree of per-layer pages, slot-mapped writes, block-table gathers.

This reproduces the device side of vLLM V1's paged KV cache (`vllm/v1/worker/gpu_model_runner.py`
allocating one tensor per layer from `KVCacheSpec.page_size_bytes`, `reshape_and_cache_flash`
writing through `slot_mapping`, attention kernels reading through `block_table`):

- Pages. Per layer, K and V are arrays shaped [P, Z, K, H]: P physical blocks of Z token slots
  for K kv heads of dim H. That is vLLM's flash-attention layout for one layer (its
  [2, P, Z, K, H] tensor split into its K and V halves). MLA caches one vector per token, the
  compressed latent c_kv concatenated with the rope key, so its page is [P, Z, C] with
  C = kv_lora_rank + qk_rope_head_dim (SPEC: f = 1, Hkv = 1).
- Per-layer arrays, not one layer-stacked array. They match vLLM's per-layer tensors, let a
  layer skipped by fp8 quantization (`--kv-cache-dtype-skip-layers`) keep its own dtype, and
  under `jax.jit(..., donate_argnums=...)` each layer's write updates its own buffer in place
  (a stacked array would need a dynamic-update-slice per layer into one big buffer).
- Slots. Token slot s = block_id × Z + offset lives at flat row s of the page viewed as
  [P × Z, ...]. A write is one scatter per array; padding tokens carry slots inside the null
  block 0, which the block pool never hands out (SPEC "Budget → blocks"), so whatever they
  write is garbage that no block table points at.
- Reads gather whole blocks by block table: [B, M] block ids → [B, M × Z, ...] positions.
  Table entries past a sequence's last block are 0 (the null block); attention masks them by
  context length, and never lets their values reach an output (see kvjax.attention.reference).

Byte accounting is kvjax.spec's: the pages of `PagedCache.create(spec, P, Z)` hold exactly
P × spec.bytes_per_block(Z) bytes. Quantized kv dtypes (fp8, int8) need per-layer scales in
this pytree; `_page_dtype` is the one place that refuses them until they exist.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.spec import KVSpec

NULL_BLOCK = 0  # vLLM's null block: never allocated to a request, target of padding writes


class CacheError(ValueError):
    """A cache built or used with sizes that break a rule; the message names the value."""


@struct.dataclass
class KVPages:
    """One MHA/GQA/MQA layer: K and V pages."""

    k: jax.Array  # [P, Z, K, H]
    v: jax.Array  # [P, Z, K, H]


@struct.dataclass
class LatentPages:
    """One MLA layer: the latent page, c_kv (first kv_lora_rank lanes) then the rope key."""

    latent: jax.Array  # [P, Z, C]


LayerPages = KVPages | LatentPages


@struct.dataclass
class PagedCache:
    """All layers' pages. `layers[i]` is layer i's KVPages (or LatentPages for MLA)."""

    layers: tuple[LayerPages, ...]
    block_size: int = struct.field(pytree_node=False)  # Z

    @classmethod
    def create(cls, spec: KVSpec, num_blocks: int, block_size: int) -> "PagedCache":
        """Zeroed pages for `spec`: num_blocks blocks (block 0 the null block) of block_size slots."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CacheError(f"{name} must be a positive integer, got {value!r}")
        if num_blocks < 2:
            raise CacheError(f"num_blocks {num_blocks} leaves no usable block: block 0 is the null block")
        layers = []
        for i in range(spec.num_layers):
            dtype = _page_dtype(spec, i)
            if spec.kind == "mla":
                layers.append(LatentPages(jnp.zeros((num_blocks, block_size, spec.head_dim), dtype)))
            else:
                shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
                layers.append(KVPages(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
        return cls(tuple(layers), block_size)

    @property
    def num_blocks(self) -> int:
        return _first_page(self.layers[0]).shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of every page array (equals num_blocks × spec.bytes_per_block(block_size))."""
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self))

    def replace_layer(self, layer: int, pages: LayerPages) -> "PagedCache":
        layers = list(self.layers)
        layers[layer] = pages
        return self.replace(layers=tuple(layers))


def _page_dtype(spec: KVSpec, layer: int) -> jnp.dtype:
    """The stored dtype of one layer's pages: the single place quantized formats plug in."""
    kv = spec.layer_dtype(layer)
    if kv.quantized:
        raise NotImplementedError(
            f"kv dtype {kv.name!r} (layer {layer}) needs quantization scales in the cache; "
            "only fp32, bf16 and fp16 pages exist so far")
    return jnp.dtype(kv.jnp_name)


def _first_page(pages: LayerPages) -> jax.Array:
    return pages.latent if isinstance(pages, LatentPages) else pages.k


# --------------------------------------------------------------------------------------------
# Writes: one scatter per page array through the slot mapping.
# --------------------------------------------------------------------------------------------
def scatter_slots(page: jax.Array, values: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Write values[t] into slot slot_mapping[t] of `page`.

    page: [P, Z, ...] (any trailing shape); values: [T, ...]; slot_mapping: i32[T].
    Padding tokens point into the null block; several of them may hit the same slot, and which
    one wins does not matter because block 0 is never read.
    """
    num_blocks, block_size = page.shape[:2]
    flat = page.reshape(num_blocks * block_size, *page.shape[2:])  # [P*Z, ...]
    flat = flat.at[slot_mapping].set(values.astype(page.dtype))
    return flat.reshape(page.shape)


def write_kv(pages: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVPages:
    """k, v: [T, K, H]; slot_mapping: i32[T] → pages with those T tokens written."""
    return KVPages(scatter_slots(pages.k, k, slot_mapping), scatter_slots(pages.v, v, slot_mapping))


def write_latent(pages: LatentPages, latent: jax.Array, slot_mapping: jax.Array) -> LatentPages:
    """latent: [T, C] (c_kv then rope key); slot_mapping: i32[T]."""
    return LatentPages(scatter_slots(pages.latent, latent, slot_mapping))


def write(cache: PagedCache, layer: int, k: jax.Array, v: jax.Array | None,
          slot_mapping: jax.Array) -> PagedCache:
    """Write one layer's new tokens: K/V [T, K, H] each, or for MLA the latent [T, C] as k (v None)."""
    pages = cache.layers[layer]
    if isinstance(pages, LatentPages):
        if v is not None:
            raise CacheError(f"layer {layer} is an MLA latent page: pass the latent as k and v=None")
        return cache.replace_layer(layer, write_latent(pages, k, slot_mapping))
    if v is None:
        raise CacheError(f"layer {layer} holds K and V pages: v is required")
    return cache.replace_layer(layer, write_kv(pages, k, v, slot_mapping))


# --------------------------------------------------------------------------------------------
# Reads: gather whole blocks by block table.
# --------------------------------------------------------------------------------------------
def gather_pages(page: jax.Array, block_tables: jax.Array) -> jax.Array:
    """page: [P, Z, ...]; block_tables: i32[B, M] → [B, M × Z, ...], position s at row s."""
    blocks = page[block_tables]  # [B, M, Z, ...]
    b, m, z = blocks.shape[:3]
    return blocks.reshape(b, m * z, *blocks.shape[3:])


def gather(cache: PagedCache, layer: int, block_tables: jax.Array) -> tuple[jax.Array, ...]:
    """One layer's cached vectors per sequence: (k, v) each [B, S, K, H], or (latent [B, S, C],)."""
    pages = cache.layers[layer]
    if isinstance(pages, LatentPages):
        return (gather_pages(pages.latent, block_tables),)
    return gather_pages(pages.k, block_tables), gather_pages(pages.v, block_tables)


def slots_for_positions(block_table: Sequence[int], positions: Sequence[int], block_size: int) -> list[int]:
    """Host-side slot mapping of one sequence: slot = block_table[p // Z] × Z + p % Z."""
    out = []
    for p in positions:
        if p // block_size >= len(block_table):
            raise CacheError(f"position {p} needs logical block {p // block_size}, but the block "
                             f"table has {len(block_table)} blocks of {block_size}")
        out.append(block_table[p // block_size] * block_size + p % block_size)
    return out
