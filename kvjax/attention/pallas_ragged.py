"""Pallas ragged paged attention: one kernel for a whole prefill / mixed step, read from the pages.

kvjax.attention.tiled computes a ragged step tile by tile in jnp (bounded memory, XLA's loops);
this is the same computation as one Pallas kernel, the form vLLM's FlashAttention varlen call,
FlashInfer's batch prefill and tpu-inference's ragged paged attention take on their devices:

    grid (work item w, kv head h): program (w, h) owns q_tile new tokens of one sequence (the item)
    and the G query heads of kv head h — q_tile × G' rows, G' = G padded to a power of two. It
    walks the kv blocks (pages_per_block pages through the block table) its rows can see, from
    the block holding the first row's window start (0 without a window) to the block holding its
    last row's position, keeping an online softmax in f32 (flash attention, Dao et al. 2022),
    and writes (out / sum, logsumexp) for its rows.

The work items are those of kvjax.attention.tiled (`cdiv(new tokens, q_tile)` per sequence, laid
out in token order), computed in jnp around the call; the grid is static, `cdiv(T, q_tile) + B`
items (at least as many as any step of T tokens over B sequences has), and an item past the
step's last does nothing. Outside the kernel: each item's query rows are gathered into a
[items, K, rows, H] block (a copy of q, not of the cache), sinks join each row's denominator
from its logsumexp (pallas_decode's `merge_splits` with one split), the V scale multiplies the
output, and the rows are scattered back to the flat [T, N, H] token axis.

Variants, as kvjax.attention.reference defines them: GQA/MQA/MHA pages [P, Z, K, H]; MLA absorbed
over latent pages [P, Z, C] (one kv head whose key is the latent and whose value is its first
kv_lora_rank lanes; the N heads are the "group"); `window`, `sinks`, `softcap`; and the page
formats dequantized in the kernel:
- static scales (fp8 e4m3/e5m2; per tensor or per kv head): K's scale folds into the logits and
  V's into the output, exactly (one number per program), so fp8 → bf16 is the only cast;
- per-token scales (int8_per_token_head, fp8_per_token_head: scale pages [P, Z, K]): K's scale
  multiplies its logit column, V's the probability column of the P·V product (p · (s v) =
  (p s) · v), so the int8 / fp8 values feed the dot as they are (every int8 value is exact in
  bf16); the softmax's denominator takes the unscaled p;
- nvfp4 (uint8 [P, Z, K, H/2 + H/16]): pallas_nvfp4's layout — values and block scales come in
  as two power-of-two blocks of the same array, are unpacked in the kernel into even and odd
  lanes, and dotted with q's even and odd lanes; the output's two lane planes are interleaved
  outside;
- MLA's per-channel static scale moves onto the query outside the kernel (q × s) · page and onto
  the output, as pallas_mla does.

Masks: a row sees position s when its token is one of the item's, s <= its position, s < the
context length, and (window W) s > position − W. A kv block may hold positions no row sees
(the causal corner, the window's edge, past the context, vLLM's null blocks before a window):
their logits become MASK_VALUE and their probabilities exactly 0, and values (and V's
per-token scales) outside the item's span [first row's window start, last row's position] are
zeroed before any product, so NaN or garbage there never reaches the output (0 × NaN would).
Table entries past a sequence's last page are replaced by the null block before they address
anything. The rows of one item are consecutive tokens of one sequence at consecutive positions
(kvjax.attention.metadata's layout), so row r's position is the item's first position + r // G'.

Numerics are pallas_decode's: the softmax scale applied in the kernel to the f32 logits; dots in
q's dtype when every page value is exact in it (bf16 / f16 q with same-dtype, fp8, int8 or nvfp4
pages; probabilities cast to it for P·V, as FlashAttention does), else f32 with
Precision.HIGHEST; accumulation in f32; rows with nothing to see give 0.

This is the Triton kernel, which runs on any CUDA GPU: the Triton lowering takes `ref[pages]`
with a vector of page ids (pallas_decode's kernels do the same), runs in interpret mode on CPU,
and lowers for CUDA from a CPU-only machine (tests/attention/test_gpu_lowering.py,
`lowering_platforms=("cuda",)`). Its Mosaic GPU twins (kvjax.attention.mgpu_ragged for GQA,
mgpu_ragged_mla for MLA; Hopper only: TMA copies a page at a time, wgmma) take the same
arguments; kvjax.attention.mgpu_dispatch picks between them by measurement. Triton's rules
apply here: every block dimension a power of two, dots at least 16 × 16 × 16 — hence
q_tile × G' >= 16 rows, pages_per_block × Z >= 16 positions, power-of-two head dims.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.attention import reference as ref
from kvjax.attention import tiled
from kvjax.attention.metadata import BatchMetadata
from kvjax.attention.pallas_decode import (Q_DTYPES, check_scale, compute_dtype_for, dot_precision, merge_splits,
                                           resolve_interpret)
from kvjax.attention.pallas_steps import MASK_VALUE, dot_f32
from kvjax.core.block_pool import NULL_BLOCK
from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv, is_power_of_two, pow2_bucket
from kvjax.quant import nvfp4


@dataclasses.dataclass(frozen=True)
class RaggedTiles:
    """Static tile sizes of one ragged-kernel launch (hashable: a jit static argument).

    The defaults are educated guesses, not tuned on a GPU: 128 query rows (32 tokens × a group
    of 4 for Llama-3-8B) against kv blocks of 64 positions keep one program's f32 accumulator at
    128 × H and its scores at 128 × 64, the sizes FlashAttention-2's Hopper tiles use.
    """

    q_tile: int = 0  # new tokens per work item (power of two); 0: 128 rows' worth (`for_group`)
    pages_per_block: int = 0  # pages per kv step (power of two); 0: 64 positions' worth
    num_warps: int = 4  # Triton launch parameter; ignored in interpret mode
    num_stages: int = 2  # Triton software-pipelining depth; ignored in interpret mode

    def resolve(self, *, group_rows: int, block_size: int, max_query_len: int) -> "RaggedTiles":
        """These tiles for G' = group_rows and pages of block_size: zeros filled in, q_tile cut
        down to what a step's max_query_len needs (not below 16 rows unless given so); checked."""
        self._check_given()
        least = pow2_bucket(cdiv(16, group_rows))  # q_tile of 16 rows
        q_tile = min(self.q_tile or max(1, 128 // group_rows), pow2_bucket(max_query_len))
        q_tile = max(q_tile, least if self.q_tile == 0 else min(self.q_tile, least))
        ppb = self.pages_per_block or max(1, 64 // block_size, pow2_bucket(cdiv(16, block_size)))
        tiles = dataclasses.replace(self, q_tile=q_tile, pages_per_block=ppb)
        if q_tile * group_rows < 16 or ppb * block_size < 16:
            raise KvjaxError(f"RaggedTiles: {q_tile} tokens × {group_rows} heads = {q_tile * group_rows} rows and "
                             f"{ppb} pages × {block_size} = {ppb * block_size} positions per step; Triton dots need "
                             ">= 16 each")
        return tiles

    def _check_given(self) -> None:
        for name in ("q_tile", "pages_per_block", "num_warps", "num_stages"):
            value = getattr(self, name)
            lo = 0 if name in ("q_tile", "pages_per_block") else 1  # 0: the default
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise KvjaxError(f"RaggedTiles.{name} must be a {'non-negative' if lo == 0 else 'positive'} int, "
                                 f"got {value!r}")
        for name in ("q_tile", "pages_per_block"):
            if getattr(self, name) and not is_power_of_two(getattr(self, name)):
                raise KvjaxError(f"RaggedTiles.{name} must be a power of two (Triton tiles), got {getattr(self, name)}")


# ----------------------------------------------------------------------------------- the kernel

def _ragged_kernel(meta_ref, tables_ref, scale_ref, *refs, n_q: int, n_out: int, load, group_shift: int,
                   pages_per_block: int, window: int | None, softcap: float | None, compute_dtype, precision):
    """One work item × one kv head. meta_ref i32[4]: (rows of the item's tokens, context length,
    first row's position, unused); tables_ref i32[M']: the item's sequence's table, null-padded;
    scale_ref f32[1]: the logit scale (softmax scale × K's static scale); refs: n_q query planes
    [R, ·], the kv refs `load` reads, n_out output planes f32[R, ·] and the logsumexp f32[R]."""
    q_refs, kv_refs, out_refs = refs[:n_q], refs[n_q:len(refs) - n_out - 1], refs[len(refs) - n_out - 1:]
    num_rows = q_refs[0].shape[0]
    block_size = load.block_size(kv_refs)
    block_k = pages_per_block * block_size
    tokens, length, first_pos = meta_ref[0], meta_ref[1], meta_ref[2]
    row_pos = first_pos + lax.shift_right_logical(jnp.arange(num_rows, dtype=jnp.int32), group_shift)  # i32[R]
    row_live = row_pos < first_pos + tokens
    span_lo = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)  # what any row may see
    span_hi = jnp.minimum(first_pos + tokens, length)
    lo_step = lax.div(span_lo, block_k)
    hi_step = jnp.where(tokens > 0, pl.cdiv(span_hi, block_k), 0)
    live_pages = pl.cdiv(length, block_size)  # entries past these may be garbage
    qs = tuple(r[...].astype(compute_dtype) for r in q_refs)
    logit_scale = scale_ref[0]

    def body(step, carry):
        o, m, l = carry
        local = step * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        pages = jnp.where(local < live_pages, tables_ref[pl.ds(step * pages_per_block, pages_per_block)], NULL_BLOCK)
        pos = step * block_k + jnp.arange(block_k, dtype=jnp.int32)  # i32[block_k]
        col_ok = (pos >= span_lo) & (pos < span_hi)
        ks, vs, k_tok, v_tok = load(kv_refs, pages, block_k, compute_dtype)
        logits = dot_f32(qs[0], ks[0], contract_b=1, precision=precision)
        for q_, k_ in zip(qs[1:], ks[1:]):
            logits = logits + dot_f32(q_, k_, contract_b=1, precision=precision)
        logits = logits * logit_scale  # f32[R, block_k]
        if k_tok is not None:
            logits = logits * k_tok[None, :]
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        seen = row_live[:, None] & (pos[None, :] <= row_pos[:, None]) & (pos[None, :] < length)
        if window is not None:
            seen = seen & (pos[None, :] > row_pos[:, None] - window)
        logits = jnp.where(seen, logits, MASK_VALUE)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(seen, jnp.exp(logits - m_new[:, None]), 0.0)  # a row may see nothing in this block
        l = alpha * l + p.sum(axis=-1)
        if v_tok is not None:
            p = p * jnp.where(col_ok, v_tok, 0.0)[None, :]
        p = p.astype(compute_dtype)
        vs = tuple(jnp.where(col_ok[:, None], v_, 0) for v_ in vs)  # garbage must not meet a zero weight
        o = tuple(alpha[:, None] * o_ + dot_f32(p, v_, contract_b=0, precision=precision) for o_, v_ in zip(o, vs))
        return o, m_new, l

    init = (tuple(jnp.zeros(r.shape, jnp.float32) for r in out_refs[:-1]),
            jnp.full((num_rows,), MASK_VALUE, jnp.float32), jnp.zeros((num_rows,), jnp.float32))
    o, m, l = lax.fori_loop(lo_step, hi_step, body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    for out_ref, o_ in zip(out_refs[:-1], o):
        out_ref[...] = jnp.where(seen[:, None], o_ / l_safe[:, None], 0.0)
    out_refs[-1][...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


class _Pages:
    """How the kernel reads one kind of page: `block_size(kv_refs)` and `__call__(kv_refs, pages,
    block_k, dtype)` → (K planes, V planes, K per-token scales or None, V's or None), each plane
    [block_k, width] in the dot dtype."""

    def __init__(self, kind: str, per_token: bool, rank: int = 0):
        self.kind, self.per_token, self.rank = kind, per_token, rank

    @staticmethod
    def block_size(kv_refs) -> int:
        return kv_refs[0].shape[1]

    def __call__(self, kv_refs, pages, block_k, dtype):
        def plane(r, lanes=None):
            x = r[pages] if lanes is None else r[pages, :, lanes]
            return x.reshape(block_k, x.shape[-1])

        if self.kind == "nvfp4":  # values, block scales of K, then of V
            kd, ks, vd, vs = kv_refs

            def unpack(d, s):
                return tuple(x.astype(dtype) for x in nvfp4.unpack(plane(d), plane(s)))
            return unpack(kd, ks), unpack(vd, vs), None, None
        tok = None
        if self.per_token:
            kv_refs, tok = kv_refs[:-2], tuple(r[pages].reshape(block_k) for r in kv_refs[-2:])
        if self.kind == "mla":  # key: c_kv and k_rope lanes of the latent; value: c_kv
            (latent,) = kv_refs
            c_kv = plane(latent, pl.ds(0, self.rank)).astype(dtype)
            k_rope = plane(latent, pl.ds(self.rank, latent.shape[2] - self.rank)).astype(dtype)
            return (c_kv, k_rope), (c_kv,), *(tok or (None, None))
        k_ref, v_ref = kv_refs
        return (plane(k_ref).astype(dtype),), (plane(v_ref).astype(dtype),), *(tok or (None, None))


# --------------------------------------------------------------------- work items and the call

def padded_work_items(md: BatchMetadata, q_tile: int, num_items: int):
    """The step's work items (kvjax.attention.tiled.work_items: sequence by sequence in token order,
    each sequence's new tokens q_tile at a time), padded to num_items: (sequence row i32[W], first
    token i32[W], tokens i32[W]; 0 for an item past the last)."""
    order, new, items, ends = tiled.work_items(md, q_tile)
    w = jnp.arange(num_items, dtype=jnp.int32)
    j = jnp.minimum(jnp.searchsorted(ends, w, side="right"), md.num_seqs - 1).astype(jnp.int32)
    row = order[j]
    first = md.query_start[row] + (w - (ends[j] - items[j])) * q_tile
    tokens = jnp.where(w < ends[-1], jnp.minimum(q_tile, md.query_start[row] + new[j] - first), 0)
    return row, jnp.where(tokens > 0, first, 0), tokens


@functools.partial(jax.jit, static_argnames=("kind", "per_token", "rank", "group", "value_dim", "scale", "window",
                                             "softcap", "tiles", "interpret", "out_dtype"))
def _ragged(q_planes, kv_arrays, md, logit_scale, out_scale, sinks, *, kind, per_token, rank, group, value_dim, scale,
            window, softcap, tiles, interpret, out_dtype):
    """q_planes: ([T, K, G, ·], ...) query lane planes; kv_arrays: the pages (and per-token scale
    pages) as `_kv_specs` lays them out; logit_scale f32[K] (× the softmax scale in the kernel);
    out_scale f32[K] (MLA: f32[kv_lora_rank]); sinks f32[K, G] or None → [T, K, G, Hv] in out_dtype."""
    t, kv_heads = q_planes[0].shape[:2]
    gp = pow2_bucket(group)
    tq = tiles.q_tile
    rows = tq * gp
    num_items = cdiv(t, tq) + md.num_seqs
    seq, first, tokens = padded_work_items(md, tq, num_items)
    ppb = tiles.pages_per_block
    width = cdiv(md.block_tables.shape[1], ppb) * ppb
    tables = jnp.pad(md.block_tables.astype(jnp.int32), ((0, 0), (0, width - md.block_tables.shape[1])),
                     constant_values=NULL_BLOCK)[seq]  # i32[W, M']
    meta = jnp.stack([tokens, md.context_lens[seq], md.positions[first], jnp.zeros_like(tokens)], axis=1)
    idx = first[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]  # i32[W, Tq]: the items' tokens
    live = jnp.arange(tq, dtype=jnp.int32)[None, :] < tokens[:, None]
    idx = jnp.where(live, idx, t)  # past the end: a dropped scatter, a zero query

    def item_rows(x):  # [T, K, G, d] → [W, K, Tq·G', d]
        x = jnp.pad(x, ((0, 1), (0, 0), (0, gp - group), (0, 0)))[idx]  # [W, Tq, K, G', d]
        return x.transpose(0, 2, 1, 3, 4).reshape(num_items, kv_heads, rows, x.shape[-1])

    items_q = [item_rows(x) for x in q_planes]
    load = _Pages(kind, per_token, rank)
    kv_specs = _kv_specs(kind, per_token, kv_arrays, rank)
    compute_dtype = compute_dtype_for(q_planes[0].dtype, kv_arrays[0].dtype)
    kernel = functools.partial(_ragged_kernel, n_q=len(items_q), n_out=len(value_dim), load=load,
                               group_shift=gp.bit_length() - 1, pages_per_block=ppb, window=window, softcap=softcap,
                               compute_dtype=compute_dtype, precision=dot_precision(compute_dtype))
    variant = ("" if window is None else f"_w{window}") + ("" if softcap is None else "_cap")
    outs = pl.pallas_call(
        kernel,
        grid=(num_items, kv_heads),
        in_specs=[pl.BlockSpec((None, 4), lambda w, h: (w, 0)), pl.BlockSpec((None, width), lambda w, h: (w, 0)),
                  pl.BlockSpec((1,), lambda w, h: (h,)),
                  *[pl.BlockSpec((None, None, rows, x.shape[-1]), lambda w, h: (w, h, 0, 0)) for x in items_q],
                  *[spec for spec, _ in kv_specs]],
        out_specs=[*[pl.BlockSpec((None, None, rows, d), lambda w, h: (w, h, 0, 0)) for d in value_dim],
                   pl.BlockSpec((None, None, rows), lambda w, h: (w, h, 0))],
        out_shape=[*[jax.ShapeDtypeStruct((num_items, kv_heads, rows, d), jnp.float32) for d in value_dim],
                   jax.ShapeDtypeStruct((num_items, kv_heads, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name=f"kvjax_ragged_paged_attention_{kind}_q{tq}_g{gp}_p{ppb}{variant}",
    )(meta, tables, logit_scale * scale, *items_q, *[x for _, x in kv_specs])
    o = jnp.stack(outs[:-1], axis=-1).reshape(*outs[0].shape[:-1], -1) if len(outs) > 2 else outs[0]
    if sinks is not None:  # once per row, from its logsumexp
        sinks = jnp.pad(sinks, ((0, 0), (0, gp - group)), constant_values=-jnp.inf)
        sink_rows = jnp.broadcast_to(sinks[None, :, None, :], (num_items, kv_heads, tq, gp)).reshape(
            num_items, kv_heads, 1, rows)
        o = merge_splits(o[:, :, None], outs[-1][:, :, None], axis=2, sinks=sink_rows)
    o = o * (out_scale if kind == "mla" else out_scale[None, :, None, None])  # MLA: per channel; else per kv head
    o = o.reshape(num_items, kv_heads, tq, gp, -1)[:, :, :, :group].transpose(0, 2, 1, 3, 4)  # [W, Tq, K, G, Hv]
    out = jnp.zeros((t + 1, kv_heads, group, o.shape[-1]), out_dtype)  # rounded once, as the reference rounds
    return out.at[idx].set(o.astype(out_dtype), mode="drop")[:t]


def _kv_specs(kind: str, per_token: bool, arrays, rank: int) -> list:
    """(BlockSpec, array) of each kv input: a whole kv head's pages per program (the kernel
    gathers pages through the table), nvfp4's two lane blocks, per-token scale pages [P, Z]."""
    def head(a, lanes=None, lane_block=0):
        lanes = a.shape[-1] if lanes is None else lanes
        return pl.BlockSpec((a.shape[0], a.shape[1], None, lanes), lambda w, h: (0, 0, h, lane_block)), a

    if kind == "mla":
        latent = arrays[0]
        specs = [(pl.BlockSpec(latent.shape, lambda w, h: (0, 0, 0)), latent)]
        if per_token:
            specs.append((pl.BlockSpec(arrays[1].shape, lambda w, h: (0, 0)), arrays[1]))
            specs.append(specs[-1])  # the latent's scale is K's and V's
        return specs
    if kind == "nvfp4":
        specs = []
        for pages in arrays:
            half = (pages.shape[-1] * 8) // 9  # H/2 of H/2 + H/16 bytes
            specs += [head(pages, half), head(pages, half // 8, 8)]  # values; block scales start at lane-block 8
        return specs
    specs = [head(arrays[0]), head(arrays[1])]
    if per_token:
        specs += [(pl.BlockSpec((a.shape[0], a.shape[1], None), lambda w, h: (0, 0, h)), a) for a in arrays[2:]]
    return specs


# ----------------------------------------------------------------------- validation, public API

def _check_q(name: str, q) -> None:
    if jnp.dtype(q.dtype) not in Q_DTYPES:
        raise KvjaxError(f"{name} dtype {q.dtype} unsupported; use one of {[str(d) for d in Q_DTYPES]}")


def _pow2(**dims) -> None:
    for name, n in dims.items():
        if not is_power_of_two(n):
            raise KvjaxError(f"{name} {n} must be a power of two (Triton tiles); use attn_impl 'reference'")


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: BatchMetadata, *,
                           scale: float, k_scale=None, v_scale=None, window: int | None = None, sinks=None,
                           softcap: float | None = None, kv_dtype: str | None = None,
                           tiles: RaggedTiles = RaggedTiles(), interpret: bool | None = None) -> jax.Array:
    """`reference.paged_attention_reference` as one Pallas kernel: the same arguments and result.

    q: [T, N, H] (f32, bf16, f16; unscaled); k_pages, v_pages: [P, Z, K, H] in the format kv_dtype
    (None, fp8 static, int8/fp8 per-token-head with scale pages [P, Z, K], nvfp4 uint8
    [P, Z, K, H/2 + H/16]) with this step's K/V written; window, sinks f32[N], softcap: the layer's
    variants; tiles: `RaggedTiles` (zeros: defaults); interpret: None → True on CPU. Returns
    [T, N, H] in q's dtype, zero for padding tokens. Bad shapes or formats raise KvjaxError.
    """
    ref._check("q", q, 3, "[T, N, H]")
    ref._check_pages(q, k_pages, v_pages, kv_dtype)
    _check_q("q", q)
    window, sinks, softcap = ref.check_variant(q.shape[1], window, sinks, softcap)
    t, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    kind = ref.scale_kind(k_pages, k_scale, kv_dtype)
    per_token = kind == "per_token"
    _pow2(**{"head dim": head_dim, "block size": block_size})
    tiles = tiles.resolve(group_rows=pow2_bucket(group), block_size=block_size, max_query_len=md.max_query_len)
    q4 = q.reshape(t, kv_heads, group, head_dim)
    if per_token:
        arrays = (k_pages, v_pages, jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32))
        k_scale = v_scale = None
    else:
        arrays = (k_pages, v_pages)
    k_scale = check_scale("k_scale", k_scale, kv_heads, "per kv head")
    v_scale = check_scale("v_scale", v_scale, kv_heads, "per kv head")
    planes = (q4[..., 0::2], q4[..., 1::2]) if kind == "per_block" else (q4,)
    value_dim = (head_dim // 2, head_dim // 2) if kind == "per_block" else (head_dim,)
    out = _ragged(planes, arrays, md, k_scale, v_scale, None if sinks is None else sinks.reshape(kv_heads, group),
                  kind="nvfp4" if kind == "per_block" else "gqa", per_token=per_token, rank=0, group=group,
                  value_dim=value_dim, scale=float(scale), window=window, softcap=softcap, tiles=tiles,
                  interpret=resolve_interpret(interpret), out_dtype=jnp.dtype(q.dtype))
    return out.reshape(t, heads, head_dim)


def mla_ragged_paged_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, md: BatchMetadata,
                               *, scale: float, latent_scale=None, kv_dtype: str | None = None,
                               tiles: RaggedTiles = RaggedTiles(), interpret: bool | None = None) -> jax.Array:
    """`reference.mla_paged_attention_reference` as one Pallas kernel. q_latent [T, N, kv_lora_rank],
    q_rope [T, N, rope]; latent_pages [P, Z, C] (static: latent_scale None, a scalar or f32[C];
    per-token: scale pages [P, Z]) → [T, N, kv_lora_rank] in q_latent's dtype."""
    ref._check("q_latent", q_latent, 3, "[T, N, kv_lora_rank]")
    ref._check_latent(q_latent, q_rope, latent_pages)
    _check_q("q_latent", q_latent)
    t, heads, rank = q_latent.shape
    _, block_size, channels = latent_pages.shape
    kind = ref.scale_kind(latent_pages, latent_scale, kv_dtype)
    if kind == "per_block":
        raise KvjaxError(f"{kv_dtype} latent pages are not read by the MLA kernels; use attn_impl 'reference'")
    _pow2(kv_lora_rank=rank, qk_rope_head_dim=channels - rank, **{"block size": block_size})
    tiles = tiles.resolve(group_rows=pow2_bucket(heads), block_size=block_size, max_query_len=md.max_query_len)
    per_token = kind == "per_token"
    channel_scale = check_scale("latent_scale", None if per_token else latent_scale, channels, "per latent channel")
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32) * channel_scale  # (q × s) · page
    q = q.astype(jnp.promote_types(q_latent.dtype, q_rope.dtype))[:, None]  # [T, 1, N, C]
    arrays = (latent_pages, jnp.asarray(latent_scale, jnp.float32)) if per_token else (latent_pages,)
    out = _ragged((q[..., :rank], q[..., rank:]), arrays, md, jnp.ones((1,), jnp.float32), channel_scale[:rank],
                  None, kind="mla", per_token=per_token, rank=rank, group=heads, value_dim=(rank,),
                  scale=float(scale), window=None, softcap=None, tiles=tiles, interpret=resolve_interpret(interpret),
                  out_dtype=jnp.dtype(q_latent.dtype))
    return out.reshape(t, heads, rank)
