"""The Mosaic GPU paged-decode kernel on nvfp4 pages (kvjax.attention.mgpu_decode's GQA kernel, split out).

nvfp4 pages are uint8 [P, Z, K, H/2 + H/16] (kvjax.quant.nvfp4: E2M1 values two per byte, then
one e4m3 block scale per 16 values; vLLM's layout). The kernel is mgpu_decode's — grid (B, K,
splits), one warpgroup per program, pages streamed by the TMA into `stages` SMEM slots, both
products on wgmma, the online softmax in registers — with the pages unpacked in the kernel:

- **Two TMA boxes per page and head.** A head's W = 9H/16 bytes are no multiple of 16, so the
  [P, Z, K, W] array cannot be a TMA tensor (every stride but the last must be). The kernel
  sees it as [P, Z, K·W] (a free reshape; K·W must be a multiple of 16, i.e. H·K of 256) and
  copies, per page, the values [Z, H/2] from column h·W and the last 16 bytes of the head
  [Z, 16] from column h·W + W − 16 (a box's row must be 16 bytes or more): its last H/16
  bytes are the block scales, the rest are values the kernel ignores.
- **Values unpacked in registers into even and odd lanes.** Byte i holds elements 2i (low
  nibble) and 2i + 1 (high nibble); as in kvjax.attention.pallas_nvfp4 they are never
  interleaved: q·k = q_even·k_even + q_odd·k_odd (two wgmmas into one accumulator), P·V is
  computed as two halves, and the caller interleaves the halves of the output.
- **Block scales broadcast by a wgmma.** Each scale multiplies 16 consecutive values, 8 of each
  half: a broadcast over groups of 8 columns that register layouts do not offer. The scale
  bytes, decoded to f16 (the ignored bytes zeroed by a select, so a NaN there cannot reach a
  product), times a constant 0/1 matrix E [16, H/2] (E[c, j] = 1 where c is the scale of
  column j) is that broadcast on the tensor cores, exact: each output is 1 × one scale.
- **Exact in f16.** An E2M1 value (2 significant bits, |x| <= 6) times an e4m3 scale (4 bits,
  2^-9 <= |s| <= 448) lies in f16's normal range with 6 significant bits: the unpacked tiles
  are exact f16 and meet q in f16, as fp8 pages do (mgpu_steps.dot_dtype). The per-tensor
  scale folds into the logits (K) and the merged output (V) as fp8's static scale does.
- **Unread slots stay out** as in mgpu_steps: a slot outside the view (the byte 0x7F in the
  tests: a NaN block scale) is masked in the logits by a select and zeroed in both V halves
  before P·V.
- **Layouts, and why through SMEM twice.** A box starting at byte h·W cannot land in tiled SMEM
  (Mosaic GPU tiles the GMEM view too, whose K·W columns are no multiple of a tile), and
  Mosaic GPU loads untiled 8-bit SMEM in WGMMA's register layout only with bank conflicts, so
  the bytes are decoded in the strided layout a plain load gives, stored as f16 into untiled
  tiles whose rows are padded by RAW_PAD (reads in WGMMA's layout then hit distinct banks), read
  back in WGMMA's layout — that of the scale broadcast — scaled, and stored into the swizzled
  tiles the dots read. The kernel pins Mosaic GPU's Lane lowering semantics: its layouts are
  explicit, and Warpgroup semantics' layout inference (JAX 0.11's default) tiles those untiled
  buffers, which the same two rules then refuse.

Tiles: kvjax.attention.tiles.MosaicDecodeTiles, as the bf16 kernel's. SMEM holds the packed
slots (H/2 + 16 bytes per token and head, K and V, `stages` of them: what is in flight) and
one step's unpacking: six f16 tiles of [block_kv, H/2] (the even and odd lanes of K and V for
the dots, and the unscaled even and odd lanes) and the scale boxes, so the default tiles give up stages or tokens a step
sooner than for bf16 pages (`smem_bytes`, tiles.fit_smem).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention import mgpu_steps as st
from kvjax.attention.mgpu_interpret import kernel_call, require_mgpu
from kvjax.attention.pallas_steps import split_pages
from kvjax.quant import nvfp4

BOX = 16  # bytes of the scale box: a TMA box row's minimum
MAX_HEAD_DIM = 128  # above, two stages of 64 tokens and the unpacked tiles exceed 227 KiB of SMEM
RAW_PAD = 8  # f16 columns padding each row of the unscaled tiles (16 bytes: rows start 4 banks apart)


def expand_matrix(head_dim: int):
    """f16 Eᵀ [H/2, 16]: Eᵀ[j, c] = 1 where byte c of the head's last 16 holds column j's block scale."""
    groups = head_dim // nvfp4.GROUP
    scale_col = BOX - groups + jnp.arange(head_dim // 2) // (nvfp4.GROUP // 2)  # [H/2]
    return (scale_col[:, None] == jnp.arange(BOX)[None, :]).astype(jnp.float16)


def _e2m1(codes):
    """i32 codes 0..15 → f32 E2M1 values (sign 0x8; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    m = codes & 7
    mf = m.astype(jnp.float32)
    mag = jnp.where(m < 5, mf * 0.5, jnp.where(m == 5, 3.0, jnp.where(m == 6, 4.0, 6.0)))
    return jnp.where(codes >= 8, -mag, mag)


def _e4m3(byte):
    """i32 bytes holding float8_e4m3fn → f32 (kvjax.quant.nvfp4.e4m3_values, restated for registers)."""
    e, m = (byte >> 3) & 15, byte & 7
    mag = jnp.where(e == 0, 2 * m, (8 + m) << e).astype(jnp.float32) * jnp.float32(2.0 ** -10)
    mag = jnp.where((e == 15) & (m == 7), jnp.nan, mag)
    return jnp.where(byte >= 128, -mag, mag)


def unpack(data_slot, box_slot, sc_smem, raw_smem, et_smem, even_smem, odd_smem, groups: int):
    """Packed [block_kv, H/2] values and [block_kv, 16] scale boxes → exact f16 even / odd tiles.

    The nibbles are decoded in the layout a plain load of the packed bytes gets (Mosaic GPU loads
    untiled 8-bit SMEM in WGMMA's layout only with bank conflicts, and a TMA box starting at h·W
    cannot land in tiled SMEM) into untiled f16 tiles, which are read back in WGMMA's layout, that
    of the scale broadcast's product, scaled and stored into the tiles the dots read. The ragged
    kernel on nvfp4 pages (kvjax.attention.mgpu_ragged_nvfp4) unpacks its steps with it too."""
    plgpu = require_mgpu()
    block_kv, half = data_slot.shape
    data = data_slot[...].astype(jnp.int32)  # [block_kv, H/2]
    raw = [raw_smem.at[i, :, pl.ds(0, half)] for i in range(2)]  # rows padded: WGMMA-layout reads conflict-free
    raw[0][...] = _e2m1(data & 15).astype(raw_smem.dtype)  # even lanes (low nibbles), unscaled
    raw[1][...] = _e2m1(data >> 4).astype(raw_smem.dtype)
    raw_box = raw_smem.at[2, :, pl.ds(0, BOX)]
    raw_box[...] = _e4m3(box_slot[...].astype(jnp.int32)).astype(raw_smem.dtype)  # [block_kv, 16], as the values
    plgpu.commit_smem()
    box = plgpu.layout_cast(raw_box[...], plgpu.Layout.WGMMA)
    sc_smem[...] = jnp.where(st.positions(box.shape, 1, 0) >= BOX - groups, box, jnp.zeros((), box.dtype))
    plgpu.commit_smem()
    scales = st.qk_logits(sc_smem, et_smem, block_kv, half)  # f32[block_kv, H/2]: each column's block scale
    for src, dst in zip(raw, (even_smem, odd_smem)):
        dst[...] = (plgpu.layout_cast(src[...], plgpu.Layout.WGMMA).astype(jnp.float32) * scales).astype(dst.dtype)


def _nvfp4_kernel(
    lens_ref,  # i32[B]: context lengths
    tables_ref,  # i32[B, M']: block tables, null-padded past every split's slice
    scale_ref,  # f32[K]: softmax scale × K's per-tensor scale, per kv head
    qe_ref, qo_ref,  # f16[B, K, 64, H/2]: each kv head's query rows, even and odd lanes
    et_ref,  # f16[H/2, 16]: Eᵀ (`expand_matrix`)
    k_ref, v_ref,  # uint8 [P, Z, K·W]: the packed pages, heads side by side
    o_ref,  # f32[B, K, splits, rows_out, H]: each split's normalized output, even lanes then odd
    lse_ref,  # f32[B, K, splits, rows_out]
    qe_smem, qo_smem,  # f16[64, H/2]
    et_smem,  # f16[H/2, 16]
    kd_smem, vd_smem,  # uint8 [stages, block_kv, H/2]: packed values
    kb_smem, vb_smem,  # uint8 [stages, block_kv, 16]: each head's last 16 bytes (scales at the end)
    sc_smem,  # f16[block_kv, 16]: decoded scale boxes
    raw_smem,  # f16[3, block_kv, H/2 + RAW_PAD]: unscaled even and odd values, decoded scale boxes; untiled
    ke_smem, ko_smem, ve_smem, vo_smem,  # f16[block_kv, H/2]: the unpacked step
    p_smem,  # f16[64, block_kv]
    o_smem, lse_smem, table_smem,
    q_bar, table_bar, kv_bars,
    *, c, head_dim: int,
):
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    plgpu = require_mgpu()
    half, groups, width = head_dim // 2, head_dim // nvfp4.GROUP, nvfp4.packed_width(head_dim)
    length = lens_ref[b]
    first_page, n_pages, n_steps = _split(s, length, c)
    lead = st.copy_table(tables_ref, b, first_page, table_smem, table_bar)
    for src, dst in ((qe_ref.at[b, h], qe_smem), (qo_ref.at[b, h], qo_smem), (et_ref, et_smem)):
        plgpu.copy_gmem_to_smem(src, dst, q_bar)
    logit_scale = scale_ref[h] * st.LOG2E
    values, box = pl.ds(h * width, half), pl.ds(h * width + width - BOX, BOX)

    def issue(step, slot):
        st.issue_pages(lambda i: table_smem[jnp.minimum(lead + i, c.table_width - 1)], step, n_pages,
                       c.pages_per_block, c.block_size, [
            (lambda page: k_ref.at[page, :, values], kd_smem.at[slot], kv_bars.at[slot]),
            (lambda page: k_ref.at[page, :, box], kb_smem.at[slot], kv_bars.at[slot]),
            (lambda page: v_ref.at[page, :, values], vd_smem.at[slot], kv_bars.at[slot]),
            (lambda page: v_ref.at[page, :, box], vb_smem.at[slot], kv_bars.at[slot])])

    plgpu.barrier_wait(table_bar)
    for i in range(c.stages):
        pl.when(i < n_steps)(functools.partial(issue, i, i))
    plgpu.barrier_wait(q_bar)

    def body(step, carry):
        oe, oo, m, l = carry
        slot = lax.rem(step, c.stages)
        plgpu.barrier_wait(kv_bars.at[slot])
        pos0 = (first_page + step * c.pages_per_block) * c.block_size
        unpack(kd_smem.at[slot], kb_smem.at[slot], sc_smem, raw_smem, et_smem, ke_smem, ko_smem, groups)
        plgpu.commit_smem()  # a barrier: every warp's reads of raw_smem done before V's unpack rewrites it
        unpack(vd_smem.at[slot], vb_smem.at[slot], sc_smem, raw_smem, et_smem, ve_smem, vo_smem, groups)
        plgpu.commit_smem()
        logits = (st.qk_logits(qe_smem, ke_smem, st.ROWS, c.block_kv)
                  + st.qk_logits(qo_smem, ko_smem, st.ROWS, c.block_kv)) * logit_scale
        if c.softcap is not None:
            cap = c.softcap * st.LOG2E
            logits = cap * jnp.tanh(logits / cap)
        ok = st.visible(st.positions(logits.shape, 1, pos0), length, c.window)
        p, alpha, m, l = st.softmax_step(m, l, logits, ok)
        st.zero_rows_outside(ve_smem, pos0, length, c.window)
        st.zero_rows_outside(vo_smem, pos0, length, c.window)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()
        oe = st.rescale(oe, alpha, st.pv_product(p_smem, ve_smem, st.ROWS, half))
        oo = st.rescale(oo, alpha, st.pv_product(p_smem, vo_smem, st.ROWS, half))
        pl.when(step + c.stages < n_steps)(functools.partial(issue, step + c.stages, slot))
        return oe, oo, m, l

    oe, m, l = st.softmax_init(st.ROWS, half)
    oe, oo, m, l = lax.fori_loop(0, n_steps, body, (oe, oe, m, l))
    for lanes, o in ((pl.ds(0, half), oe), (pl.ds(half, half), oo)):
        out, lse = st.finish(o, m, l)
        st.store_partial(out, lse, o_smem, lse_smem, o_ref.at[b, h, s, :, lanes], lse_ref.at[b, h, s], c.rows_out)


def _split(s, length, c):
    """(first page, pages, steps) of split s (pallas_steps.split_pages with this launch's statics)."""
    return split_pages(s, length, block_size=c.block_size, pages_per_block=c.pages_per_block,
                       pages_per_split=c.pages_per_split, max_blocks=c.max_blocks, window=c.window)


def page_scratch(head_dim: int, block_kv: int, stages: int) -> list:
    """The SMEM both nvfp4 kernels (this one, mgpu_ragged_nvfp4's) allocate for q's lanes, Eᵀ, the
    packed slots, one unpacked step, P and the output staging: their kernels' scratch arguments
    from qe_smem to lse_smem, in order (`smem_bytes` counts them)."""
    plgpu, f16, half = require_mgpu(), jnp.float16, head_dim // 2
    return [
        st.tiled_smem((st.ROWS, half), f16), st.tiled_smem((st.ROWS, half), f16),
        st.tiled_smem((half, BOX), f16),
        plgpu.SMEM((stages, block_kv, half), jnp.uint8), plgpu.SMEM((stages, block_kv, half), jnp.uint8),
        plgpu.SMEM((stages, block_kv, BOX), jnp.uint8), plgpu.SMEM((stages, block_kv, BOX), jnp.uint8),
        st.tiled_smem((block_kv, BOX), f16), plgpu.SMEM((3, block_kv, half + RAW_PAD), f16),
        *[st.tiled_smem((block_kv, half), f16) for _ in range(4)],
        st.tiled_smem((st.ROWS, block_kv), f16, swizzle=st.swizzle_bytes(half, f16)),  # V's swizzle
        st.tiled_smem((st.ROWS, min(half, st.OUT_COLS)), jnp.float32),
        plgpu.SMEM((st.ROWS,), jnp.float32),
    ]


def smem_bytes(*, head_dim: int, block_kv: int, stages: int, table_width: int) -> int:
    """Shared memory one program of `_nvfp4_kernel` allocates."""
    half = head_dim // 2
    return (2 * st.ROWS * half * 2 + half * BOX * 2  # q's lanes, Eᵀ
            + 2 * stages * block_kv * (half + BOX)  # the packed slots, K and V
            + block_kv * BOX * 2 + 4 * block_kv * half * 2 + 3 * block_kv * (half + RAW_PAD) * 2  # one step unpacked
            + st.ROWS * block_kv * 2 + st.ROWS * min(half, st.OUT_COLS) * 4 + st.ROWS * 4 + table_width * 4 + 1024)


def check_pages(q, k_pages) -> None:
    """The nvfp4 kernel's own shape rules (module docstring); ValueError."""
    head_dim, width = q.shape[-1], k_pages.shape[-1]
    if head_dim % nvfp4.GROUP or width != nvfp4.packed_width(head_dim):
        raise ValueError(f"nvfp4 pages hold H/2 + H/16 bytes per head (H a multiple of {nvfp4.GROUP}); q's head dim "
                         f"{head_dim} does not fit the pages' {width}")
    if not 64 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} outside [64, {MAX_HEAD_DIM}]: the nvfp4 kernel needs H/2 >= 32 lanes "
                         "(swizzled wgmma rows), and above 128 one step's unpacking outgrows a block's SMEM")
    if (k_pages.shape[2] * width) % 16:
        raise ValueError(f"nvfp4 pages of {k_pages.shape[2]} kv heads × {width} bytes are no TMA tensor: K × (H/2 + "
                         "H/16) must be a multiple of 16 bytes (H × K a multiple of 256)")


def nvfp4_call(q4, k_pages, v_pages, lens, tables, logit_scales, *, c, splits: int, interpret, name: str):
    """The plgpu.kernel of `_nvfp4_kernel` for mgpu_decode's launch (q4 f16 [B, K, 64, H], its _Static
    c) → (o f32[B, K, splits, rows_out, H] with lanes interleaved, lse f32[B, K, splits, rows_out])."""
    plgpu = require_mgpu()
    batch, num_kv_heads, _, head_dim = q4.shape
    half = head_dim // 2
    pages, block_size, _, width = k_pages.shape
    scratch = [
        *page_scratch(head_dim, c.block_kv, c.stages),
        plgpu.SMEM((c.table_width,), jnp.int32),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=st.table_boxes(c.table_width)),
        plgpu.Barrier(num_arrivals=4 * c.pages_per_block, num_barriers=c.stages),
    ]
    out_shapes = (jax.ShapeDtypeStruct((batch, num_kv_heads, splits, c.rows_out, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((batch, num_kv_heads, splits, c.rows_out), jnp.float32))
    call = kernel_call(functools.partial(_nvfp4_kernel, c=c, head_dim=head_dim), out_shapes=out_shapes,
                       scratch=scratch, grid=(batch, num_kv_heads, splits), grid_names=("b", "h", "s"),
                       compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                                            lowering_semantics=plgpu.LoweringSemantics.Lane),
                       interpret=interpret, kernel_name=name)
    flat = (pages, block_size, num_kv_heads * width)  # heads side by side: a TMA tensor
    o, lse = call(lens, tables, logit_scales, q4[..., 0::2], q4[..., 1::2], expand_matrix(head_dim),
                  k_pages.reshape(flat), v_pages.reshape(flat))
    o = jnp.stack([o[..., :half], o[..., half:]], axis=-1).reshape(o.shape)  # even, odd → interleaved
    return o, lse


__all__ = ["check_pages", "expand_matrix", "nvfp4_call", "smem_bytes", "unpack"]
