"""The Mosaic GPU ragged paged-attention kernel on nvfp4 pages (kvjax.attention.mgpu_ragged's, split out).

nvfp4 pages are uint8 [P, Z, K, H/2 + H/16] (kvjax.quant.nvfp4: E2M1 values two per byte, then one
e4m3 block scale per 16 values; vLLM's layout). The kernel is mgpu_ragged's — grid (work item w,
kv head h), a producer warpgroup keeping `stages` kv blocks in flight by TMA, a consumer
warpgroup running both products on wgmma with the masks and the online softmax in registers, the
work items' rows gathered and scattered outside (mgpu_steps.work_items, item_rows,
scatter_rows) — with the pages read as kvjax.attention.mgpu_nvfp4's decode kernel reads them
(its docstring says why each piece is so):

- **Two TMA boxes per page and head** from the [P, Z, K·W] view of the pages (W = H/2 + H/16
  bytes a head; K·W a multiple of 16): the values [Z, H/2] from column h·W and the head's last
  16 bytes [Z, 16], whose last H/16 are the block scales. Four copies per page (K and V), one
  arrival each on the slot's barrier.
- **Unpacked by the consumer, step by step** (mgpu_nvfp4.unpack): the nibbles decoded into even
  and odd lanes through padded, untiled f16 SMEM, the block scales broadcast along their 16
  values by a wgmma with the constant 0/1 matrix Eᵀ, giving exact f16 tiles (an E2M1 value times
  an e4m3 scale has 6 significant bits). q comes in as its even and odd lanes in f16 (the dot
  dtype of exact f16 tiles: mgpu_steps.dot_dtype): S = Q_even·K_evenᵀ + Q_odd·K_oddᵀ, and P·V as
  two halves, even lanes then odd, interleaved outside.
- **Unread slots stay out**: their logits are masked by a select, and V's two unpacked halves
  are zeroed outside the item's span before P·V (a slot nobody may read decodes to NaN in the
  tests: the byte 0x7F is a NaN block scale).

The per-tensor scale of each kv head folds into the logits (K) and the output (V), as a static
scale does. The kernel pins Mosaic GPU's Lane lowering semantics, as mgpu_nvfp4's does (its
layouts are explicit). Shapes (mgpu_ragged.check_shapes): H of 64 to 128, a multiple of 16;
K·W a multiple of 16 bytes; Z a multiple of 8; G' <= 64; tiles as mgpu_ragged's, SMEM as
mgpu_nvfp4.smem_bytes counts it (its table slice aside).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention import mgpu_steps as st
from kvjax.attention.mgpu_interpret import kernel_call, require_mgpu
from kvjax.attention.mgpu_nvfp4 import BOX, expand_matrix, page_scratch, unpack
from kvjax.quant import nvfp4


def _kernel(
    meta_ref,  # i32[W, 4]: per item (its tokens, context length, first row's position, sequence row)
    tables_ref,  # i32[B, M']: block tables, null-padded by a block
    scale_ref,  # f32[K]: softmax scale × K's per-tensor scale, per kv head
    qe_ref, qo_ref,  # f16[W, K, 64, H/2]: each item's rows of each kv head, even and odd lanes
    et_ref,  # f16[H/2, 16]: Eᵀ (mgpu_nvfp4.expand_matrix)
    k_ref, v_ref,  # uint8 [P, Z, K·W]: the packed pages, heads side by side
    o_ref,  # f32[W, K, 64, H]: normalized outputs, even lanes then odd
    lse_ref,  # f32[W, K, 64]: logsumexp per row (-inf: saw nothing)
    qe_smem, qo_smem,  # f16[64, H/2]
    et_smem,  # f16[H/2, 16]
    kd_smem, vd_smem,  # uint8 [stages, block_kv, H/2]: packed values
    kb_smem, vb_smem,  # uint8 [stages, block_kv, 16]: each head's last 16 bytes (scales at the end)
    sc_smem,  # f16[block_kv, 16]: decoded scale boxes
    raw_smem,  # f16[3, block_kv, H/2 + RAW_PAD]: unscaled even and odd values, decoded scale boxes; untiled
    ke_smem, ko_smem, ve_smem, vo_smem,  # f16[block_kv, H/2]: the unpacked step
    p_smem,  # f16[64, block_kv]
    o_smem,  # f32[64, min(H/2, 128)]: output staging
    lse_smem,  # f32[64]
    q_bar, kv_bars, consumed_bars,
    *, c, head_dim: int,
):
    plgpu = require_mgpu()
    w, h, wg = lax.axis_index("w"), lax.axis_index("h"), lax.axis_index("wg")
    half, groups, width = head_dim // 2, head_dim // nvfp4.GROUP, nvfp4.packed_width(head_dim)
    item = st.item_of(meta_ref, w, c)
    values, box = pl.ds(h * width, half), pl.ds(h * width + width - BOX, BOX)

    @pl.when(wg == 1)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        for src, dst in ((qe_ref.at[w, h], qe_smem), (qo_ref.at[w, h], qo_smem), (et_ref, et_smem)):
            plgpu.copy_gmem_to_smem(src, dst, q_bar)

        def issue(step, slot):
            st.issue_pages(lambda i: tables_ref[item.seq, item.first_page + i], step, item.live_pages,
                           c.pages_per_block, c.block_size, [
                (lambda page: k_ref.at[page, :, values], kd_smem.at[slot], kv_bars.at[slot]),
                (lambda page: k_ref.at[page, :, box], kb_smem.at[slot], kv_bars.at[slot]),
                (lambda page: v_ref.at[page, :, values], vd_smem.at[slot], kv_bars.at[slot]),
                (lambda page: v_ref.at[page, :, box], vb_smem.at[slot], kv_bars.at[slot])])

        st.produce(item.n_steps, c.stages, issue, consumed_bars)

    @pl.when(wg == 0)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        logit_scale = scale_ref[h] * st.LOG2E
        plgpu.barrier_wait(q_bar)
        row_pos = st.row_positions(item, c)

        def body(step, carry):
            oe, oo, m, l = carry
            slot = lax.rem(step, c.stages)
            plgpu.barrier_wait(kv_bars.at[slot])
            unpack(kd_smem.at[slot], kb_smem.at[slot], sc_smem, raw_smem, et_smem, ke_smem, ko_smem, groups)
            plgpu.commit_smem()  # a barrier: every warp's reads of raw_smem done before V's unpack rewrites it
            unpack(vd_smem.at[slot], vb_smem.at[slot], sc_smem, raw_smem, et_smem, ve_smem, vo_smem, groups)
            plgpu.commit_smem()
            plgpu.barrier_arrive(consumed_bars.at[slot])  # the slot is read: refilled while the products run
            pos0 = (item.lo_step + step) * c.block_kv
            logits = (st.qk_logits(qe_smem, ke_smem, st.ROWS, c.block_kv)
                      + st.qk_logits(qo_smem, ko_smem, st.ROWS, c.block_kv)) * logit_scale
            logits = st.softcapped(logits, c.softcap)
            ok = st.seen(item, c, row_pos, st.positions(logits.shape, 1, pos0))
            p, alpha, m, l = st.softmax_step(m, l, logits, ok)
            st.zero_rows_outside_span(ve_smem, pos0, item.span_lo, item.span_hi)
            st.zero_rows_outside_span(vo_smem, pos0, item.span_lo, item.span_hi)
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            oe = st.rescale(oe, alpha, st.pv_product(p_smem, ve_smem, st.ROWS, half))
            oo = st.rescale(oo, alpha, st.pv_product(p_smem, vo_smem, st.ROWS, half))
            return oe, oo, m, l

        oe, m, l = st.softmax_init(st.ROWS, half)
        oe, oo, m, l = lax.fori_loop(0, item.n_steps, body, (oe, oe, m, l))
        for lanes, o in ((pl.ds(0, half), oe), (pl.ds(half, half), oo)):
            out, lse = st.finish(o, m, l)
            st.store_partial(out, lse, o_smem, lse_smem, o_ref.at[w, h, :, lanes], lse_ref.at[w, h], st.ROWS)


@functools.partial(jax.jit, static_argnames=("group", "scale", "window", "softcap", "tiles", "interpret"))
def mgpu_ragged_nvfp4(q4, k_pages, v_pages, md, logit_scale, v_scale, sinks, *, group, scale, window, softcap, tiles,
                      interpret):
    """q4 [T, K, G, H] (bf16 / f16), nvfp4 pages uint8 [P, Z, K, H/2 + H/16] → [T, K, G, H] in q's
    dtype; logit_scale, v_scale f32[K]: the per-tensor scales; sinks f32[K, G] or None. Shapes as
    mgpu_ragged.check_shapes has checked them."""
    plgpu = require_mgpu()
    t, kv_heads, _, head_dim = q4.shape
    pages, block_size, _, width = k_pages.shape
    half, f16 = head_dim // 2, jnp.float16
    items = st.work_items(md, t, group, tiles.pages_per_block)
    rows = st.item_rows(st.to_dot_dtype(q4, f16), items)  # f16[W, K, 64, H]: meets the exact f16 tiles
    c = st.RaggedStatic(block_size=block_size, pages_per_block=tiles.pages_per_block, stages=tiles.stages,
                   group_shift=items.gp.bit_length() - 1, window=window, softcap=softcap, widen=True)
    scratch = [
        *page_scratch(head_dim, c.block_kv, c.stages),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=4 * tiles.pages_per_block, num_barriers=c.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
    ]
    num_items = items.idx.shape[0]
    out_shapes = (jax.ShapeDtypeStruct((num_items, kv_heads, st.ROWS, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((num_items, kv_heads, st.ROWS), jnp.float32))
    variant = ("" if window is None else f"_w{window}") + ("" if softcap is None else "_cap")
    call = kernel_call(functools.partial(_kernel, c=c, head_dim=head_dim), out_shapes=out_shapes, scratch=scratch,
                       grid=(num_items, kv_heads), grid_names=("w", "h"), num_threads=2, thread_name="wg",
                       compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                                            lowering_semantics=plgpu.LoweringSemantics.Lane),
                       interpret=interpret, kernel_name=f"kvjax_mgpu_ragged_nvfp4_g{items.gp}"
                                                        f"_p{tiles.pages_per_block}_st{c.stages}{variant}")
    flat = (pages, block_size, kv_heads * width)  # heads side by side: a TMA tensor
    o, lse = call(items.meta, items.tables, (logit_scale * scale).astype(jnp.float32), rows[..., 0::2],
                  rows[..., 1::2], expand_matrix(head_dim), k_pages.reshape(flat), v_pages.reshape(flat))
    o = jnp.stack([o[..., :half], o[..., half:]], axis=-1).reshape(o.shape)  # even, odd → interleaved
    return st.scatter_rows(o, lse, items, sinks=sinks, v_scale=v_scale, group=group, t=t, dtype=q4.dtype)


__all__ = ["mgpu_ragged_nvfp4"]
