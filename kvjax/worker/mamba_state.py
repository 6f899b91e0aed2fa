"""A Mamba layer's state inside the shared page tensors, as vLLM V1 keeps it (`MambaSpec` in
`vllm/v1/kv_cache_interface.py`; `GPUModelRunner._reshape_kv_cache_tensors`, which views each of the hybrid
model's shared per-slot tensors as a Mamba layer's conv and SSM states at the start of every page; the mixer's
`conv_state` / `ssm_state` indexed by `state_indices_tensor` in `vllm/model_executor/layers/mamba/mamba_mixer2.py`).

vLLM allocates, per slot j (j below the largest KV cache group's layer count), one tensor of num_blocks pages of
one page size, and the j-th layer of every group, attention or Mamba, uses tensor j through its own group's
blocks: a block belongs to one group at a time, so they never collide. An attention layer sees its page as K/V
slots; a Mamba layer sees the first bytes of the same page as its state (the page padded to the attention page,
`mamba_page_size_padded`):

    page bytes  [conv state: conv_kernel − 1 × conv_dim | SSM state: heads × head_dim × state | padding]

kvjax does the same with its per-slot `KVPages` (kvjax.worker.paged_cache): a block's page is the concatenated
bytes of its row in each per-block array of the tensor (K, V, and per-token scale pages if any), and a Mamba
layer reads the first conv then SSM bytes of its state block's row, bitcast to the state's dtypes
(`lax.bitcast_convert_type`), and writes them back with one scatter per array (in place under donation). The
bytes held are vLLM's to the byte: slots × num_blocks × page.

A request holds one block in each Mamba group for its whole life (`mamba_cache_mode="none"`,
kvjax.core.single_type_kv_cache_manager). The step's metadata carries the group's block tables
(`BatchMetadata.for_layer`): sequence b's state block is entry 0 of its row. A sequence whose first scheduled
position is 0 starts from a zero state (a new request, or one preempted and recomputed from its prompt, as vLLM's
recompute preemption does: the block's bytes are whatever its last owner left, attention K/V included, and are
never read then); any other continues the state its block holds, so a prefill split across steps carries it.
Padding rows write into the null block 0, which no table hands out.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.core.block_pool import NULL_BLOCK
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.core.mamba_spec import MambaSpec
from kvjax.quant.kv_formats import kv_format
from kvjax.worker.paged_cache import CacheError, KVPages, LatentPages, PagedCache


def state_rows(md) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(state block i32[B], new tokens i32[B], fresh bool[B]) of each sequence of the step, as its Mamba layer sees
    it (md: `BatchMetadata.for_layer` of a Mamba layer): fresh when its first scheduled position is 0."""
    b = md.block_tables.shape[0]
    counts = jnp.zeros(b, jnp.int32).at[md.seq_ids].add(md.valid.astype(jnp.int32))  # i32[B]
    block = jnp.where(counts > 0, md.block_tables[:, 0], NULL_BLOCK)
    return block, counts, md.context_lens - counts == 0


def page_fields(pages) -> tuple[str, ...]:
    """The fields of a slot's tensor that hold a row per block, in the order a page's bytes are laid out."""
    names = ("k", "v", "k_scale", "v_scale") if isinstance(pages, KVPages) else ("latent", "scale")
    return tuple(n for n in names if getattr(pages, n) is not None and getattr(pages, n).ndim >= 2)


def page_bytes(pages) -> int:
    """One block's bytes in a slot's tensor: its row in each per-block array."""
    return sum(getattr(pages, n)[0].nbytes for n in page_fields(pages))


def _narrow(a: jax.Array) -> jax.Array:
    """1-byte arrays as uint8 (XLA's CPU backend has no fp8 gather or scatter: paged_cache._as_bytes)."""
    return jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 and a.dtype != jnp.uint8 else a


def _to_bytes(rows: jax.Array) -> jax.Array:
    """[B, ...] of any dtype → u8[B, bytes per row]."""
    return (rows if rows.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(rows, jnp.uint8)).reshape(
        rows.shape[0], -1)


def _from_bytes(raw: jax.Array, dtype, shape: tuple[int, ...]) -> jax.Array:
    """u8[B, n] → [B, *shape] of dtype (n = its bytes)."""
    width = jnp.dtype(dtype).itemsize
    raw = raw.reshape(raw.shape[0], -1, width) if width > 1 else raw
    return (raw if jnp.dtype(dtype) == jnp.uint8 else jax.lax.bitcast_convert_type(raw, dtype)).reshape(
        raw.shape[0], *shape)


def read_state(pages, spec: MambaSpec, block: jax.Array, fresh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(conv [B, conv_kernel - 1, conv_dim], ssm f32[B, heads, head_dim, state]) of each sequence: the first bytes
    of its state block's page in this slot's tensor, zero where fresh."""
    (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = spec.shapes, spec.dtypes
    conv_bytes, ssm_bytes = spec.tensor_bytes()
    rows = jnp.concatenate([_to_bytes(_narrow(getattr(pages, n))[block]) for n in page_fields(pages)], axis=1)
    conv = _from_bytes(rows[:, :conv_bytes], kv_format(conv_dtype).dtype, conv_shape)  # u8[B, page] viewed
    ssm = _from_bytes(rows[:, conv_bytes:conv_bytes + ssm_bytes], kv_format(ssm_dtype).dtype, ssm_shape)
    keep = ~fresh  # a fresh sequence's page holds its last owner's bytes, maybe NaN as floats: selected away
    return jnp.where(keep[:, None, None], conv, 0), jnp.where(keep[:, None, None, None], ssm.astype(jnp.float32), 0.0)


def write_state(pages, spec: MambaSpec, block: jax.Array, conv: jax.Array, ssm: jax.Array):
    """Each sequence's new state into the first bytes of its state block's page (rows without tokens write the
    null block); the page's padding is zeroed."""
    conv_dtype, ssm_dtype = (kv_format(d).dtype for d in spec.dtypes)
    raw = jnp.concatenate([_to_bytes(conv.astype(conv_dtype)), _to_bytes(ssm.astype(ssm_dtype))], axis=1)
    raw = jnp.pad(raw, ((0, 0), (0, page_bytes(pages) - raw.shape[1])))  # u8[B, page]
    out, at = {}, 0
    for n in page_fields(pages):
        page = _narrow(getattr(pages, n))  # [P, ...]
        width = page[0].nbytes
        rows = _from_bytes(raw[:, at:at + width], page.dtype, page.shape[1:])
        new = page.at[block].set(rows)
        out[n] = new if new.dtype == getattr(pages, n).dtype else jax.lax.bitcast_convert_type(
            new, getattr(pages, n).dtype)
        at += width
    return pages.replace(**out)


def create_hybrid_cache(kv_spec: KVSpec, state: MambaSpec, layer_types, num_blocks: int, block_size: int,
                        slots: tuple = (), scales=None) -> PagedCache:
    """The paged cache of an attention + Mamba hybrid: one page tensor per slot, each decoder layer's slot in
    `layer_slots` (slots: each decoder layer's place in its KV cache group, kvjax.config.engine.resolve_kv_cache_groups;
    () for two groups, the attention layers and the Mamba layers, the j-th of each in slot j). layer_types:
    kvjax.config.model.ModelConfig.layer_types ("mlp" layers cache nothing: their slot is 0, never read). scales:
    the attention layers' fp8 scales, as PagedCache.create takes them (refused when attention layers share page
    tensors: vLLM's default 1.0 then). Every slot's page must hold a state (the block size grown for it:
    kvjax.core.mamba_spec.hybrid_block_size)."""
    attention = [i for i, t in enumerate(layer_types) if t == "attention"]
    mamba = [i for i, t in enumerate(layer_types) if t == "mamba"]
    if "attention_mamba" in layer_types:
        raise CacheError("layers with attention and Mamba side by side (Falcon-H1) have no state pages in kvjax yet")
    if len(attention) != kv_spec.num_layers:
        raise CacheError(f"the KV spec has {kv_spec.num_layers} layers, the model {len(attention)} attention layers")
    if not slots:
        slots = [0] * len(layer_types)
        for group in (attention, mamba):
            for j, i in enumerate(group):
                slots[i] = j
    used = len(slots) == len(layer_types)
    slots = tuple(int(s) if t in ("attention", "mamba") else 0 for s, t in zip(slots, layer_types))
    if not used or sorted({slots[i] for i in attention + mamba}) != list(range(max(slots) + 1)):
        raise CacheError(f"slots {slots} must give each of the {len(layer_types)} layers one of the tensors 0, 1, ..., "
                         "each used")
    attention_slots = tuple(slots[i] for i in attention)
    shared = len(set(attention_slots)) < len(attention_slots)  # else each attention layer its own tensor
    base = PagedCache.create(kv_spec, num_blocks, block_size, scales, layer_slots=attention_slots if shared else ())
    tensors = {s: base.layers[s if shared else attention_slots.index(s)] for s in set(attention_slots)}
    for s in range(max(slots) + 1):  # a slot only Mamba layers use: a tensor of the same pages
        if s not in tensors:
            tensors[s] = jax.tree.map(lambda a: jnp.zeros_like(a) if a.ndim >= 2 else jnp.array(a), base.layers[0])
    for i in mamba:
        if page_bytes(tensors[slots[i]]) < state.page_bytes:
            raise CacheError(f"a page of {page_bytes(tensors[slots[i]]):,} B (block size {block_size}) cannot hold a "
                             f"Mamba state of {state.page_bytes:,} B: grow the block size "
                             "(kvjax.core.mamba_spec.hybrid_block_size)")
    return PagedCache(tuple(tensors[s] for s in range(max(slots) + 1)), block_size, slots)
