"""Teacher-forced scoring through the paged cache: full-sequence logits, and what calibration reads.

Each sequence of a [B, S] batch is one prefill step over its own fresh cache (block table
1..S/Z, block 0 null), vmapped over B. Every query therefore attends to keys and values read
back from the cache, stored in the cache's dtype, exactly as a served prefill does (vLLM V1
writes K/V with `reshape_and_cache_flash` first and attention then reads the cache), so fp8 KV
changes these logits the same way it changes a served model's. The metadata and the block
tables are the same for every row, only tokens (and so the pages) differ.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.accounting.budget import cdiv
from kvjax.attention.metadata import build_metadata
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.errors import KvjaxError
from kvjax.worker.paged_cache import PagedCache


def windows(tokens, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows i32[W, seq_len] from the start of a token stream."""
    n = min(max_windows, len(tokens) // seq_len)
    if n < 1:
        raise KvjaxError(f"the data holds {len(tokens)} tokens, fewer than one window of {seq_len}")
    return np.asarray(tokens[: n * seq_len]).reshape(n, seq_len)


def prefill_layout(seq_len: int, block_size: int, start: int = 0):
    """(metadata, num_blocks) for prefilling positions start..seq_len-1 of one sequence in blocks
    1..cdiv(seq_len, Z), positions before start already cached (a chunk of a chunked prefill)."""
    blocks = cdiv(seq_len, block_size)
    md = build_metadata([start], [seq_len - start], [list(range(1, blocks + 1))], block_size=block_size,
                        max_tokens=seq_len - start, max_seqs=1, max_blocks_per_seq=blocks)
    return md, blocks + 1


def sequence_logits(model, params, tokens: jax.Array, kv_spec: KVSpec, block_size: int = 16,
                    make_cache=None) -> jax.Array:
    """tokens i32[B, S] → logits f32[B, S, V], each row prefilled alone through a paged cache.

    make_cache(num_blocks, block_size) builds the empty cache (default: `PagedCache.create` of
    kv_spec); the fp8 experiments pass one that carries calibrated scales.
    """
    md, num_blocks = prefill_layout(tokens.shape[1], block_size)
    make_cache = make_cache or (lambda n, z: PagedCache.create(kv_spec, n, z))
    cache = make_cache(num_blocks, block_size)

    def one(row):  # i32[S] → f32[S, V]
        logits, _ = model.apply({"params": params}, row, md, cache)
        return logits

    return jax.vmap(one)(tokens)


def next_token_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Per-position negative log-likelihood of tokens[:, 1:] under logits[:, :-1]: f32[B, S-1]."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)  # [B, S-1, V]
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def prefill_caches(model, params, tokens: jax.Array, kv_spec: KVSpec, block_size: int = 16):
    """Prefill every row of tokens i32[B, S] into its own cache; the caches come back stacked
    (every page array gains a leading B axis). Used to observe the K/V a model writes."""
    md, num_blocks = prefill_layout(tokens.shape[1], block_size)
    cache = PagedCache.create(kv_spec, num_blocks, block_size)

    def one(row):
        return model.apply({"params": params}, row, md, cache)[1]

    return jax.vmap(one)(tokens)


def cache_amax(caches) -> tuple[list, list]:
    """Calibration statistics of stacked caches from `prefill_caches`: per layer max |K| and
    max |V| per kv head (f32[K] each), or for MLA max |latent| per channel (f32[C], V empty).

    Only real blocks count: block 0 (the null block, never written by a full prefill) is
    excluded, and every other slot of a prefill layout holds a written token or zeros, which
    cannot raise a max of absolute values.
    """
    amax_k, amax_v = [], []
    for layer in caches.layers:
        if hasattr(layer, "latent"):
            lat = jnp.abs(layer.latent[:, 1:].astype(jnp.float32))  # [B, P-1, Z, C]
            amax_k.append(jnp.max(lat, axis=(0, 1, 2)))
        else:
            amax_k.append(jnp.max(jnp.abs(layer.k[:, 1:].astype(jnp.float32)), axis=(0, 1, 2, 4)))  # f32[K]
            amax_v.append(jnp.max(jnp.abs(layer.v[:, 1:].astype(jnp.float32)), axis=(0, 1, 2, 4)))
    return amax_k, amax_v
