"""Pallas paged-decode attention for MHA/GQA/MQA, with split-K and in-kernel fp8 dequantization.

One query token per sequence attends to its whole history in the paged cache, the step that
makes decode memory-bound (SPEC "Why decode is bound by KV memory"). The kernel follows the
structure of JAX's shipped `jax/experimental/pallas/ops/gpu/paged_attention.py` (a portable
Pallas kernel that runs in interpret mode on CPU and lowers through Triton on a GPU), on
kvjax's layout — vLLM's flash-attention layout per layer, pages [P, Z, K, H], block 0 the null
block — and reads each K/V page once per kv head:

    grid (B, K, splits): program (b, h, s) owns sequence b, kv head h — all G query heads of
    its group, padded to block_h rows — and split s of the block table. It gathers
    pages_per_block pages per step via the table, keeps an online softmax in f32 and writes
    (out / sum, logsumexp) for its split; `merge_splits` combines the splits.

Numerics:
- `scale` (the softmax scale) is applied in the kernel to the f32 logits, so pass q unscaled.
- fp8 pages are dequantized in the kernel by their per-kv-head scale: page.astype(f32) × scale
  (vLLM's `k_scale`/`v_scale`: stored = x / scale, scale = amax / format max). Since it is one number per
  program, it is applied where it is exact and cheap: to the f32 logits (K) and to the f32
  output (V), so the fp8 → bf16 cast that feeds the tensor cores is exact (every e4m3 and e5m2
  value is a bf16 value). A per-tensor scale is the same number for every head.
- nvfp4 pages (uint8 [P, Z, K, H/2 + H/16], kvjax.quant.nvfp4) go to kvjax.attention.pallas_nvfp4's
  kernel, this one with the values and block scales loaded as two blocks and unpacked in the kernel.
- Per-token-head pages (int8_per_token_head, fp8_per_token_head: a scale per token and kv head,
  scale pages f32 [P, Z, K]) load each step's scales beside its pages: K's multiply the f32
  logits column by column (exact), V's multiply V's rows in f32 before the one rounding to the
  dot dtype (int8 and e4m3 values are exact in bf16; their product with a scale is not).
- Dots run in q's dtype when every page value is exact in it (bf16/f16 q with same-dtype or
  fp8 pages), else in f32 with Precision.HIGHEST (Triton's default f32 dot is TF32); both
  accumulate in f32. Probabilities are cast to the dot dtype for the P·V product, as
  FlashAttention does.
- Masked slots (past a sequence's length, in the null block, or in a page that a garbage table
  entry would name) never reach the output: table entries past a sequence's last page are
  replaced by the null block before they index anything, logits past its length are masked,
  and their V rows are zeroed, so NaN or inf garbage stays out (0 × NaN would not).
- A context length of 0 (a padding sequence) gives a zero output, not NaN.

Sliding windows, sinks and soft-capping (kvjax.attention.reference's variants; GQA only, not MLA):
- window W: the decode query at position len - 1 sees positions len - W .. len - 1. The splits
  tile the pages from the one holding position len - W (`split_pages`), so pages wholly before
  the window are never read — the null block vLLM's SlidingWindowManager leaves there, or
  pages not yet freed — and a step costs O(W) per sequence, not O(context); the tiles are sized
  for the pages a window touches (`window_pages`). Positions before len - W in the first page
  are masked like those past len.
- softcap c: c · tanh(logits / c) on the f32 logits after both scales, before the mask.
- sinks f32[N]: added once, in the split merge's denominator (`merge_splits`), never per split.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.attention.pallas_nvfp4 import nvfp4_decode_call
from kvjax.attention.pallas_steps import (MASK_VALUE, dot_f32, in_view, online_softmax_step,  # noqa: F401
                                          program_split, split_inputs, split_outputs, split_pages, step_pages,
                                          window_pages, write_partial)
from kvjax.attention.reference import check_variant
from kvjax.attention.reference import paged_decode_reference  # noqa: F401  the kernel's plain jnp twin
from kvjax.attention.tiles import DecodeTiles, default_tiles
from kvjax.core.block_pool import NULL_BLOCK
from kvjax.math_utils import cdiv, is_power_of_two
from kvjax.quant import nvfp4
from kvjax.quant.kv_formats import kv_format, kv_formats

# From kvjax.quant.kv_formats's table: the kernels read unscaled pages, pages with a static
# scale (fp8) and nvfp4's packed uint8 pages (PAGE_DTYPES), and per-token-head pages (int8 / e4m3
# with f32 [P, Z, K] scale pages, named by their kv_dtype); q comes in an unscaled (model) dtype.
FP8_DTYPES = tuple(f.dtype for f in kv_formats("static"))  # float8_e4m3fn, float8_e5m2
NVFP4_DTYPE = jnp.dtype(jnp.uint8)
PAGE_DTYPES = tuple(f.dtype for f in kv_formats("none", "static", "per_block"))
Q_DTYPES = tuple(f.dtype for f in kv_formats("none"))  # float32, bfloat16, float16


# ----------------------------------------------------------------------------------- the kernel

def _gqa_kernel(
    lens_ref,  # i32[1]: this sequence's context length
    tables_ref,  # i32[M + pages_per_block - 1]: this sequence's block table, null-padded
    q_ref,  # [block_h, H]: this kv head's query rows (group padded with zeros)
    k_ref,  # [P, Z, H]: this kv head's K pages
    v_ref,  # [P, Z, H]: this kv head's V pages
    k_scale_ref,  # f32[1]: K dequant scale of this kv head
    v_scale_ref,  # f32[1]: V dequant scale of this kv head
    *refs,  # per_token: ks_ref, vs_ref f32[P, Z] (this kv head's scale pages); then o_ref, lse_ref
    sm_scale: float, pages_per_block: int, pages_per_split: int, max_blocks: int, window: int | None,
    softcap: float | None, compute_dtype, precision, per_token: bool = False,
):
    ks_ref, vs_ref, o_ref, lse_ref = refs if per_token else (None, None, *refs)
    # o_ref f32[block_h, H]: this split's normalized output; lse_ref f32[block_h]: its logsumexp (-inf: no token)
    block_h, head_dim = q_ref.shape
    block_size, block_k, length, first_page, n_pages, n_steps = program_split(
        lens_ref, k_ref, pages_per_block=pages_per_block, pages_per_split=pages_per_split, max_blocks=max_blocks,
        window=window)

    q = q_ref[...].astype(compute_dtype)  # [block_h, H]
    logit_scale = sm_scale * k_scale_ref[0]  # K's dequant scale folds into the logits exactly

    def body(step, carry):
        pages, pos = step_pages(tables_ref, step, n_pages, first_page, block_size, pages_per_block)
        valid = in_view(pos, length, window)  # bool[block_k]
        k = k_ref[pages].reshape(block_k, head_dim).astype(compute_dtype)  # [block_k, H]
        v = v_ref[pages].reshape(block_k, head_dim)  # [block_k, H]
        if per_token:  # V rows × their token's scale, rounded once to the dot dtype; K's scale on the logits
            v = v.astype(jnp.float32) * vs_ref[pages].reshape(block_k)[:, None]
        v = jnp.where(valid[:, None], v.astype(compute_dtype), 0)  # garbage slots must not meet a zero weight
        logits = dot_f32(q, k, contract_b=1, precision=precision) * logit_scale  # f32[block_h, block_k]
        if per_token:
            logits = logits * ks_ref[pages].reshape(block_k)[None, :]  # NaN past the view: masked by a select
        if softcap is not None:  # Gemma 2: after the scales, before the mask
            logits = softcap * jnp.tanh(logits / softcap)
        return online_softmax_step(carry, logits, valid, v, compute_dtype, precision)

    init = (jnp.zeros((block_h, head_dim), jnp.float32), jnp.full((block_h,), MASK_VALUE, jnp.float32),
            jnp.zeros((block_h,), jnp.float32))
    o, m, l = lax.fori_loop(0, n_steps, body, init)
    write_partial(o_ref, lse_ref, o, m, l, v_scale_ref[0])


# --------------------------------------------------------------------- pallas_call and merging

def compute_dtype_for(q_dtype, page_dtype):
    """The dot input dtype: q's when every page value is exact in it, else f32 (see module doc)."""
    q_dtype, page_dtype = jnp.dtype(q_dtype), jnp.dtype(page_dtype)
    if q_dtype != jnp.float32 and (page_dtype == q_dtype or page_dtype in FP8_DTYPES or page_dtype == NVFP4_DTYPE
                                   or page_dtype == jnp.int8):  # int8 (the ragged kernel's): |x| <= 127, exact
        return q_dtype
    return jnp.dtype(jnp.float32)


def dot_precision(compute_dtype):
    return lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None


def split_block_tables(block_tables, num_splits: int, pages_per_block: int, pages_in_view: int | None = None):
    """i32[B, M] → (i32[B, M + pages_per_block - 1] padded with the null block, pages_per_split).

    pages_in_view: the most pages one query sees (None: M; a window: `window_pages`), which the
    splits share, each pages_per_split (a multiple of pages_per_block) of them. A step reads
    pages_per_block entries from a page below M, hence the padding.
    """
    max_blocks = block_tables.shape[1]
    view = max_blocks if pages_in_view is None else min(pages_in_view, max_blocks)
    pages_per_split = cdiv(cdiv(view, num_splits), pages_per_block) * pages_per_block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pages_per_block - 1)), constant_values=NULL_BLOCK)
    return tables, pages_per_split


def merge_splits(o, lse, axis: int, sinks=None):
    """Combine per-split normalized outputs o [..., splits, block_h, width] and logsumexps
    lse [..., splits, block_h]; sinks: None or f32 logits broadcasting against lse with the
    split axis of size 1 (−inf: no sink).

    out = Σ_s exp(lse_s − max) o_s / (Σ_s exp(lse_s − max) + exp(sink − max)), max over the
    splits' lse and the sink: the sink joins the denominator once. Splits that saw no token
    carry lse = −inf and weigh 0; if no split saw a token (context length 0) the output is 0.
    """
    m = lse.max(axis=axis, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # all −inf: avoid −inf − (−inf) = NaN
    w = jnp.exp(lse - m)  # [..., splits, block_h]
    denom = w.sum(axis=axis)
    if sinks is not None:
        denom = denom + jnp.squeeze(jnp.exp(sinks - m), axis)
    out = (w[..., None] * o).sum(axis=axis)
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "tiles", "interpret", "packed"))
def _paged_decode(q, k_pages, v_pages, block_tables, context_lens, k_scale, v_scale, sinks, token_scales, *, scale,
                  window, softcap, tiles, interpret, packed):
    batch, num_heads, head_dim = q.shape  # [B, N, H]
    _, block_size, num_kv_heads, _ = k_pages.shape  # [P, Z, K, H]
    group = num_heads // num_kv_heads
    block_h = tiles.block_h
    q4 = q.reshape(batch, num_kv_heads, group, head_dim)  # query head n = kv head × G + g
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))  # [B, K, block_h, H]
    view = None if window is None else window_pages(window, block_size)
    tables, pages_per_split = split_block_tables(block_tables, tiles.num_splits, tiles.pages_per_block, view)
    num_splits = tiles.num_splits
    compute_dtype = compute_dtype_for(q.dtype, k_pages.dtype)
    kernel = functools.partial(_gqa_kernel, sm_scale=scale, pages_per_block=tiles.pages_per_block,
                               pages_per_split=pages_per_split, max_blocks=block_tables.shape[1], window=window,
                               softcap=softcap, compute_dtype=compute_dtype, precision=dot_precision(compute_dtype),
                               **({} if token_scales is None else dict(per_token=True)))
    variant = ("" if window is None else f"_w{window}") + ("" if softcap is None else "_cap")
    head_scalar_spec = pl.BlockSpec((1,), lambda b, h, s: (h,))
    call = dict(grid=(batch, num_kv_heads, num_splits), interpret=interpret,
                compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
                name=f"kvjax_paged_decode_h{block_h}_p{tiles.pages_per_block}_s{num_splits}{variant}")
    lens = context_lens.astype(jnp.int32)
    if packed:  # nvfp4 (kvjax.attention.pallas_nvfp4): values and block scales apart
        o, lse = nvfp4_decode_call(kernel.keywords, call, lens, tables, q4, k_pages, v_pages, k_scale, v_scale,
                                   block_h=block_h, head_scalar_spec=head_scalar_spec)
    else:
        page_spec = pl.BlockSpec((k_pages.shape[0], block_size, None, head_dim), lambda b, h, s: (0, 0, h, 0))
        token_spec = pl.BlockSpec((k_pages.shape[0], block_size, None), lambda b, h, s: (0, 0, h))  # [P, Z]
        o, lse = pl.pallas_call(
            kernel,
            in_specs=[
                *split_inputs(tables.shape[1]),
                pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0)),  # q
                page_spec, page_spec, head_scalar_spec, head_scalar_spec,
                *([token_spec, token_spec] if token_scales is not None else []),
            ],
            **split_outputs(batch, num_kv_heads, num_splits, block_h, head_dim), **call,
        )(lens, tables, q4, k_pages, v_pages, k_scale, v_scale, *(token_scales or ()))
    if sinks is not None:  # [N] → [K, 1, block_h] (padded rows: no sink), once per query head
        sinks = jnp.pad(sinks.reshape(num_kv_heads, 1, group), ((0, 0), (0, 0), (0, block_h - group)),
                        constant_values=-jnp.inf)
    if num_splits == 1 and sinks is None:
        out = o[:, :, 0]  # f32[B, K, block_h, H]
    else:
        out = merge_splits(o, lse, axis=2, sinks=sinks)
    return out[:, :, :group].reshape(batch, num_heads, head_dim).astype(q.dtype)


# ----------------------------------------------------------------------- validation, public API

def resolve_interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def check_tables(batch: int, block_tables, context_lens) -> None:
    """block_tables i32[B, M] and context_lens i32[B] must match the batch of q."""
    if len(block_tables.shape) != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks >= 1]; got shape {tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (batch,):
        raise ValueError(f"context_lens must be [B={batch}]; got shape {tuple(context_lens.shape)}")
    for name, arr in (("block_tables", block_tables), ("context_lens", context_lens)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array; got dtype {arr.dtype}")


def check_scale(name: str, value, size: int, what: str):
    """None → ones; a scalar (per tensor) → broadcast; f32[size] → as is; anything else: ValueError."""
    if value is None:
        return jnp.ones((size,), jnp.float32)
    shape = tuple(jnp.shape(value))
    if shape not in ((), (size,)):
        raise ValueError(f"{name} must be a scalar or [{size}] ({what}); got shape {shape}")
    if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
        raise ValueError(f"{name} must be floating point; got dtype {jnp.result_type(value)}")
    return jnp.broadcast_to(jnp.asarray(value, jnp.float32), (size,))


def check_dtypes(q_dtype, page_dtype, q_name: str, page_name: str) -> None:
    if jnp.dtype(q_dtype) not in Q_DTYPES:
        raise ValueError(f"{q_name} dtype {q_dtype} unsupported; use one of {[str(d) for d in Q_DTYPES]}")
    if jnp.dtype(page_dtype) not in PAGE_DTYPES:
        raise ValueError(f"{page_name} dtype {page_dtype} unsupported; use one of {[str(d) for d in PAGE_DTYPES]}")


def check_token_scales(name: str, value, shape: tuple):
    """Per-token scale pages must be f32 [P, Z, K] (one per token and kv head); ValueError."""
    if value is None or tuple(jnp.shape(value)) != shape or jnp.result_type(value) != jnp.float32:
        got = None if value is None else f"{jnp.result_type(value)} {tuple(jnp.shape(value))}"
        raise ValueError(f"per-token pages need {name} f32{list(shape)} (a scale per token and kv head); got {got}")
    return value


def paged_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale: float, k_scale=None, v_scale=None,
                 window: int | None = None, sinks=None, softcap: float | None = None,
                 tiles: DecodeTiles | None = None, interpret: bool | None = None,
                 kv_dtype: str | None = None) -> jax.Array:
    """Decode attention of one query token per sequence over a paged K/V cache (Pallas kernel).

    q [B, N, H] (f32, bf16, f16; unscaled); k_pages, v_pages [P, Z, K, H] (f32, bf16, f16,
    float8_e4m3fn, float8_e5m2; per-token formats: int8 / e4m3; nvfp4: uint8 [P, Z, K, H/2 + H/16]);
    block_tables i32[B, M] (entries past a sequence's last page are never read); context_lens i32[B]
    (0 <= len <= M × Z; 0 gives a zero output); scale: softmax scale, applied in the kernel; k_scale,
    v_scale: None (1.0), a per-tensor scalar or per-kv-head f32[K] dequant scales (per-token formats:
    f32[P, Z, K] scale pages); window (int >= 1), sinks (f32[N]), softcap (> 0): the layer's variants
    (module docstring), None for off; tiles: None → `default_tiles` for the pages in view; interpret:
    None → True on CPU; kv_dtype: the pages' KV format (the cache's pages carry it; "nvfp4",
    "int8_per_token_head", ...; None for pages read as they are).
    Returns [B, N, H] in q's dtype. Shapes and dtypes are checked here, outside jit; bad ones raise
    ValueError.
    """
    if len(q.shape) != 3:
        raise ValueError(f"q must be [B, N, H]; got shape {tuple(q.shape)}")
    if len(k_pages.shape) != 4:
        raise ValueError(f"k_pages must be [P, Z, K, H]; got shape {tuple(k_pages.shape)}")
    if tuple(v_pages.shape) != tuple(k_pages.shape) or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages {tuple(v_pages.shape)} {v_pages.dtype} must match k_pages"
                         f" {tuple(k_pages.shape)} {k_pages.dtype}")
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, page_head_dim = k_pages.shape
    kind = "none" if kv_dtype is None else kv_format(kv_dtype).scale
    packed, token_scales = kind == "per_block", None
    if packed != (k_pages.dtype == NVFP4_DTYPE):
        raise ValueError(f"nvfp4 pages are uint8 and uint8 pages nvfp4's: kv_dtype {kv_dtype!r} with {k_pages.dtype} "
                         "pages")
    if packed:  # nvfp4's packed heads
        if head_dim % nvfp4.GROUP or page_head_dim != nvfp4.packed_width(head_dim):
            raise ValueError(f"nvfp4 pages hold H/2 + H/16 bytes per head (H a multiple of {nvfp4.GROUP}); "
                             f"q's head dim {head_dim} does not fit the pages' {page_head_dim}")
    elif page_head_dim != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) must equal that of the pages ({page_head_dim})")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads N={num_heads} must be a multiple of kv heads K={num_kv_heads}")
    if kind == "per_token":  # int8 / e4m3 pages with f32[P, Z, K] scale pages, read in the kernel
        check_dtypes(q.dtype, q.dtype, "q", "k_pages")
        if jnp.dtype(k_pages.dtype) != jnp.dtype(kv_format(kv_dtype).dtype):
            raise ValueError(f"{kv_dtype} pages are {jnp.dtype(kv_format(kv_dtype).dtype)}, got {k_pages.dtype}")
        token_scales = tuple(check_token_scales(name, x, tuple(k_pages.shape[:3]))
                             for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
        k_scale = v_scale = None
    else:
        check_dtypes(q.dtype, k_pages.dtype, "q", "k_pages")
    for name, n in (("head dim", head_dim), ("block size", block_size)):
        if not is_power_of_two(n):
            raise ValueError(f"{name} {n} must be a power of two (Triton tiles); use the reference path")
    check_tables(batch, block_tables, context_lens)
    k_scale = check_scale("k_scale", k_scale, num_kv_heads, "per kv head")
    v_scale = check_scale("v_scale", v_scale, num_kv_heads, "per kv head")
    window, sinks, softcap = check_variant(num_heads, window, sinks, softcap)
    group = num_heads // num_kv_heads
    if tiles is None:
        view = block_tables.shape[1] if window is None else min(block_tables.shape[1], window_pages(window, block_size))
        tiles = default_tiles(batch=batch, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                              block_size=block_size, max_blocks=view)
    tiles.check(block_size=block_size, rows=group)
    return _paged_decode(q, k_pages, v_pages, block_tables, context_lens, k_scale, v_scale, sinks, token_scales,
                         scale=float(scale), window=window, softcap=softcap, tiles=tiles,
                         interpret=resolve_interpret(interpret), packed=packed)
