"""Tiled ragged paged attention in plain jnp: flash attention over the block table, in bounded memory.

The jnp reference (kvjax.attention.reference) gathers every sequence's pages into one contiguous
copy and scores each sequence's queries against all of its positions at once: f32 temporaries of
B × Q × N × S, 64 GiB for one Llama-3-8B layer prefilling an 8,192-token chunk over 32K of
context. This module computes the same attention the way vLLM's FlashAttention / FlashInfer
backends and tpu-inference's ragged paged attention do, without ever holding S:

    for each work item (sequence b, tile of Tq of its new tokens):        lax.fori_loop
        for each kv tile (Tk = pages_per_tile × Z positions) it can see:   lax.fori_loop
            gather + dequantize the tile's pages (reference.gather_dequant, the same arithmetic)
            scores [K, Tq·G, Tk], masked; online softmax (m, l, acc) updated
        write acc / l into the item's rows of the flat [T, N, Hv] output

The online softmax is flash attention's (Dao et al. 2022, "FlashAttention", Algorithm 1): a running
row maximum m, denominator l and numerator acc, rescaled by exp(m_old − m_new) as each tile
arrives. Temporaries are O(Tq × N × Tk) per step plus the [T, N, Hv] output, whatever S is.

Work is ragged, as in vLLM's varlen call: the work items are laid out sequence after sequence
(`cdiv(new tokens, Tq)` of them for each), so a step costs the tokens it really has, not the
B × Q grid the reference pads to, and each item's kv loop runs only over the tiles its queries
can see: from the tile holding its first query's window start (0 without a window) to the tile
holding its last query's position. Tiles wholly before a sliding window, or wholly after the
item's last query (the causal upper triangle), are never read.

Every variant of the reference is here, with the reference's semantics (its module docstring):
GQA/MQA/MHA pages [P, Z, K, H], MLA absorbed over latent pages [P, Z, C] (MQA with key = latent,
value = c_kv), `window`, `sinks` (the sink enters the running softmax as a column whose score is
the sink logit and whose value is 0: m starts at the sink, l at 1, so it lands in the denominator
exactly once), `softcap`, and every page format `gather_dequant` reads (fp8 / int8 static scales,
per-token-head scale pages, nvfp4): each tile's pages (and scale pages) are gathered as they are
stored and go through the reference's own `gather_dequant`, so every value is dequantized by the
same arithmetic. Masked slots (the null block, garbage past the end, slots no query of the tile
sees) may hold NaN: their scores become −inf and their values 0 before any product.

Numerics: f32 throughout, as the reference; only the order of the softmax's sums differs (per
tile, rescaled), so the two agree to about 1e-6 relative (tests/attention/test_tiled.py states
the tolerance: 1e-5 relative plus 1e-6 × the largest |value| absolute).

Which one the models run (`ragged_attention` / `mla_ragged_attention`, the ragged form of both
the "reference" and "pallas" implementations in kvjax.attention): the tiled form when the
reference's f32 scores (B·Q·N·S × 4 bytes, i.e. B·K·Q·G·S) would exceed the backend's
`REFERENCE_SCORES_BYTES`, the reference below it. Measured side by side on the 2-core CPU
(experiments/long_context.py; experiments/results/long_context.md):

- memory: one Llama-3-8B layer prefilling 8,192 tokens over 32K needs 0.26 GiB of temporaries
  tiled against 64 GiB (bf16 pages; 0.13 GiB of it is the CPU backend's copy of the pages,
  `as_bits`); at 128K, 0.64 GiB against 257 GiB; with int8 or nvfp4 pages 0.14 GiB at any context;
- run time: as fast on batches of short prompts, where both do the same work (old / tiled
  0.98–1.06×), 1.2–2.5× faster from 512-token prompts up, on chunks over a cached prefix and on mixed
  prefill + decode steps (it skips the causal upper triangle and the reference's B × Q padding);
- compile time: slower, once per step shape (a whole 30-layer SmolLM2 ragged step of 256–2,048
  tokens, measured once: 7–10 s against 5–6 s).

So on CPU the bound is low, 16 MiB: below it a layer's attention takes at most ~20 ms and the
tiled form would save a few of them while adding compile time (the test suite's tiny models stay
there); above it the tiled form is faster and bounded. Elsewhere (a GPU) it is 256 MiB, a memory bound only: there the
reference's one batched matmul costs a few kernel launches where the tiled loops cost a few per
tile, and the tiled form's speed on a GPU is not measured yet (there the "pallas" implementation runs ragged
steps in kvjax.attention.pallas_ragged's kernel instead). Decode steps (one query per sequence) keep the decode forms, which
read only their own context.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.attention import reference as ref
from kvjax.attention.metadata import BatchMetadata
from kvjax.math_utils import cdiv

HIGHEST = ref.HIGHEST
# Per backend: the most f32 score memory (B·Q·N·S × 4 bytes) a ragged step may take through the
# reference; above it the tiled form runs. The module docstring says where each number comes from.
REFERENCE_SCORES_BYTES = {"cpu": 16 << 20, "default": 256 << 20}


@dataclasses.dataclass(frozen=True)
class PrefillTiles:
    """Static tile sizes of the tiled ragged attention (hashable: a jit static argument).

    One kv step holds a few f32 [N, q_tile, kv_tokens] arrays (scores, their exponentials) and the
    f32 K/V tile: 4 MiB each for Llama-3-8B's 32 heads at the defaults; XLA's whole program for a
    512-token chunk is 23 MiB (int8 pages), whatever the context. The defaults tied with 256 / 256
    for the fastest of q_tile 64–512 × kv_tokens 128–512 on the 2-core CPU, with half its tile
    memory (experiments/results/long_context.md, part c).
    """

    q_tile: int = 128  # new tokens of one sequence per work item (Tq); capped at the step's max_query_len
    kv_tokens: int = 256  # positions per kv tile; rounded down to whole pages (at least one)

    def __post_init__(self):
        for name in ("q_tile", "kv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PrefillTiles.{name} must be a positive int, got {value!r}")

    def pages_per_tile(self, block_size: int, max_blocks: int) -> int:
        """Pages per kv tile for pages of block_size tokens and a table of max_blocks entries."""
        return max(1, min(self.kv_tokens // block_size, max_blocks))


def reference_scores_bytes(md: BatchMetadata, num_heads: int, block_size: int) -> int:
    """f32 bytes of the reference's ragged scores for this step: B × Q × N × S (S = M × Z), the
    [B, K, Q·G, S] array of `reference._attend_blocks` (and as much again for its softmax)."""
    return md.num_seqs * md.max_query_len * num_heads * md.block_tables.shape[1] * block_size * 4


def use_tiled(md: BatchMetadata, num_heads: int, block_size: int, backend: str | None = None) -> bool:
    """Whether a ragged step runs tiled: its reference scores exceed the backend's bound
    (`REFERENCE_SCORES_BYTES`; backend None: JAX's default backend, where the step will run)."""
    backend = backend or jax.default_backend()
    bound = REFERENCE_SCORES_BYTES.get(backend, REFERENCE_SCORES_BYTES["default"])
    return reference_scores_bytes(md, num_heads, block_size) > bound


def work_items(md: BatchMetadata, q_tile: int):
    """The step's work items in token order: (sequence rows by first token i32[B], their new tokens
    i32[B], items i32[B], cumulative items i32[B]), each in that order. Item w belongs to the
    sequence order[j] with ends[j - 1] <= w < ends[j] and covers its new tokens from
    (w - ends[j - 1]) × Tq on. Token order matters for `_tiled`'s writes (rows are not in token
    order when the engine keeps a request in its row, `build_metadata`'s rows)."""
    new = jnp.zeros(md.num_seqs, jnp.int32).at[md.seq_ids].add(md.valid.astype(jnp.int32))  # i32[B]
    order = jnp.argsort(md.query_start, stable=True).astype(jnp.int32)  # padding rows have no items
    new = new[order]
    items = (new + q_tile - 1) // q_tile
    return order, new, items, jnp.cumsum(items)


def as_bits(x: jax.Array) -> jax.Array:
    """A float array narrower than f32 (bf16, fp16, fp8) viewed as unsigned integers of its width;
    others as they are.

    XLA's CPU backend (jaxlib 0.10, read from the compiled HLO) gathers and dynamic-slices these
    floats in f32: it converts the whole operand, moves the elements there and converts back.
    Inside a loop that convert is loop-invariant and is hoisted out: an f32 copy of the whole page pool (or of the whole output),
    twice the pool's bytes, the O(S) memory the tiles exist to avoid. On integer bits the moves are
    native. The bitcast itself is not free on CPU either (the backend materialises it, once, outside
    the loop: one copy of the pool in its own width); that copy is the one O(pool) term left in the
    tiled form's temporaries there (experiments/results/long_context.md lists it)."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize >= 4:
        return x
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}"))


def from_bits(bits: jax.Array, dtype) -> jax.Array:
    """`as_bits` undone: integer bits back to the floating dtype they were (others as they are)."""
    return bits if bits.dtype == jnp.dtype(dtype) else lax.bitcast_convert_type(bits, dtype)


def page_tile(pages: jax.Array, ids: jax.Array) -> jax.Array:
    """Pages ids i32[p] of a page array [P, Z, ...], as they are stored: a small page array
    [p, Z, ...], gathered as bits (`as_bits`)."""
    return from_bits(as_bits(pages)[ids], pages.dtype)


def _tiled(q: jax.Array, md: BatchMetadata, read_kv: Callable, value_dim: int, block_size: int, *, scale: float,
           window: int | None, sinks: jax.Array | None, softcap: float | None, tiles: PrefillTiles) -> jax.Array:
    """Ragged causal attention, tile by tile.

    q: [T, N, Hk]; read_kv(pages i32[p]) → (k f32[p·Z, K, Hk], v f32[p·Z, K, Hv]), the kv tile of
    those pages, dequantized; value_dim Hv → [T, N, Hv] in q's dtype, zero for padding tokens.

    Each item writes its Tq rows from its first token, whole: rows past its sequence's last token
    hold zeros (no key is visible to them), and since items run in token order the items of the
    tokens there come later and overwrite them. The output is kept as the bits of q's dtype
    (`as_bits`), each item's f32 result rounded to q's dtype as the reference rounds its own.
    """
    t, heads, _ = q.shape
    width = md.block_tables.shape[1]
    ppt = tiles.pages_per_tile(block_size, width)
    tk = ppt * block_size  # positions per kv tile
    num_kv_tiles = cdiv(width, ppt)
    tables = jnp.pad(md.block_tables, ((0, 0), (0, num_kv_tiles * ppt - width)))  # null blocks: masked anyway
    tq = max(1, min(tiles.q_tile, md.max_query_len, t))
    probe_k, _ = jax.eval_shape(read_kv, jax.ShapeDtypeStruct((ppt,), jnp.int32))
    kv_heads = probe_k.shape[1]
    group = heads // kv_heads
    order, new, items, ends = work_items(md, tq)
    dtype = q.dtype
    q = jnp.pad(as_bits(q), ((0, tq), (0, 0), (0, 0)))  # [T + Tq, N, Hk] bits: every item reads Tq whole rows
    positions = jnp.pad(md.positions, (0, tq))
    sink_rows = None if sinks is None else jnp.broadcast_to(sinks.reshape(kv_heads, 1, group), (kv_heads, tq, group))

    def item(w, out):  # out: [T + Tq, N, Hv], bits of q's dtype
        j = jnp.searchsorted(ends, w, side="right").astype(jnp.int32)
        b = order[j]  # the item's sequence (its row)
        first = md.query_start[b] + (w - (ends[j] - items[j])) * tq  # its first token in T
        rows = jnp.minimum(tq, md.query_start[b] + new[j] - first)  # its tokens (the last item's may be < Tq)
        mine = jnp.arange(tq, dtype=jnp.int32) < rows  # bool[Tq]
        pos = lax.dynamic_slice(positions, (first,), (tq,))  # i32[Tq]
        ctx = md.context_lens[b]
        lo_pos = 0 if window is None else jnp.maximum(positions[first] - window + 1, 0)
        hi_pos = jnp.minimum(positions[first + rows - 1] + 1, ctx)  # positions are ascending in a sequence
        qt = from_bits(lax.dynamic_slice(q, (first, 0, 0), (tq, heads, q.shape[2])), dtype)  # [Tq, N, Hk]
        qt = qt.astype(jnp.float32).reshape(tq, kv_heads, group, -1).transpose(1, 0, 2, 3)
        qt = qt.reshape(kv_heads, tq * group, -1)  # f32[K, Tq·G, Hk]

        def kv_step(i, carry):  # m, l: f32[K, Tq, G]; acc: f32[K, Tq·G, Hv]
            m, l, acc = carry
            k, v = read_kv(lax.dynamic_slice(tables[b], (i * ppt,), (ppt,)))  # f32[Tk, K, Hk], f32[Tk, K, Hv]
            s = i * tk + jnp.arange(tk, dtype=jnp.int32)  # the tile's positions
            visible = mine[:, None] & (s[None, :] <= pos[:, None]) & (s[None, :] < ctx)  # bool[Tq, Tk]
            if window is not None:
                visible = visible & (s[None, :] > pos[:, None] - window)
            # A garbage key only spoils its own score, which the mask replaces; a garbage value would
            # reach every row through 0 × NaN, so values no row sees are zeroed.
            v = jnp.where(jnp.any(visible, axis=0)[:, None, None], v, 0.0)
            scores = jnp.matmul(qt, k.transpose(1, 2, 0), precision=HIGHEST)  # f32[K, Tq·G, Tk]
            scores = ref._scaled(scores, scale, softcap).reshape(kv_heads, tq, group, tk)
            vis = visible[None, :, None, :]
            scores = jnp.where(vis, scores, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))  # f32[K, Tq, G]
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that have seen no key yet
            alpha = jnp.exp(m - m_safe)  # 0 while m is −inf
            p = jnp.where(vis, jnp.exp(scores - m_safe[..., None]), 0.0)  # f32[K, Tq, G, Tk]
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = jnp.matmul(p.reshape(kv_heads, tq * group, tk), v.transpose(1, 0, 2), precision=HIGHEST)
            acc = alpha.reshape(kv_heads, tq * group, 1) * acc + pv  # f32[K, Tq·G, Hv]
            return m_new, l, acc

        if sinks is None:
            m0, l0 = jnp.full((kv_heads, tq, group), -jnp.inf), jnp.zeros((kv_heads, tq, group))
        else:  # the sink: a column of score `sink` and value 0, seen first, so it is in l exactly once
            m0, l0 = sink_rows, jnp.ones((kv_heads, tq, group))
        acc0 = jnp.zeros((kv_heads, tq * group, value_dim), jnp.float32)
        _, l, acc = lax.fori_loop(lo_pos // tk, cdiv(hi_pos, tk), kv_step, (m0, l0, acc0))
        res = acc / jnp.where(l > 0, l, 1.0).reshape(kv_heads, tq * group, 1)  # rows with no key: 0
        res = res.reshape(kv_heads, tq, group, value_dim).transpose(1, 0, 2, 3).reshape(tq, heads, value_dim)
        return lax.dynamic_update_slice(out, as_bits(res.astype(dtype)), (first, 0, 0))

    out = as_bits(jnp.zeros((t + tq, heads, value_dim), dtype))
    return from_bits(lax.fori_loop(0, ends[-1], item, out)[:t], dtype)


def _dequant_tile(pages: jax.Array, scale, ids: jax.Array, kv_dtype: str | None) -> jax.Array:
    """Pages ids i32[p] of pages [P, Z, ...] in the format kv_dtype → f32[p·Z, ...]: the reference's
    `gather_dequant` run on the tile's own pages (and per-token scale pages), so that each value
    is dequantized by the same arithmetic; its gather by the identity table is a copy of the tile."""
    if scale is not None and ref.scale_kind(pages, scale, kv_dtype) == "per_token":
        scale = page_tile(jnp.asarray(scale, jnp.float32), ids)  # f32[p, Z, ...]: the tile's scale pages
    tile = page_tile(pages, ids)  # [p, Z, ...]
    return ref.gather_dequant(tile, scale, jnp.arange(ids.shape[0], dtype=jnp.int32)[None], kv_dtype)[0]


# --------------------------------------------------------------------------------------------
# MHA / GQA / MQA
# --------------------------------------------------------------------------------------------
def paged_attention_tiled(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: BatchMetadata, *,
                          scale: float, k_scale=None, v_scale=None, window: int | None = None, sinks=None,
                          softcap: float | None = None, kv_dtype: str | None = None,
                          tiles: PrefillTiles = PrefillTiles()) -> jax.Array:
    """`reference.paged_attention_reference`, tile by tile: the same arguments and result.

    q: [T, N, H]; k_pages, v_pages: [P, Z, K, H] (nvfp4: uint8 [P, Z, K, H/2 + H/16]) with this
    step's K/V already written; k_scale, v_scale as the format says (`reference.gather_dequant`);
    window, sinks f32[N], softcap: the reference's variants → [T, N, H] in q's dtype.
    """
    ref._check("q", q, 3, "[T, N, H]")
    ref._check_pages(q, k_pages, v_pages, kv_dtype)
    window, sinks, softcap = ref.check_variant(q.shape[1], window, sinks, softcap)

    def read_kv(ids):  # i32[p] → f32[p·Z, K, H] twice
        return _dequant_tile(k_pages, k_scale, ids, kv_dtype), _dequant_tile(v_pages, v_scale, ids, kv_dtype)

    return _tiled(q, md, read_kv, q.shape[-1], k_pages.shape[1], scale=scale, window=window, sinks=sinks,
                  softcap=softcap, tiles=tiles)


# --------------------------------------------------------------------------------------------
# MLA (absorbed)
# --------------------------------------------------------------------------------------------
def mla_paged_attention_tiled(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, md: BatchMetadata,
                              *, scale: float, latent_scale=None, kv_dtype: str | None = None,
                              tiles: PrefillTiles = PrefillTiles()) -> jax.Array:
    """`reference.mla_paged_attention_reference`, tile by tile. q_latent: [T, N, kv_lora_rank];
    q_rope: [T, N, rope]; latent_pages: [P, Z, C] → [T, N, kv_lora_rank] in q_latent's dtype."""
    ref._check("q_latent", q_latent, 3, "[T, N, kv_lora_rank]")
    ref._check_latent(q_latent, q_rope, latent_pages)
    rank = q_latent.shape[-1]
    q = jnp.concatenate([q_latent, q_rope], axis=-1)  # [T, N, C], promoted as the reference does

    def read_kv(ids):  # one kv head: key = the whole latent, value = its c_kv lanes
        latent = _dequant_tile(latent_pages, latent_scale, ids, kv_dtype)[:, None, :]  # f32[p·Z, 1, C]
        return latent, latent[..., :rank]

    return _tiled(q, md, read_kv, rank, latent_pages.shape[1], scale=scale, window=None, sinks=None, softcap=None,
                  tiles=tiles).astype(q_latent.dtype)


# --------------------------------------------------------------------------------------------
# The ragged form the implementations run: tiled where the reference would not fit
# --------------------------------------------------------------------------------------------
def ragged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: BatchMetadata, *, scale: float,
                     k_scale=None, v_scale=None, window: int | None = None, sinks=None,
                     softcap: float | None = None, kv_dtype: str | None = None) -> jax.Array:
    """A prefill or mixed step: the reference while its scores fit the backend's
    `REFERENCE_SCORES_BYTES`, else the tiled form (`use_tiled`; the module docstring says why).
    Same arguments and result as either."""
    fn = paged_attention_tiled if use_tiled(md, q.shape[1], k_pages.shape[1]) else ref.paged_attention_reference
    return fn(q, k_pages, v_pages, md, scale=scale, k_scale=k_scale, v_scale=v_scale, window=window, sinks=sinks,
              softcap=softcap, kv_dtype=kv_dtype)


def mla_ragged_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, md: BatchMetadata, *,
                         scale: float, latent_scale=None, kv_dtype: str | None = None) -> jax.Array:
    """MLA's `ragged_attention`: the reference below the bound, the tiled form above it."""
    fn = mla_paged_attention_tiled if use_tiled(md, q_latent.shape[1], latent_pages.shape[1]) else \
        ref.mla_paged_attention_reference
    return fn(q_latent, q_rope, latent_pages, md, scale=scale, latent_scale=latent_scale, kv_dtype=kv_dtype)
