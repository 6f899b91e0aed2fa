"""Paged attention implementations and the `attn_impl` switch the models use.

An implementation supplies four functions, the ragged and decode forms for MHA/GQA/MQA pages
and for MLA latent pages (signatures in `kvjax.attention.reference`). `paged_attention` and
`mla_paged_attention` pick the decode form when the step's metadata is a decode step
(`BatchMetadata.decode`) and the ragged form otherwise. "reference" is plain jnp for every
form, its ragged steps (prefill, mixed) through `tiled.ragged_attention`: the jnp reference
while its f32 scores (B × Q × N × S) fit `tiled.REFERENCE_SCORES_BYTES`, the tiled
flash-attention form (kvjax.attention.tiled, bounded memory) above, with a lower bound on CPU,
where it is also the faster; its module docstring says why. "pallas" runs decode steps in the
Pallas decode kernels (kvjax.attention.pallas_decode / pallas_mla) and ragged steps in the
ragged paged-attention kernel (kvjax.attention.pallas_ragged), all of them read from the pages
in tiles. On a Hopper GPU a step may run the Mosaic GPU twin of its kernel instead
(kvjax.attention.mgpu_decode / mgpu_mla / mgpu_ragged / mgpu_ragged_mla: same arguments, same results), where
kvjax.attention.mgpu_dispatch's measured table says it is the faster; Triton elsewhere. The
Pallas modules import lazily, on first use. A model built without naming one
gets kvjax.config.attention's `default_impl()`: "pallas" on GPU, "reference" on CPU (where Pallas runs
interpreted); the names are that module's `IMPLS`, so that configuration checks them without the kernels.

The dispatchers take a layer's whole cache pytree (`KVPages` / `LatentPages`), not bare
arrays, so that anything stored beside the pages (quantization scales) reaches the
implementation without changing the attention modules, and with it the KV format the pages
carry (`kv_dtype`), which says how they are read: no implementation guesses a format from an
array's dtype or a scale's shape. A contiguous cache layer
(`ContiguousKV` / `ContiguousLatent`, the baseline paging is measured against) is read in
place by the reference forms whatever the implementation, since the kernels read pages.

A sliding-window, attention-sink or soft-capped layer (Mistral, Gemma 2/3, gpt-oss) passes
`window`, `sinks` and `softcap` (kvjax.attention.reference's module docstring says what each
does); every MHA/GQA/MQA form of every implementation takes them, the latent (MLA) forms not.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from kvjax.attention import reference as ref
from kvjax.attention.metadata import BatchMetadata, MetadataError, build_metadata, decode_metadata
from kvjax.attention.reference import (mla_paged_attention_reference, mla_paged_decode_reference,
                                       paged_attention_reference, paged_decode_reference)
from kvjax.attention.tiled import (PrefillTiles, mla_paged_attention_tiled, mla_ragged_attention,
                                   paged_attention_tiled, ragged_attention)
from kvjax.config.attention import IMPLS
from kvjax.errors import KvjaxError, require
from kvjax.quant.kv_formats import kv_format
from kvjax.worker.paged_cache import ContiguousKV, ContiguousLatent, KVPages, LatentPages


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    ragged: Callable  # (q, k_pages, v_pages, md, *, scale, k_scale, v_scale, window, sinks, softcap, kv_dtype)
    decode: Callable  # (q, k_pages, v_pages, block_tables, context_lens, *, scale, k_scale, v_scale, window, sinks,
    #                    softcap, kv_dtype)
    mla_ragged: Callable  # (q_latent, q_rope, latent_pages, md, *, scale, latent_scale, kv_dtype)
    mla_decode: Callable  # (q_latent, q_rope, latent_pages, block_tables, context_lens, *, scale, latent_scale,
    #                        kv_dtype)


def _family(kind: str, q, pages, block_tables, *, group: int, kv_dtype=None, batch: int | None = None) -> str:
    """"mosaic" or "triton" for this step's kernel (kvjax.attention.mgpu_dispatch: Hopper only, measured)."""
    from kvjax.attention.mgpu_dispatch import choose

    return choose(kind, q.dtype, pages.dtype, head_dim=q.shape[-1], block_size=pages.shape[1], group=group,
                  batch=q.shape[0] if batch is None else batch, context=block_tables.shape[1] * pages.shape[1],
                  kv_dtype=kv_dtype, num_kv_heads=pages.shape[2] if pages.ndim == 4 else None,
                  channels=pages.shape[2] if pages.ndim == 3 else None)


def _pallas_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale, k_scale=None, v_scale=None,
                   window=None, sinks=None, softcap=None, kv_dtype=None):  # both decode kernels read per-token scales
    if _family("gqa", q, k_pages, block_tables, group=q.shape[1] // k_pages.shape[2], kv_dtype=kv_dtype) == "mosaic":
        from kvjax.attention.mgpu_decode import paged_decode
    else:
        from kvjax.attention.pallas_decode import paged_decode
    return paged_decode(q, k_pages, v_pages, block_tables, context_lens, scale=scale, k_scale=k_scale,
                        v_scale=v_scale, window=window, sinks=sinks, softcap=softcap, kv_dtype=kv_dtype)


def _pallas_ragged(q, k_pages, v_pages, md, *, scale, k_scale=None, v_scale=None, window=None, sinks=None,
                   softcap=None, kv_dtype=None):  # both ragged kernels read per-token scale pages and nvfp4
    if _family("ragged", q, k_pages, md.block_tables, group=q.shape[1] // k_pages.shape[2], kv_dtype=kv_dtype,
               batch=md.num_seqs) == "mosaic":
        from kvjax.attention.mgpu_ragged import ragged_paged_attention
    else:
        from kvjax.attention.pallas_ragged import ragged_paged_attention
    return ragged_paged_attention(q, k_pages, v_pages, md, scale=scale, k_scale=k_scale, v_scale=v_scale,
                                  window=window, sinks=sinks, softcap=softcap, kv_dtype=kv_dtype)


def _pallas_mla_ragged(q_latent, q_rope, latent_pages, md, *, scale, latent_scale=None, kv_dtype=None):
    if _family("mla_ragged", q_latent, latent_pages, md.block_tables, group=q_latent.shape[1], kv_dtype=kv_dtype,
               batch=md.num_seqs) == "mosaic":  # both read per-token latent scale pages
        from kvjax.attention.mgpu_ragged_mla import mla_ragged_paged_attention
    else:
        from kvjax.attention.pallas_ragged import mla_ragged_paged_attention

    return mla_ragged_paged_attention(q_latent, q_rope, latent_pages, md, scale=scale, latent_scale=latent_scale,
                                      kv_dtype=kv_dtype)


def _pallas_mla_decode(q_latent, q_rope, latent_pages, block_tables, context_lens, *, scale, latent_scale=None,
                       kv_dtype=None):
    _static_scale_only(kv_dtype)
    if _family("mla", q_latent, latent_pages, block_tables, group=q_latent.shape[1], kv_dtype=kv_dtype) == "mosaic":
        from kvjax.attention.mgpu_mla import mla_paged_decode
    else:
        from kvjax.attention.pallas_mla import mla_paged_decode
    return mla_paged_decode(q_latent, q_rope, latent_pages, block_tables, context_lens, scale=scale,
                            latent_scale=latent_scale)


def _static_scale_only(kv_dtype: str | None) -> None:
    """The kernels read static (per-tensor / per-head / per-channel) scales only: the pages' format says."""
    if kv_dtype is not None and kv_format(kv_dtype).scale == "per_token":
        raise KvjaxError(f"attn_impl 'pallas' reads static (per-tensor / per-head / per-channel) scales only; "
                         f"{kv_dtype} pages need attn_impl 'reference'")


_IMPLS: dict[str, AttentionImpl] = {
    "reference": AttentionImpl(ragged_attention, paged_decode_reference, mla_ragged_attention,
                               mla_paged_decode_reference),
    "pallas": AttentionImpl(_pallas_ragged, _pallas_decode, _pallas_mla_ragged, _pallas_mla_decode),
}
require(tuple(_IMPLS) == IMPLS, f"attention implementations {tuple(_IMPLS)} under other names than {IMPLS}")


def get_impl(name: str) -> AttentionImpl:
    """The implementation called `name`; unknown names raise ValueError listing the known ones."""
    if name not in _IMPLS:
        raise KvjaxError(f"unknown attn_impl {name!r}; available: {', '.join(sorted(_IMPLS))}")
    return _IMPLS[name]


def paged_attention(q: jax.Array, pages: KVPages | ContiguousKV, md: BatchMetadata, *, scale: float,
                    impl: str = "reference", window: int | None = None, sinks: jax.Array | None = None,
                    softcap: float | None = None) -> jax.Array:
    """q: [T, N, H]; pages.k, pages.v: [P, Z, K, H] (or contiguous rows [B, S, K, H]) → [T, N, H].
    window: a static int W >= 1 (a query at p sees keys p - W < s <= p) or None; sinks: f32[N]
    or None; softcap: a static c > 0 (scores → c · tanh(scores / c)) or None."""
    fns = get_impl(impl)
    variant = dict(window=window, sinks=sinks, softcap=softcap)
    if isinstance(pages, ContiguousKV):
        if md.decode:
            return ref.contiguous_decode_reference(q, pages.k, pages.v, md.context_lens, scale=scale, **variant)
        return ref.contiguous_attention_reference(q, pages.k, pages.v, md, scale=scale, **variant)
    scales = dict(k_scale=pages.k_scale, v_scale=pages.v_scale, kv_dtype=pages.kv_dtype)  # the pages say their format
    if md.decode:
        return fns.decode(q, pages.k, pages.v, md.block_tables, md.context_lens, scale=scale, **scales, **variant)
    return fns.ragged(q, pages.k, pages.v, md, scale=scale, **scales, **variant)


def mla_paged_attention(q_latent: jax.Array, q_rope: jax.Array, pages: LatentPages | ContiguousLatent,
                        md: BatchMetadata, *, scale: float, impl: str = "reference") -> jax.Array:
    """q_latent: [T, N, kv_lora_rank]; q_rope: [T, N, rope]; pages.latent: [P, Z, C] (or contiguous
    rows [B, S, C]) → [T, N, kv_lora_rank]."""
    fns = get_impl(impl)
    if isinstance(pages, LatentPages) and pages.dcp_mesh is not None:  # split by token over ranks: kvjax.attention.dcp
        from kvjax.attention.dcp import mla_dcp_attention

        return mla_dcp_attention(q_latent, q_rope, pages, md, scale=scale)
    if isinstance(pages, ContiguousLatent):
        if md.decode:
            return ref.mla_contiguous_decode_reference(q_latent, q_rope, pages.latent, md.context_lens, scale=scale)
        return ref.mla_contiguous_attention_reference(q_latent, q_rope, pages.latent, md, scale=scale)
    scales = dict(latent_scale=pages.scale, kv_dtype=pages.kv_dtype)  # the pages say their format
    if md.decode:
        return fns.mla_decode(q_latent, q_rope, pages.latent, md.block_tables, md.context_lens, scale=scale, **scales)
    return fns.mla_ragged(q_latent, q_rope, pages.latent, md, scale=scale, **scales)


__all__ = ["AttentionImpl", "BatchMetadata", "MetadataError", "PrefillTiles", "build_metadata", "decode_metadata",
           "get_impl", "mla_paged_attention", "mla_paged_attention_reference", "mla_paged_attention_tiled",
           "mla_paged_decode_reference", "mla_ragged_attention", "paged_attention", "paged_attention_reference",
           "paged_attention_tiled", "paged_decode_reference", "ragged_attention"]
