"""Reference paged attention in plain jnp: gather by block table, f32 softmax.

The semantics are vLLM V1's paged attention (`vllm/v1/attention/backends/flash_attn.py` calling
`flash_attn_varlen_func` with a block table): a query token of sequence b at position p attends
to the cached positions 0..p of sequence b, read through b's block table, and nothing else.
Every other form of attention in kvjax (the Pallas decode kernel) is tested against these.

Two call forms, each for MHA/GQA/MQA pages [P, Z, K, H] and for MLA latent pages [P, Z, C]:

- ragged (`paged_attention_reference`): the flat token batch of one model step, mixing
  prefill and decode sequences, described by a `BatchMetadata`. Causal by position.
- decode (`paged_decode_reference`): one query per sequence, q [B, N, H], attending to all of
  its context_lens[b] cached tokens; the signature the Pallas kernel matches.

MLA runs in the absorbed form of DeepSeek-V2 (arXiv 2405.04434, §2.1.2): the caller folds W_UK
into the query, so q_latent [.., N, kv_lora_rank] and q_rope [.., N, qk_rope_head_dim] score
against the cached latent [c_kv, k_rope] directly, and the output stays in latent space
[.., N, kv_lora_rank] for the caller to map through W_UV. That is MQA with one kv head whose
key is the whole latent and whose value is its c_kv part, which is how it is computed here.

Quantized pages (fp8, int8, nvfp4) are dequantized right after the gather, as x = stored × scale, with
the scales the cache keeps beside them (kvjax.worker.paged_cache, kvjax.quant.formats): a static scale per kv head
f32[K] (or one per latent channel f32[C] for MLA; a scalar is a per-tensor scale), or a scale
per token per head gathered from scale pages f32[P, Z, K] (f32[P, Z] for MLA).

The contiguous cache (kvjax.worker.paged_cache.ContiguousCache) is read by the same masks and the same
`_attend` / `_attend_blocks` products, with its rows [B, S, ...] in place of the gathered pages:
`contiguous_attention_reference` and friends below. Only the gather differs, which is what a
paged-vs-contiguous comparison should measure.

Masked positions include the null block 0 and table entries past a sequence's end. Their
values may be anything (even NaN), so their scores are replaced by -inf and their values by
zero before use: a zero softmax weight times a NaN value would otherwise still be NaN. A query
with no visible key (padding) gets a zero output.

Three per-layer variants of MHA/GQA/MQA attention (not MLA), keywords of every form here:
- `window` W (Mistral, Gemma 2/3, gpt-oss sliding layers): a query at position p sees the keys
  at p - W < s <= p, transformers' `sliding_window_overlay` (`kv_idx > q_idx - sliding_window`)
  on the causal mask, vLLM's flash-attn window (W - 1, 0). vLLM's SlidingWindowManager puts the
  null block in place of blocks wholly before the window; those positions are masked like any
  other, so their pages' contents never matter.
- `sinks` f32[N] (gpt-oss): one learned logit per query head joins the softmax's denominator,
  softmax over [scores..., sink] with the sink column dropped (transformers' gpt_oss
  `eager_attention_forward`, whose max also runs over the sink); a query that sees no key gets 0.
- `softcap` c (Gemma 2's attn_logit_softcapping): scores become c · tanh(scores / c) after the
  softmax scale and before the mask, as in transformers' gemma2 `eager_attention_forward`.
"""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from kvjax.attention.metadata import BatchMetadata
from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv
from kvjax.quant import nvfp4
from kvjax.quant.kv_formats import kv_format
from kvjax.utils.checks import check_int
from kvjax.worker.paged_cache import gather_pages

HIGHEST = jax.lax.Precision.HIGHEST  # f32 reference: no TF32 / bf16 passes on GPU


def scale_kind(pages: jax.Array, scale, kv_dtype: str | None) -> str:
    """How pages of the KV format kv_dtype are read: the format's scale kind (kvjax.quant.kv_formats:
    "none", "static", "per_token", "per_block"). The cache's pages carry their format
    (KVPages.kv_dtype); None names unquantized pages, which carry no scale: a quantized page is
    never guessed from its array's dtype or its scale's shape."""
    if kv_dtype is None:
        if scale is not None or pages.dtype == jnp.uint8:
            raise KvjaxError("quantized pages (a scale, or nvfp4's uint8 pages) need their kv_dtype, the format "
                             "the cache's pages carry (KVPages.kv_dtype)")
        return "none"
    fmt = kv_format(kv_dtype)
    if jnp.dtype(pages.dtype) != jnp.dtype(fmt.dtype):
        raise KvjaxError(f"{fmt.name} pages are {jnp.dtype(fmt.dtype)}, got {pages.dtype}")
    if fmt.scale == "none" and scale is not None:
        raise KvjaxError(f"{fmt.name} pages have no scale, got one of shape {tuple(jnp.shape(scale))}")
    return fmt.scale


def gather_dequant(pages: jax.Array, scale: jax.Array | None, block_tables: jax.Array,
                   kv_dtype: str | None = None) -> jax.Array:
    """Gather pages [P, Z, ...] of the KV format kv_dtype (None: unquantized) by block table
    i32[B, M] → f32[B, S, ...], dequantized as the format says (`scale_kind`):

    static     scale None (1.0) or a scale that broadcasts over the page's last axis after one
               more axis (f32[K] for [.., K, H] pages; f32[C] or a scalar for MLA [.., C] pages);
    per_token  scale pages [P, Z, ...] with one axis fewer than the pages (int8_per_token_head);
    per_block  nvfp4's packed uint8 pages (kvjax.quant.nvfp4) with their per-tensor scale f32[K].
    """
    kind = scale_kind(pages, scale, kv_dtype)
    if kind == "per_block":  # nvfp4 [.., K, H/2 + H/16]: packed values, block scales, a per-head scale
        scale = jnp.ones((), jnp.float32) if scale is None else scale
        return nvfp4.dequantize(gather_pages(pages, block_tables), jnp.broadcast_to(scale, (pages.shape[2],))[:, None])
    x = gather_pages(pages, block_tables).astype(jnp.float32)
    if scale is None:
        return x
    scale = jnp.asarray(scale, jnp.float32)
    if kind == "per_token":
        return x * gather_pages(scale, block_tables)[..., None]
    if pages.ndim == 4:  # [.., K, H] pages: a per-head scale (or a scalar)
        return x * jnp.broadcast_to(scale, (pages.shape[2],))[:, None]
    return x * scale  # MLA [.., C]: per-channel f32[C] or a scalar


def check_variant(num_heads: int, window=None, sinks=None, softcap=None):
    """The validated (window, sinks, softcap) of a layer for N = num_heads query heads: window a
    static int >= 1 or None; sinks f32[N] or None (returned as f32); softcap a static finite
    number > 0 or None (returned as a float). Bad values raise KvjaxError naming them."""
    if window is not None:
        window = check_int(window, "window (the sliding window, in tokens)", lo=1)
    if sinks is not None:
        shape = tuple(jnp.shape(sinks))
        if shape != (num_heads,):
            raise KvjaxError(f"sinks must be f32[N={num_heads}] (one logit per query head), got shape {shape}")
        if not jnp.issubdtype(jnp.result_type(sinks), jnp.floating):
            raise KvjaxError(f"sinks must be floating point, got dtype {jnp.result_type(sinks)}")
        sinks = jnp.asarray(sinks, jnp.float32)
    if softcap is not None:
        if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or \
                not (math.isfinite(softcap) and softcap > 0):
            raise KvjaxError(f"softcap must be a static finite number > 0, got {softcap!r}")
        softcap = float(softcap)
    return window, sinks, softcap


def _scaled(raw: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    """f32 scores: raw dot products × scale, then Gemma 2's cap c · tanh(x / c) when softcap is c."""
    scores = raw * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    return scores


def _masked_softmax(scores: jax.Array, visible: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """softmax over the last axis of f32 scores where visible; rows with no visible key → 0.
    sinks (broadcasting against scores[..., :1]): an extra logit per row in the denominator only."""
    scores = jnp.where(visible, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:  # gpt-oss takes the max over the scores and the sink together
        peak = jnp.maximum(peak, sinks)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # rows with no visible key
    weights = jnp.where(visible, jnp.exp(scores - peak), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:  # the sink's column, dropped after the softmax, is only in the denominator
        total = total + jnp.exp(sinks - peak)
    return weights / jnp.where(total > 0, total, 1.0)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
            sinks: jax.Array | None = None, softcap: float | None = None) -> jax.Array:
    """Masked softmax attention in f32, each query row with its own keys.

    q: [B, N, Hk]; k: [B, S, K, Hk]; v: [B, S, K, Hv]; mask: bool[B, S]; sinks: f32[N] or None
    → f32[B, N, Hv].
    Query head n uses kv head n // G (G = N // K), as `repeat_kv` in transformers does.

    Both products read K and V in their stored [S, K, H] order: every key is scored against
    all N query heads ([B, S, K, N]) and the pairs where kv head k serves query head n are
    kept; likewise every query head's weights reach all K value heads. That is K × the
    multiply-adds of the exact grouping, but a batched dot over (row, kv head) makes XLA first
    transpose each layer's whole context into [B, K, H, S] (kv heads beside the rows, the
    contracted axis ahead of S), and that copy costs more than the extra arithmetic: on CPU
    this form made small-gqa's decode steps about 20% faster, paged and contiguous alike
    (experiments/decode_bench.py).
    """
    rows, heads, _ = q.shape
    seq, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # A garbage key only spoils its own score, which the mask replaces; a garbage value would
    # reach every output through 0 × NaN, so values are zeroed where masked.
    v = jnp.where(mask[:, :, None, None], v.astype(jnp.float32), 0.0)
    pairs = jnp.einsum("rskh,rnh->rskn", k.astype(jnp.float32), q.astype(jnp.float32), precision=HIGHEST)
    pairs = pairs.reshape(rows, seq, kv_heads, kv_heads, group)  # [B, S, K, K', G]: query head K' × G + g
    scores = _scaled(jnp.diagonal(pairs, axis1=2, axis2=3).transpose(0, 3, 2, 1), scale, softcap)  # f32[B, K, G, S]
    sinks = None if sinks is None else sinks.reshape(1, kv_heads, group, 1)
    weights = _masked_softmax(scores, mask[:, None, None, :], sinks).reshape(rows, heads, seq)
    out = jnp.einsum("rns,rskh->rnkh", weights, v, precision=HIGHEST)  # f32[B, N, K, Hv]
    out = out.reshape(rows, kv_heads, group, kv_heads, v.shape[-1])  # [B, K', G, K, Hv]
    return jnp.diagonal(out, axis1=1, axis2=3).transpose(0, 3, 1, 2).reshape(rows, heads, v.shape[-1])


def _attend_blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                   sinks: jax.Array | None = None, softcap: float | None = None) -> jax.Array:
    """Masked softmax attention of each sequence's block of queries over its own keys, in f32.

    q: [B, Q, N, Hk]; k: [B, S, K, Hk]; v: [B, S, K, Hv]; mask: bool[B, Q, S]; sinks: f32[N] or
    None → f32[B, Q, N, Hv].
    The ragged form lays a step's tokens out this way (`_query_blocks`): work and memory
    B × Q × S × N instead of every token scoring every sequence's positions (T × B × S × N).
    Each kv head's G query heads and Q queries form one [Q·G, Hk] matrix, so both products are
    plain batched matmuls over (B, K) with the scores' S axis last, the layout XLA's CPU matmul
    and the softmax's reductions read in place (an einsum straight to [B, K, G, Q, S] ran 4×
    slower at Q = 1,024, S = 4,096 on CPU, transposing the scores).
    """
    b, nq, heads, _ = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    v = jnp.where(jnp.any(mask, axis=1)[:, :, None, None], v.astype(jnp.float32), 0.0)  # see `_attend`
    q = q.astype(jnp.float32).reshape(b, nq, kv_heads, group, q.shape[-1]).transpose(0, 2, 1, 3, 4)
    q = q.reshape(b, kv_heads, nq * group, -1)  # [B, K, Q·G, Hk]
    scores = _scaled(jnp.matmul(q, k.astype(jnp.float32).transpose(0, 2, 3, 1), precision=HIGHEST), scale,
                     softcap)  # f32[B, K, Q·G, S]
    sinks = None if sinks is None else sinks.reshape(1, kv_heads, 1, group, 1)
    weights = _masked_softmax(scores.reshape(b, kv_heads, nq, group, -1), mask[:, None, :, None, :], sinks)
    out = jnp.matmul(weights.reshape(b, kv_heads, nq * group, -1), v.transpose(0, 2, 1, 3),
                     precision=HIGHEST)  # f32[B, K, Q·G, Hv]
    return out.reshape(b, kv_heads, nq, group, -1).transpose(0, 2, 1, 3, 4).reshape(b, nq, heads, -1)


def _query_blocks(md: BatchMetadata, num_positions: int, window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The step's tokens by sequence: (token i32[B, Q], the index in T of sequence b's j-th new
    token (clipped), mask bool[B, Q, S]: that token sees positions ≤ its own that b has cached,
    and with a window W only those > its own - W)."""
    t, q = md.num_tokens, md.max_query_len
    token = md.query_start[:, None] + jnp.arange(q, dtype=jnp.int32)[None, :]  # [B, Q]
    clipped = jnp.minimum(token, t - 1)
    own = (token < t) & (md.seq_ids[clipped] == jnp.arange(md.num_seqs, dtype=jnp.int32)[:, None]) & \
        md.valid[clipped]  # bool[B, Q]
    s = jnp.arange(num_positions, dtype=jnp.int32)
    pos = md.positions[clipped][..., None]  # i32[B, Q, 1]
    mask = own[..., None] & (s <= pos) & (s < md.context_lens[:, None, None])
    if window is not None:
        mask = mask & (s > pos - window)
    return clipped, mask


def _to_tokens(out: jax.Array, md: BatchMetadata) -> jax.Array:
    """[B, Q, ...] per-sequence outputs back to the flat [T, ...] token axis; padding tokens get 0."""
    j = jnp.clip(jnp.arange(md.num_tokens, dtype=jnp.int32) - md.query_start[md.seq_ids], 0, md.max_query_len - 1)
    flat = out[md.seq_ids, j]  # [T, ...]
    return jnp.where(md.valid.reshape(-1, *[1] * (flat.ndim - 1)), flat, 0.0)


def _ragged(q: jax.Array, k: jax.Array, v: jax.Array, md: BatchMetadata, scale: float, window: int | None = None,
            sinks: jax.Array | None = None, softcap: float | None = None) -> jax.Array:
    """Ragged causal attention: q [T, N, Hk]; k [B, S, K, Hk], v [B, S, K, Hv] per sequence → f32[T, N, Hv]."""
    token, mask = _query_blocks(md, k.shape[1], window)
    return _to_tokens(_attend_blocks(q[token], k, v, mask, scale, sinks, softcap), md)


def _check(name: str, array: jax.Array, ndim: int, what: str) -> None:
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(array.shape)}")


def _check_pages(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_dtype: str | None) -> None:
    _check("k_pages", k_pages, 4, "[P, Z, K, H]")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {tuple(v_pages.shape)} differs from k_pages {tuple(k_pages.shape)}")
    heads, kv_heads = q.shape[-2], k_pages.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{kv_heads} kv heads do not divide {heads} query heads")
    packed = kv_dtype is not None and kv_format(kv_dtype).scale == "per_block"  # nvfp4: H/2 + H/16 bytes a head
    width = nvfp4.packed_width(q.shape[-1]) if packed else q.shape[-1]  # packed_width refuses H % 16
    if width != k_pages.shape[-1]:
        raise ValueError(f"query head dim {q.shape[-1]} does not fit the pages' last axis {k_pages.shape[-1]}"
                         f"{' (nvfp4: H/2 + H/16 bytes)' if packed else ''}")


def _check_latent(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array) -> None:
    _check("latent_pages", latent_pages, 3, "[P, Z, C]")
    if q_latent.shape[:-1] != q_rope.shape[:-1]:
        raise ValueError(f"q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)} disagree")
    if q_latent.shape[-1] + q_rope.shape[-1] != latent_pages.shape[-1]:
        raise ValueError(f"kv_lora_rank {q_latent.shape[-1]} + rope dim {q_rope.shape[-1]} must equal "
                         f"the latent page width {latent_pages.shape[-1]}")


def _decode_mask(context_lens: jax.Array, num_positions: int, window: int | None = None) -> jax.Array:
    """bool[B, S]: a decode query (at position context_lens[b] - 1) sees every cached position of
    its sequence, or with a window W the last W of them."""
    s = jnp.arange(num_positions, dtype=jnp.int32)[None, :]
    mask = s < context_lens[:, None]
    if window is not None:
        mask = mask & (s >= context_lens[:, None] - window)
    return mask


# --------------------------------------------------------------------------------------------
# MHA / GQA / MQA
# --------------------------------------------------------------------------------------------
def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: BatchMetadata,
                              *, scale: float, k_scale=None, v_scale=None, window: int | None = None,
                              sinks=None, softcap: float | None = None, kv_dtype: str | None = None) -> jax.Array:
    """Ragged causal attention of a flat token batch over the paged cache.

    q: [T, N, H]; k_pages, v_pages: [P, Z, K, H] (this step's K/V already written) → [T, N, H]
    in q's dtype. Gathers every sequence once ([B, S, K, H]) and each sequence's queries into a
    [B, Q] block (Q = md.max_query_len), so a token scores only its own sequence's positions:
    memory B × Q × N × S (a reference, not a kernel). window, sinks f32[N], softcap: the
    module docstring's variants (None: off); a windowed token sees by its own position. kv_dtype:
    the pages' KV format, which says how they are read (`gather_dequant`; None: unquantized).
    """
    _check("q", q, 3, "[T, N, H]")
    _check_pages(q, k_pages, v_pages, kv_dtype)
    window, sinks, softcap = check_variant(q.shape[1], window, sinks, softcap)
    k = gather_dequant(k_pages, k_scale, md.block_tables, kv_dtype)  # f32[B, S, K, H]
    v = gather_dequant(v_pages, v_scale, md.block_tables, kv_dtype)
    return _ragged(q, k, v, md, scale, window, sinks, softcap).astype(q.dtype)


def paged_decode_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                           context_lens: jax.Array, *, scale: float, k_scale=None, v_scale=None,
                           window: int | None = None, sinks=None, softcap: float | None = None,
                           kv_dtype: str | None = None) -> jax.Array:
    """One query per sequence, at position context_lens[b] - 1, over its cached context (with a
    window W its last W positions).

    q: [B, N, H]; k_pages, v_pages: [P, Z, K, H]; block_tables: i32[B, M];
    context_lens: i32[B]; sinks: f32[N] or None; kv_dtype: the pages' format → [B, N, H] in q's dtype.
    """
    _check("q", q, 3, "[B, N, H]")
    _check_pages(q, k_pages, v_pages, kv_dtype)
    _check("block_tables", block_tables, 2, "[B, M]")
    window, sinks, softcap = check_variant(q.shape[1], window, sinks, softcap)
    z, width = k_pages.shape[1], block_tables.shape[1]
    span = width if window is None else min(width, cdiv(window - 1, z) + 1)  # the pages a window can touch
    # With a window only those pages are gathered (the same O(W) work per sequence as the kernel):
    # from the block holding position len - W, shifted left to stay inside the table.
    first = jnp.clip(jnp.maximum(context_lens - (window or 0), 0) // z, 0, width - span) if span < width else \
        jnp.zeros_like(context_lens)
    tables = block_tables if span == width else \
        jnp.take_along_axis(block_tables, first[:, None] + jnp.arange(span)[None, :], axis=1)  # i32[B, span]
    k = gather_dequant(k_pages, k_scale, tables, kv_dtype)  # f32[B, S, K, H]
    v = gather_dequant(v_pages, v_scale, tables, kv_dtype)
    mask = _decode_mask(context_lens - first * z, k.shape[1], window)  # positions relative to the first page
    return _attend(q, k, v, mask, scale, sinks, softcap).astype(q.dtype)


def contiguous_attention_reference(q: jax.Array, k_rows: jax.Array, v_rows: jax.Array, md: BatchMetadata,
                                   *, scale: float, window: int | None = None, sinks=None,
                                   softcap: float | None = None) -> jax.Array:
    """Ragged causal attention over a contiguous cache. q: [T, N, H]; k_rows, v_rows: [B, S, K, H]
    (row b is sequence b of md); sinks: f32[N] or None → [T, N, H]."""
    _check("q", q, 3, "[T, N, H]")
    _check_pages(q, k_rows, v_rows, None)
    window, sinks, softcap = check_variant(q.shape[1], window, sinks, softcap)
    return _ragged(q, k_rows, v_rows, md, scale, window, sinks, softcap).astype(q.dtype)


def contiguous_decode_reference(q: jax.Array, k_rows: jax.Array, v_rows: jax.Array, context_lens: jax.Array,
                                *, scale: float, window: int | None = None, sinks=None,
                                softcap: float | None = None) -> jax.Array:
    """One query per row over a contiguous cache read in place. q: [B, N, H]; k_rows, v_rows:
    [B, S, K, H]; context_lens: i32[B]; sinks: f32[N] or None → [B, N, H]."""
    _check("q", q, 3, "[B, N, H]")
    _check_pages(q, k_rows, v_rows, None)
    window, sinks, softcap = check_variant(q.shape[1], window, sinks, softcap)
    mask = _decode_mask(context_lens, k_rows.shape[1], window)
    return _attend(q, k_rows, v_rows, mask, scale, sinks, softcap).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# MLA (absorbed)
# --------------------------------------------------------------------------------------------
def _mla(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, scale: float, *, mask: jax.Array | None = None,
         md: BatchMetadata | None = None) -> jax.Array:
    """latent: [B, S, C] per sequence (C = kv_lora_rank + rope) → MQA with key = latent, value =
    c_kv. Decode: q [B, N, C], mask bool[B, S] → [B, N, kv_lora_rank]; ragged (md given):
    q [T, N, C] → [T, N, kv_lora_rank]."""
    rank = q_latent.shape[-1]
    q = jnp.concatenate([q_latent, q_rope], axis=-1)  # [.., N, C]
    k = latent[..., None, :]  # [B, S, 1, C]
    out = _ragged(q, k, k[..., :rank], md, scale) if md is not None else _attend(q, k, k[..., :rank], mask, scale)
    return out.astype(q_latent.dtype)


def mla_paged_attention_reference(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                                  md: BatchMetadata, *, scale: float, latent_scale=None,
                                  kv_dtype: str | None = None) -> jax.Array:
    """Ragged causal MLA. q_latent: [T, N, kv_lora_rank]; q_rope: [T, N, rope];
    latent_pages: [P, Z, C] → [T, N, kv_lora_rank]."""
    _check("q_latent", q_latent, 3, "[T, N, kv_lora_rank]")
    _check_latent(q_latent, q_rope, latent_pages)
    latent = gather_dequant(latent_pages, latent_scale, md.block_tables, kv_dtype)  # f32[B, S, C]
    return _mla(q_latent, q_rope, latent, scale, md=md)


def mla_paged_decode_reference(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                               block_tables: jax.Array, context_lens: jax.Array, *, scale: float,
                               latent_scale=None, kv_dtype: str | None = None) -> jax.Array:
    """Decode MLA. q_latent: [B, N, kv_lora_rank]; q_rope: [B, N, rope]; latent_pages: [P, Z, C];
    block_tables: i32[B, M]; context_lens: i32[B] → [B, N, kv_lora_rank]."""
    _check("q_latent", q_latent, 3, "[B, N, kv_lora_rank]")
    _check_latent(q_latent, q_rope, latent_pages)
    _check("block_tables", block_tables, 2, "[B, M]")
    latent = gather_dequant(latent_pages, latent_scale, block_tables, kv_dtype)  # f32[B, S, C]
    return _mla(q_latent, q_rope, latent, scale, mask=_decode_mask(context_lens, latent.shape[1]))


def mla_contiguous_attention_reference(q_latent: jax.Array, q_rope: jax.Array, latent_rows: jax.Array,
                                       md: BatchMetadata, *, scale: float) -> jax.Array:
    """Ragged causal MLA over a contiguous cache: latent_rows [B, S, C] → [T, N, kv_lora_rank]."""
    _check("q_latent", q_latent, 3, "[T, N, kv_lora_rank]")
    _check_latent(q_latent, q_rope, latent_rows)
    return _mla(q_latent, q_rope, latent_rows, scale, md=md)


def mla_contiguous_decode_reference(q_latent: jax.Array, q_rope: jax.Array, latent_rows: jax.Array,
                                    context_lens: jax.Array, *, scale: float) -> jax.Array:
    """Decode MLA over a contiguous cache read in place: latent_rows [B, S, C] → [B, N, kv_lora_rank]."""
    _check("q_latent", q_latent, 3, "[B, N, kv_lora_rank]")
    _check_latent(q_latent, q_rope, latent_rows)
    return _mla(q_latent, q_rope, latent_rows, scale, mask=_decode_mask(context_lens, latent_rows.shape[1]))
