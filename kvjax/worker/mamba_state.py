"""A Mamba layer's state pages: one fixed-size state per block of the Mamba KV cache group, read and written by
each request's state block (vLLM V1's `MambaSpec` tensors, `vllm/v1/kv_cache_interface.py`; the mixer's
`conv_state` / `ssm_state` indexed by `state_indices_tensor` in `vllm/model_executor/layers/mamba/mamba_mixer2.py`).

A request holds one block in each Mamba group for its whole life (`mamba_cache_mode="none"`,
kvjax.core.single_type_kv_cache_manager); that block's id indexes the layer's state pages:

    conv  [P, conv_kernel − 1, conv_dim]   the causal convolution's last inputs (x, B and C channels)
    ssm   [P, heads, head_dim, state]      the SSM state h

in the dtypes `kvjax.core.mamba_spec.MambaSpec` gives (the model's, Nemotron-H's SSM state float32). The step's
metadata carries the group's block tables (`BatchMetadata.for_layer`): sequence b's state block is entry 0 of its
row. A sequence whose first scheduled position is 0 starts from a zero state (a new request, or one preempted and
recomputed from its prompt, as vLLM's recompute preemption does); any other continues the state its block holds,
so a prefill split across steps carries it. Padding rows write into the null block 0, which no table hands out.

vLLM keeps the state inside the same page tensors as attention (the Mamba page padded to the attention page);
kvjax keeps one pair of arrays per Mamba layer, indexed by the same block ids from the same pool, so the blocks,
tables and concurrency are vLLM's while the state keeps its own shapes and dtypes (no byte reinterpretation).
`create_hybrid_cache` puts them beside the attention pages in one `PagedCache`, `layer_slots` naming each
decoder layer's entry.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.core.block_pool import NULL_BLOCK
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.core.mamba_spec import MambaSpec
from kvjax.quant.kv_formats import kv_format
from kvjax.worker.paged_cache import CacheError, PagedCache


@struct.dataclass
class MambaPages:
    """One Mamba layer's state pages, one state per block."""

    conv: jax.Array  # [P, conv_kernel - 1, conv_dim]
    ssm: jax.Array  # [P, heads, head_dim, state]
    nonfinite: jax.Array | None = None  # never counted: the state is stored as computed (PagedCache.nonfinite skips None)

    @classmethod
    def create(cls, spec: MambaSpec, num_blocks: int) -> "MambaPages":
        (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = spec.shapes, spec.dtypes
        return cls(jnp.zeros((num_blocks, *conv_shape), kv_format(conv_dtype).dtype),
                   jnp.zeros((num_blocks, *ssm_shape), kv_format(ssm_dtype).dtype))


def state_rows(md) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(state block i32[B], new tokens i32[B], fresh bool[B]) of each sequence of the step, as its Mamba layer sees
    it (md: `BatchMetadata.for_layer` of a Mamba layer): fresh when its first scheduled position is 0."""
    b = md.block_tables.shape[0]
    counts = jnp.zeros(b, jnp.int32).at[md.seq_ids].add(md.valid.astype(jnp.int32))  # i32[B]
    block = jnp.where(counts > 0, md.block_tables[:, 0], NULL_BLOCK)
    return block, counts, md.context_lens - counts == 0


def read_state(pages: MambaPages, block: jax.Array, fresh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(conv [B, conv_kernel - 1, conv_dim], ssm f32[B, heads, head_dim, state]) of each sequence, zero where fresh."""
    keep = ~fresh
    conv = jnp.where(keep[:, None, None], pages.conv[block], 0)
    ssm = jnp.where(keep[:, None, None, None], pages.ssm[block].astype(jnp.float32), 0.0)
    return conv, ssm


def write_state(pages: MambaPages, block: jax.Array, conv: jax.Array, ssm: jax.Array) -> MambaPages:
    """Each sequence's new state into its block (rows without tokens write the null block)."""
    return pages.replace(conv=pages.conv.at[block].set(conv.astype(pages.conv.dtype)),
                         ssm=pages.ssm.at[block].set(ssm.astype(pages.ssm.dtype)))


def create_hybrid_cache(kv_spec: KVSpec, state: MambaSpec, layer_types, num_blocks: int, block_size: int,
                        attention_slots: tuple = (), scales=None) -> PagedCache:
    """The paged cache of an attention + Mamba hybrid: the attention layers' pages (attention_slots: each attention
    layer's shared page tensor with KV cache groups, kvjax.config.engine.resolve_kv_cache_groups; () its own), then
    one MambaPages per Mamba layer. layer_types: kvjax.config.model.ModelConfig.layer_types ("mlp" layers cache
    nothing: their slot is 0, never read). scales: the attention layers' fp8 scales, as PagedCache.create takes them
    (refused when attention layers share page tensors: vLLM's default 1.0 then)."""
    attention = [i for i, t in enumerate(layer_types) if t == "attention"]
    mamba = [i for i, t in enumerate(layer_types) if t == "mamba"]
    if "attention_mamba" in layer_types:
        raise CacheError("layers with attention and Mamba side by side (Falcon-H1) have no state pages in kvjax yet")
    if len(attention) != kv_spec.num_layers:
        raise CacheError(f"the KV spec has {kv_spec.num_layers} layers, the model {len(attention)} attention layers")
    if len(set(attention_slots)) == len(attention_slots):  # no tensor shared: each attention layer its own pages
        attention_slots = ()  # (then per-layer kv dtypes and calibrated scales are allowed)
    cache = PagedCache.create(kv_spec, num_blocks, block_size, scales, layer_slots=attention_slots)
    tensors = max(attention_slots) + 1 if attention_slots else len(attention)
    slots = [0] * len(layer_types)
    for j, i in enumerate(attention):
        slots[i] = attention_slots[j] if attention_slots else j
    for j, i in enumerate(mamba):
        slots[i] = tensors + j
    states = tuple(MambaPages.create(state, num_blocks) for _ in mamba)
    return cache.replace(layers=cache.layers[:tensors] + states, layer_slots=tuple(slots))
