"""Paged-decode attention for MHA/GQA/MQA on Pallas Mosaic GPU (Hopper: TMA, wgmma), with split-K.

The Mosaic GPU twin of kvjax.attention.pallas_decode (the Triton kernel JAX 0.11 deprecates): the
same arguments, the same result, the same numerics, with pages streamed by the TMA into a ring of
SMEM slots and both products on the tensor cores (kvjax.attention.mgpu_steps says how):

    grid (B, K, splits): program (b, h, s) is one warpgroup owning sequence b, kv head h — its G
    query heads in the first G of 64 wgmma rows — and split s of the pages in view
    (pallas_steps.split_pages: from the page of position len - W with a window W). It copies the
    split's table slice and q into SMEM, keeps `stages` steps of pages in flight, and writes
    (out / sum, logsumexp) for its rows, rounded up to 8 (TMA rows); `merge_splits` combines
    the splits and adds the sinks.

Numerics (pallas_decode's, with one difference): the softmax scale × K's static scale multiplies
the f32 logits in the kernel (one number per kv head); V's scale multiplies the merged f32
output outside (the merge is linear in each split's output, so this is exact); Gemma's softcap is
applied to the scaled logits before the mask. The difference: the dots run in q's dtype only,
bf16 or f16 — wgmma has no exact f32 product (its f32 inputs are TF32), so an f32 query is
refused (ValueError) and stays on the Triton kernel; pages are q's dtype or fp8 (e4m3, e5m2: every
value is exact in bf16 and f16). fp8 pages come into SMEM as fp8 (half the bytes of bf16) and
are widened in the kernel, slot by slot, into an f16 tile that the wgmma reads, against q in f16
(mgpu_steps.dot_dtype says why and when that is exact). nvfp4 pages (uint8 [P, Z, K, H/2 + H/16])
go to kvjax.attention.mgpu_nvfp4's kernel, this one with the values and block scales unpacked in
the kernel into exact f16 tiles. Per-token-head pages (int8 or e4m3, a scale per token and kv
head in f32 [P, Z, K] scale pages) bring each page's scales of every kv head as one [Z, K] TMA
box beside it (a [Z] column of one head is no TMA box: its stride is K), and the widening
multiplies each row by its token's scale in f32 — head h's column picked by a select and a row
sum, which leaves it in the layout that broadcasts along rows — rounding once to q's dtype
(the products then see no exact page values, so q keeps its dtype). K a multiple of 8 (the
box's columns fill WGMMA's 8-column tiles); the Triton kernel takes any K.

Tiles (kvjax.attention.tiles.MosaicDecodeTiles): block_kv = pages_per_block × Z tokens a step, 64
to 256 (wgmma); `stages` slots in flight (per-token pages: with their f32 [block_kv, K] scale
slots beside them); num_splits as pallas_decode chooses it. Shapes the
kernel needs: Z a multiple of 8 (a page lands on whole 8-row SMEM tiles), H a multiple of 16
with H × 2 bytes a multiple of 32 (swizzled rows). Other shapes raise ValueError.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention import mgpu_steps as st
from kvjax.attention.mgpu_interpret import compiler_params, kernel_call, require_mgpu, resolve_interpret
from kvjax.attention.mgpu_nvfp4 import check_pages as check_nvfp4_pages
from kvjax.attention.mgpu_nvfp4 import nvfp4_call
from kvjax.attention.mgpu_nvfp4 import smem_bytes as nvfp4_smem_bytes
from kvjax.attention.pallas_decode import check_scale, check_tables, check_token_scales, merge_splits
from kvjax.attention.pallas_steps import split_pages, window_pages
from kvjax.attention.reference import check_variant
from kvjax.attention.reference import paged_decode_reference  # noqa: F401  the kernel's plain jnp twin
from kvjax.attention.tiles import _SMEM_BYTES, MosaicDecodeTiles, default_mosaic_tiles, fit_smem
from kvjax.core.block_pool import NULL_BLOCK
from kvjax.math_utils import cdiv

Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


@dataclasses.dataclass(frozen=True)
class _Static:
    """What one launch's kernel is specialized on."""

    block_size: int  # Z
    pages_per_block: int
    pages_per_split: int
    table_width: int  # entries of the split's table slice in SMEM (mgpu_steps.table_width)
    max_blocks: int  # M
    stages: int
    rows_out: int  # query rows written back: the group rounded up to 8
    window: int | None
    softcap: float | None
    widen: bool  # fp8 / int8 pages: widen each slot into a 16-bit tile before the products
    per_token: bool = False  # scales per token and kv head (int8_per_token_head): applied while widening

    @property
    def block_kv(self) -> int:
        return self.pages_per_block * self.block_size


# ----------------------------------------------------------------------------------- the kernel

def _gqa_kernel(
    lens_ref,  # i32[B]: context lengths
    tables_ref,  # i32[B, M']: block tables, null-padded past every split's slice
    scale_ref,  # f32[K]: softmax scale × K's dequant scale, per kv head
    q_ref,  # [B, K, 64, H]: each kv head's query rows (group padded with zeros), in the dot dtype
    k_ref,  # [P, Z, K, H]: K pages (q's dtype, fp8; per-token: int8 or e4m3)
    v_ref,  # [P, Z, K, H]: V pages
    *refs,  # per-token scales: ks_ref, vs_ref f32[P, Z, K]; then the outputs and scratch below
    c: _Static,
):
    if c.per_token:
        ks_ref, vs_ref, *refs = refs
    (o_ref,  # f32[B, K, splits, rows_out, H]: each split's normalized output
     lse_ref,  # f32[B, K, splits, rows_out]: each split's logsumexp (-inf: saw nothing)
     q_smem,  # [64, H] dot dtype (mgpu_steps.dot_dtype)
     k_smem,  # [stages, block_kv, H] page dtype
     v_smem,  # [stages, block_kv, H]
     kw_smem,  # [block_kv, H] dot dtype: the widened K slot (fp8 / int8 pages), else unused
     vw_smem,  # [block_kv, H]: the widened V slot
     p_smem,  # [64, block_kv] dot dtype: probabilities for P·V
     o_smem,  # f32[64, min(H, 128)]: the output, staged for its TMA copy
     lse_smem,  # f32[64]
     table_smem,  # i32[table_width]: the split's table slice (from a 16-byte aligned start)
     q_bar, table_bar, kv_bars,  # barriers: q, the table slice, one per slot
     *token_smem) = refs  # per-token: ks_smem, vs_smem f32[stages, block_kv, K], every head's scales
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    head_dim = q_smem.shape[1]
    plgpu = require_mgpu()
    length = lens_ref[b]
    first_page, n_pages, n_steps = split_pages(s, length, block_size=c.block_size, pages_per_block=c.pages_per_block,
                                               pages_per_split=c.pages_per_split, max_blocks=c.max_blocks,
                                               window=c.window)
    lead = st.copy_table(tables_ref, b, first_page, table_smem, table_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
    logit_scale = scale_ref[h] * st.LOG2E  # base-2 logits (mgpu_steps)

    def issue(step, slot):
        copies = [(lambda page: k_ref.at[page, :, h], k_smem.at[slot], kv_bars.at[slot]),
                  (lambda page: v_ref.at[page, :, h], v_smem.at[slot], kv_bars.at[slot])]
        if c.per_token:  # [Z, K] boxes: a [Z] column of one head is no TMA box (its stride is not 1)
            copies += [(lambda page: ks_ref.at[page], token_smem[0].at[slot], kv_bars.at[slot]),
                       (lambda page: vs_ref.at[page], token_smem[1].at[slot], kv_bars.at[slot])]
        st.issue_pages(lambda i: table_smem[jnp.minimum(lead + i, c.table_width - 1)], step, n_pages,
                       c.pages_per_block, c.block_size, copies)

    plgpu.barrier_wait(table_bar)
    for i in range(c.stages):  # the prologue: the first `stages` steps in flight
        pl.when(i < n_steps)(functools.partial(issue, i, i))
    plgpu.barrier_wait(q_bar)

    def body(step, carry):
        o, m, l = carry
        slot = lax.rem(step, c.stages)
        plgpu.barrier_wait(kv_bars.at[slot])
        pos0 = (first_page + step * c.pages_per_block) * c.block_size
        k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
        if c.per_token:  # int8 / e4m3 × this token's scale, rounded once to the dot dtype
            kw_smem[...] = st.scale_rows(k_tile, token_smem[0].at[slot], h).astype(kw_smem.dtype)
            vw_smem[...] = st.scale_rows(v_tile, token_smem[1].at[slot], h).astype(vw_smem.dtype)
            k_tile, v_tile = kw_smem, vw_smem
            plgpu.commit_smem()
        elif c.widen:  # fp8 → f16: exact, one conversion per pair
            kw_smem[...] = k_tile[...].astype(kw_smem.dtype)
            vw_smem[...] = v_tile[...].astype(vw_smem.dtype)
            k_tile, v_tile = kw_smem, vw_smem
            plgpu.commit_smem()
        s_ = st.qk_logits(q_smem, k_tile, st.ROWS, c.block_kv)  # f32[64, block_kv]
        logits = s_ * logit_scale
        if c.softcap is not None:  # Gemma 2: c · tanh(x / c) on the scaled (natural) logits
            cap = c.softcap * st.LOG2E
            logits = cap * jnp.tanh(logits / cap)
        ok = st.visible(st.positions(logits.shape, 1, pos0), length, c.window)
        p, alpha, m, l = st.softmax_step(m, l, logits, ok)
        st.zero_rows_outside(v_tile, pos0, length, c.window)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()
        o = st.rescale(o, alpha, st.pv_product(p_smem, v_tile, st.ROWS, head_dim))
        pl.when(step + c.stages < n_steps)(functools.partial(issue, step + c.stages, slot))
        return o, m, l

    o, m, l = lax.fori_loop(0, n_steps, body, st.softmax_init(st.ROWS, head_dim))
    out, lse = st.finish(o, m, l)
    st.store_partial(out, lse, o_smem, lse_smem, o_ref.at[b, h, s], lse_ref.at[b, h, s], c.rows_out)


# ------------------------------------------------------------------------ plgpu.kernel and merging

def smem_bytes(*, head_dim: int, page_dtype, q_dtype, tiles: MosaicDecodeTiles, block_size: int,
               table_width: int, token_scale_heads: int = 0) -> int:
    """Shared memory one program allocates (the scratch of `_gqa_kernel`; token_scale_heads: K with
    per-token scales, else 0)."""
    block_kv = tiles.pages_per_block * block_size
    page, qb = jnp.dtype(page_dtype).itemsize, jnp.dtype(q_dtype).itemsize
    widened = 2 * block_kv * head_dim * qb if jnp.dtype(page_dtype) != jnp.dtype(q_dtype) else 0
    return (st.ROWS * head_dim * qb + 2 * tiles.stages * block_kv * head_dim * page + widened
            + st.ROWS * block_kv * qb + st.ROWS * min(head_dim, st.OUT_COLS) * 4 + st.ROWS * 4 + table_width * 4
            + 2 * tiles.stages * block_kv * token_scale_heads * 4 + 1024)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "tiles", "interpret", "packed"))
def _mgpu_paged_decode(q, k_pages, v_pages, block_tables, context_lens, k_scale, v_scale, sinks, token_scales, *,
                       scale, window, softcap, tiles, interpret, packed=False):
    plgpu = require_mgpu()
    batch, num_heads, head_dim = q.shape  # [B, N, H]
    _, block_size, num_kv_heads, _ = k_pages.shape  # [P, Z, K, H]
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    view = max_blocks if window is None else min(max_blocks, window_pages(window, block_size))
    pages_per_split = cdiv(cdiv(view, tiles.num_splits), tiles.pages_per_block) * tiles.pages_per_block
    table_width = st.table_width(pages_per_split)
    # A split starts at most at page M - 1 (a window's start) + (splits - 1) × pages_per_split.
    tables = jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, cdiv(max_blocks + tiles.num_splits * table_width, 4) * 4 - max_blocks)),
                     constant_values=NULL_BLOCK)
    c = _Static(block_size=block_size, pages_per_block=tiles.pages_per_block, pages_per_split=pages_per_split,
                table_width=table_width, max_blocks=max_blocks, stages=tiles.stages, rows_out=cdiv(group, 8) * 8,
                window=window, softcap=softcap, widen=jnp.dtype(k_pages.dtype) != jnp.dtype(q.dtype),
                per_token=token_scales is not None)
    # Per-token pages are scaled while widening, so the products see no exact page values: q's dtype.
    dot = q.dtype if c.per_token else st.dot_dtype(q.dtype, k_pages.dtype)
    q4 = q.reshape(batch, num_kv_heads, group, head_dim)  # query head n = kv head × G + g
    q4 = jnp.pad(st.to_dot_dtype(q4, dot), ((0, 0), (0, 0), (0, st.ROWS - group), (0, 0)))  # [B, K, 64, H]
    splits = tiles.num_splits
    variant = ("" if window is None else f"_w{window}") + ("" if softcap is None else "_cap")
    name = f"kvjax_mgpu_paged_decode_p{tiles.pages_per_block}_s{splits}_st{c.stages}{variant}"
    lens, logit_scales = context_lens.astype(jnp.int32), (k_scale * scale).astype(jnp.float32)
    if packed:  # nvfp4 pages: kvjax.attention.mgpu_nvfp4 unpacks them in its kernel
        o, lse = nvfp4_call(q4, k_pages, v_pages, lens, tables, logit_scales, c=c, splits=splits,
                            interpret=interpret, name=name + "_nvfp4")
        return _merge(o, lse, v_scale, sinks, c, q)
    block_kv, page_dtype, q_dtype = c.block_kv, k_pages.dtype, dot
    scratch = [
        st.tiled_smem((st.ROWS, head_dim), q_dtype),
        st.tiled_smem((c.stages, block_kv, head_dim), page_dtype),
        st.tiled_smem((c.stages, block_kv, head_dim), page_dtype),
        st.tiled_smem((block_kv if c.widen else 8, head_dim), q_dtype),  # 8 rows: unused
        st.tiled_smem((block_kv if c.widen else 8, head_dim), q_dtype),
        st.tiled_smem((st.ROWS, block_kv), q_dtype, swizzle=st.swizzle_bytes(head_dim, q_dtype)),  # V's swizzle
        st.tiled_smem((st.ROWS, min(head_dim, st.OUT_COLS)), jnp.float32),
        plgpu.SMEM((st.ROWS,), jnp.float32),
        plgpu.SMEM((table_width,), jnp.int32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=st.table_boxes(table_width)),
        plgpu.Barrier(num_arrivals=(4 if c.per_token else 2) * tiles.pages_per_block, num_barriers=c.stages),
    ]
    if c.per_token:  # every head's scales of a step: [block_kv, K] f32 (K a multiple of 8: WGMMA columns)
        scratch += [st.tiled_smem((c.stages, block_kv, num_kv_heads), jnp.float32) for _ in range(2)]
    out_shapes = (jax.ShapeDtypeStruct((batch, num_kv_heads, splits, c.rows_out, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((batch, num_kv_heads, splits, c.rows_out), jnp.float32))
    call = kernel_call(functools.partial(_gqa_kernel, c=c), out_shapes=out_shapes, scratch=scratch,
                       grid=(batch, num_kv_heads, splits), grid_names=("b", "h", "s"),
                       compiler_params=compiler_params(approx_math=True, reduction_scratch_bytes=0),
                       interpret=interpret, kernel_name=name)
    o, lse = call(lens, tables, logit_scales, q4, k_pages, v_pages, *(token_scales or ()))
    return _merge(o, lse, v_scale, sinks, c, q)


def _merge(o, lse, v_scale, sinks, c: _Static, q):
    """The splits' (o f32[B, K, splits, rows_out, H], lse) → [B, N, H] in q's dtype, with the sinks
    and V's scale (exact after the merge, which is linear in each split's output)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, splits = o.shape[1], o.shape[2]
    group = num_heads // num_kv_heads
    if sinks is not None:  # [N] → [K, 1, rows_out] (padded rows: no sink), once per query head
        sinks = jnp.pad(sinks.reshape(num_kv_heads, 1, group), ((0, 0), (0, 0), (0, c.rows_out - group)),
                        constant_values=-jnp.inf)
    out = o[:, :, 0] if splits == 1 and sinks is None else merge_splits(o, lse, axis=2, sinks=sinks)
    out = out * v_scale[None, :, None, None]  # f32[B, K, rows_out, H]
    return out[:, :, :group].reshape(batch, num_heads, head_dim).astype(q.dtype)


# ----------------------------------------------------------------------- validation, public API

def check_shapes(q, k_pages, v_pages, kv_dtype: str | None = None) -> None:
    """The shape and dtype rules of the Mosaic GPU decode kernel (module docstring; nvfp4 pages:
    kvjax.attention.mgpu_nvfp4's rules); ValueError."""
    from kvjax.quant.kv_formats import kv_format

    fmt = None if kv_dtype is None else kv_format(kv_dtype)
    packed, per_token = fmt is not None and fmt.scale == "per_block", fmt is not None and fmt.scale == "per_token"
    if len(q.shape) != 3:
        raise ValueError(f"q must be [B, N, H]; got shape {tuple(q.shape)}")
    if len(k_pages.shape) != 4:
        raise ValueError(f"k_pages must be [P, Z, K, H]; got shape {tuple(k_pages.shape)}")
    if tuple(v_pages.shape) != tuple(k_pages.shape) or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages {tuple(v_pages.shape)} {v_pages.dtype} must match k_pages"
                         f" {tuple(k_pages.shape)} {k_pages.dtype}")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, page_head_dim = k_pages.shape
    if packed != (jnp.dtype(k_pages.dtype) == jnp.dtype(jnp.uint8)):
        raise ValueError(f"nvfp4 pages are uint8 and uint8 pages nvfp4's: {k_pages.dtype} pages "
                         f"{'with' if packed else 'without'} kv_dtype nvfp4")
    if packed:
        check_nvfp4_pages(q, k_pages)
    elif page_head_dim != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) must equal that of the pages ({page_head_dim})")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads N={num_heads} must be a multiple of kv heads K={num_kv_heads}")
    if num_heads // num_kv_heads > st.ROWS:
        raise ValueError(f"a group of {num_heads // num_kv_heads} query heads per kv head exceeds the {st.ROWS} "
                         "rows of one wgmma tile")
    if jnp.dtype(q.dtype) not in Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} unsupported by the Mosaic GPU kernel (wgmma has no exact f32 "
                         f"product); use bf16 / f16 queries or the Triton kernel (kvjax.attention.pallas_decode)")
    if per_token:
        if jnp.dtype(k_pages.dtype) != jnp.dtype(fmt.dtype):
            raise ValueError(f"{fmt.name} pages are {jnp.dtype(fmt.dtype)}, got {k_pages.dtype}")
        if num_kv_heads % 8:
            raise ValueError(f"per-token scales of {num_kv_heads} kv heads: the Mosaic GPU kernel reads a page's "
                             "scales of every head as one [Z, K] box into WGMMA columns, so K must be a multiple of 8")
    elif not packed and jnp.dtype(k_pages.dtype) not in (jnp.dtype(q.dtype), *FP8_DTYPES):
        raise ValueError(f"k_pages dtype {k_pages.dtype} unsupported with {q.dtype} queries; use pages of q's dtype, "
                         "float8_e4m3fn or float8_e5m2")
    if block_size % 8:
        raise ValueError(f"block size {block_size} must be a multiple of 8 (a page lands on whole 8-row SMEM tiles)")
    if head_dim % 16 or (head_dim * 2) % 32:
        raise ValueError(f"head dim {head_dim} must be a multiple of 16 (wgmma, swizzled SMEM rows)")


def paged_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale: float, k_scale=None, v_scale=None,
                 window: int | None = None, sinks=None, softcap: float | None = None,
                 tiles: MosaicDecodeTiles | None = None, interpret: bool | None = None,
                 kv_dtype: str | None = None) -> jax.Array:
    """kvjax.attention.pallas_decode.paged_decode on Mosaic GPU: the same arguments and result.

    q [B, N, H] (bf16, f16; unscaled); k_pages, v_pages [P, Z, K, H] (q's dtype, float8_e4m3fn,
    float8_e5m2; per-token formats: int8 / e4m3; nvfp4: uint8 [P, Z, K, H/2 + H/16]);
    block_tables i32[B, M]; context_lens i32[B] (0 gives zeros); scale: the softmax scale;
    k_scale, v_scale: None, a per-tensor scalar or per-kv-head f32[K] dequant scales (per-token
    formats: f32[P, Z, K] scale pages); window, sinks f32[N], softcap: the layer's variants;
    tiles: None → `default_mosaic_tiles`; interpret: None → Mosaic GPU's CPU interpreter on a
    CPU backend; kv_dtype: the pages' KV format (the cache's pages carry it: "nvfp4",
    "int8_per_token_head", ...; None for pages read as they are). Returns [B, N, H] in q's dtype.
    Bad shapes raise ValueError, outside jit.
    """
    from kvjax.quant.kv_formats import kv_format

    kind = "none" if kv_dtype is None else kv_format(kv_dtype).scale
    packed, token_scales = kind == "per_block", None
    check_shapes(q, k_pages, v_pages, kv_dtype)
    batch, num_heads, head_dim = q.shape
    pages, block_size, num_kv_heads, _ = k_pages.shape
    check_tables(batch, block_tables, context_lens)
    if kind == "per_token":  # f32[P, Z, K] each, read in the kernel; no static scale
        token_scales = tuple(check_token_scales(name, x, (pages, block_size, num_kv_heads))
                             for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
        k_scale = v_scale = None
    k_scale = check_scale("k_scale", k_scale, num_kv_heads, "per kv head")
    v_scale = check_scale("v_scale", v_scale, num_kv_heads, "per kv head")
    window, sinks, softcap = check_variant(num_heads, window, sinks, softcap)
    view = block_tables.shape[1] if window is None else min(block_tables.shape[1], window_pages(window, block_size))

    def need(t: MosaicDecodeTiles) -> int:
        pages_per_split = cdiv(cdiv(view, t.num_splits), t.pages_per_block) * t.pages_per_block
        if packed:
            return nvfp4_smem_bytes(head_dim=head_dim, block_kv=t.pages_per_block * block_size, stages=t.stages,
                                    table_width=st.table_width(pages_per_split))
        return smem_bytes(head_dim=head_dim, page_dtype=k_pages.dtype, q_dtype=q.dtype, tiles=t,
                          block_size=block_size, table_width=st.table_width(pages_per_split),
                          token_scale_heads=num_kv_heads if token_scales else 0)

    if tiles is None:
        tiles = fit_smem(default_mosaic_tiles(batch=batch, row_blocks=num_kv_heads, block_size=block_size,
                                              max_blocks=view,
                                              bytes_per_token=2 * k_pages.shape[-1] * k_pages.dtype.itemsize),
                         block_size=block_size, max_blocks=view, smem_of=need)
    tiles.check(block_size=block_size)
    if need(tiles) > _SMEM_BYTES:
        raise ValueError(f"MosaicDecodeTiles {tiles} need {need(tiles)} bytes of shared memory (> {_SMEM_BYTES}): "
                         "fewer stages, a smaller block_kv or more splits (a shorter table slice)")
    return _mgpu_paged_decode(q, k_pages, v_pages, block_tables, context_lens, k_scale, v_scale, sinks, token_scales,
                              scale=float(scale), window=window, softcap=softcap, tiles=tiles,
                              interpret=resolve_interpret(interpret), packed=packed)
