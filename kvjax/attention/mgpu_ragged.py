"""Ragged paged attention (a prefill / mixed step) for MHA/GQA/MQA on Pallas Mosaic GPU.

The Mosaic GPU twin of kvjax.attention.pallas_ragged's GQA kernel (its docstring has the work
items, masks and numerics; the arguments and the result are the same), built the way JAX's
attention_mgpu builds flash attention on Hopper, over pages:

    grid (work item w, kv head h), two warpgroups: the producer copies the item's query rows
    into SMEM and keeps `stages` K/V blocks of block_kv = pages_per_block × Z positions in flight
    (TMA, one copy per page, page ids read from the block table in GMEM, a slot refilled once
    the consumer released it); the consumer runs S = Q·Kᵀ and O += P·V on the tensor cores
    (wgmma), the masks and the online softmax in registers, from the block holding the item's
    window start to the block holding its last row's position. A slot the consumer widens
    (fp8, per-token, nvfp4 pages) goes back to the producer once widened, so its refill
    overlaps the products; a slot the products read in place goes back after P·V.

An item is 64 query rows (wgmma's M): q_tile = 64 / G' new tokens of one sequence times the G'
query heads of kv head h (G' the group padded to a power of two), row r = token r // G', head
r % G'. The rows are gathered into [items, K, 64, H] outside the kernel (a copy of q, not of the
cache), and the outputs scattered back, as pallas_ragged does; sinks join each row's denominator
from its logsumexp outside, and V's static scale multiplies the output. A block's V rows outside
the item's span [first row's window start, last row's position] are zeroed before P·V (0 × NaN),
as in mgpu_steps. Why one consumer warpgroup per block (FlashAttention-3 has two): with 64 rows
a block takes < 113 KiB of SMEM at block_kv = 64, so two blocks share an SM and their
warpgroups overlap each other's softmax with wgmma, without the two-consumer bookkeeping.

What it takes: bf16 / f16 queries (wgmma); pages of q's dtype or static-scale fp8 (widened to f16
in SMEM: mgpu_steps.dot_dtype); per-token-head pages (int8_per_token_head, fp8_per_token_head:
int8 / e4m3 with f32 [P, Z, K] scale pages as k_scale / v_scale), read as mgpu_decode reads
them: each page's scales of every kv head come in as one [Z, K] TMA box beside it (K a multiple
of 8: the box's columns fill WGMMA's 8-column tiles) and the widening multiplies each row by its
token's scale (mgpu_steps.scale_rows), rounding once to q's dtype, the dots' dtype then; nvfp4
pages (uint8 [P, Z, K, H/2 + H/16], H of 64 to 128) go to kvjax.attention.mgpu_ragged_nvfp4, this
kernel with the pages unpacked as mgpu_nvfp4 unpacks them. Window, sinks, softcap with every
format; Z a multiple of 8, H a multiple of 16, G' <= 64 (`check_shapes`, which
kvjax.attention.mgpu_dispatch asks too). MLA latents have their own kernel (mgpu_ragged_mla).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention import mgpu_nvfp4
from kvjax.attention import mgpu_steps as st
from kvjax.attention import reference as ref
from kvjax.attention.metadata import BatchMetadata
from kvjax.attention.mgpu_decode import FP8_DTYPES, Q_DTYPES
from kvjax.attention.mgpu_interpret import compiler_params, kernel_call, require_mgpu, resolve_interpret
from kvjax.attention.mgpu_ragged_nvfp4 import mgpu_ragged_nvfp4
from kvjax.attention.pallas_decode import check_scale, check_token_scales
from kvjax.attention.tiles import _SMEM_BYTES, MosaicRaggedTiles
from kvjax.math_utils import pow2_bucket
from kvjax.quant.kv_formats import kv_format


# ----------------------------------------------------------------------------------- the kernel

def _ragged_kernel(
    meta_ref,  # i32[W, 4]: per item (its tokens, context length, first row's position, sequence row)
    tables_ref,  # i32[B, M']: block tables, null-padded by a block
    scale_ref,  # f32[K]: softmax scale × K's static scale
    q_ref,  # [W, K, 64, H] dot dtype: each item's rows of each kv head
    k_ref, v_ref,  # [P, Z, K, H]: pages
    *refs,  # per-token scales: ks_ref, vs_ref f32[P, Z, K]; then the outputs and scratch below
    c: st.RaggedStatic,
):
    if c.per_token:
        ks_ref, vs_ref, *refs = refs
    (o_ref,  # f32[W, K, 64, H]: normalized outputs
     lse_ref,  # f32[W, K, 64]: logsumexp per row (-inf: saw nothing)
     q_smem,  # [64, H]
     k_smem, v_smem,  # [stages, block_kv, H] page dtype
     kw_smem, vw_smem,  # [block_kv, H] dot dtype: widened slots (fp8 / per-token pages), else unused
     p_smem,  # [64, block_kv]
     o_smem,  # f32[64, min(H, 64)]: output staging
     lse_smem,  # f32[64]
     q_bar, kv_bars, consumed_bars,
     *token_smem) = refs  # per-token: ks_smem, vs_smem f32[stages, block_kv, K], every head's scales
    plgpu = require_mgpu()
    w, h, wg = lax.axis_index("w"), lax.axis_index("h"), lax.axis_index("wg")
    item = st.item_of(meta_ref, w, c)

    @pl.when(wg == 1)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[w, h], q_smem, q_bar)

        def issue(step, slot):
            copies = [(lambda page: k_ref.at[page, :, h], k_smem.at[slot], kv_bars.at[slot]),
                      (lambda page: v_ref.at[page, :, h], v_smem.at[slot], kv_bars.at[slot])]
            if c.per_token:  # [Z, K] boxes: a [Z] column of one head is no TMA box (its stride is not 1)
                copies += [(lambda page: ks_ref.at[page], token_smem[0].at[slot], kv_bars.at[slot]),
                           (lambda page: vs_ref.at[page], token_smem[1].at[slot], kv_bars.at[slot])]
            st.issue_pages(lambda i: tables_ref[item.seq, item.first_page + i], step, item.live_pages,
                           c.pages_per_block, c.block_size, copies)

        st.produce(item.n_steps, c.stages, issue, consumed_bars)

    @pl.when(wg == 0)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        head_dim = q_smem.shape[1]
        logit_scale = scale_ref[h] * st.LOG2E
        plgpu.barrier_wait(q_bar)
        row_pos = st.row_positions(item, c)

        def body(step, carry):
            o, m, l = carry
            slot = lax.rem(step, c.stages)
            plgpu.barrier_wait(kv_bars.at[slot])
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            if c.per_token:  # int8 / e4m3 × this token's scale, rounded once to the dot dtype
                kw_smem[...] = st.scale_rows(k_tile, token_smem[0].at[slot], h).astype(kw_smem.dtype)
                vw_smem[...] = st.scale_rows(v_tile, token_smem[1].at[slot], h).astype(vw_smem.dtype)
            elif c.widen:  # fp8 → f16: exact
                kw_smem[...] = k_tile[...].astype(kw_smem.dtype)
                vw_smem[...] = v_tile[...].astype(vw_smem.dtype)
            if c.widen:  # the slot is read: the producer refills it while the products run
                k_tile, v_tile = kw_smem, vw_smem
                plgpu.commit_smem()
                plgpu.barrier_arrive(consumed_bars.at[slot])
            pos0 = (item.lo_step + step) * c.block_kv
            logits = st.softcapped(st.qk_logits(q_smem, k_tile, st.ROWS, c.block_kv) * logit_scale, c.softcap)
            ok = st.seen(item, c, row_pos, st.positions(logits.shape, 1, pos0))
            p, alpha, m, l = st.softmax_step(m, l, logits, ok)
            st.zero_rows_outside_span(v_tile, pos0, item.span_lo, item.span_hi)
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            o = st.rescale(o, alpha, st.pv_product(p_smem, v_tile, st.ROWS, head_dim))
            if not c.widen:  # the products read the slot itself
                plgpu.barrier_arrive(consumed_bars.at[slot])
            return o, m, l

        o, m, l = lax.fori_loop(0, item.n_steps, body, st.softmax_init(st.ROWS, head_dim))
        out, lse = st.finish(o, m, l)
        st.store_partial(out, lse, o_smem, lse_smem, o_ref.at[w, h], lse_ref.at[w, h], st.ROWS)


def smem_bytes(*, head_dim: int, page_dtype, dot_dtype, tiles: MosaicRaggedTiles, block_size: int,
               token_scale_heads: int = 0) -> int:
    """Shared memory one block of `_ragged_kernel` allocates (token_scale_heads: K with per-token scales, else 0)."""
    block_kv = tiles.pages_per_block * block_size
    page, qb = jnp.dtype(page_dtype).itemsize, jnp.dtype(dot_dtype).itemsize
    widened = 2 * block_kv * head_dim * qb if jnp.dtype(page_dtype) != jnp.dtype(dot_dtype) else 0
    return (st.ROWS * head_dim * qb + 2 * tiles.stages * block_kv * head_dim * page + widened + st.ROWS * block_kv * qb
            + st.ROWS * min(head_dim, 64) * 4 + st.ROWS * 4 + 2 * tiles.stages * block_kv * token_scale_heads * 4
            + 2048)


@functools.partial(jax.jit, static_argnames=("group", "scale", "window", "softcap", "tiles", "interpret"))
def _mgpu_ragged(q4, k_pages, v_pages, token_scales, md, logit_scale, v_scale, sinks, *, group, scale, window,
                 softcap, tiles, interpret):
    """q4 [T, K, G, H] → [T, K, G, H] in q's dtype (the module docstring's layout); token_scales: None
    or the per-token (K, V) f32[P, Z, K] scale pages."""
    plgpu = require_mgpu()
    t, kv_heads, _, head_dim = q4.shape
    block_size = k_pages.shape[1]
    items = st.work_items(md, t, group, tiles.pages_per_block)
    per_token = token_scales is not None
    # Per-token pages are scaled while widening, so the products see no exact page values: q's dtype.
    dot = jnp.dtype(q4.dtype) if per_token else st.dot_dtype(q4.dtype, k_pages.dtype)
    rows = st.item_rows(st.to_dot_dtype(q4, dot), items)
    c = st.RaggedStatic(block_size=block_size, pages_per_block=tiles.pages_per_block, stages=tiles.stages,
                group_shift=items.gp.bit_length() - 1, window=window, softcap=softcap,
                widen=jnp.dtype(k_pages.dtype) != dot, per_token=per_token)
    scratch = [
        st.tiled_smem((st.ROWS, head_dim), dot),
        st.tiled_smem((c.stages, c.block_kv, head_dim), k_pages.dtype),
        st.tiled_smem((c.stages, c.block_kv, head_dim), k_pages.dtype),
        st.tiled_smem((c.block_kv if c.widen else 8, head_dim), dot),
        st.tiled_smem((c.block_kv if c.widen else 8, head_dim), dot),
        st.tiled_smem((st.ROWS, c.block_kv), dot, swizzle=st.swizzle_bytes(head_dim, dot)),
        st.tiled_smem((st.ROWS, min(head_dim, 64)), jnp.float32),
        plgpu.SMEM((st.ROWS,), jnp.float32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=(4 if per_token else 2) * tiles.pages_per_block, num_barriers=c.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
    ]
    if per_token:  # every head's scales of a step: [block_kv, K] f32 (K a multiple of 8: WGMMA columns)
        scratch += [st.tiled_smem((c.stages, c.block_kv, kv_heads), jnp.float32) for _ in range(2)]
    num_items = items.idx.shape[0]
    out_shapes = (jax.ShapeDtypeStruct((num_items, kv_heads, st.ROWS, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((num_items, kv_heads, st.ROWS), jnp.float32))
    variant = ("" if window is None else f"_w{window}") + ("" if softcap is None else "_cap")
    call = kernel_call(functools.partial(_ragged_kernel, c=c), out_shapes=out_shapes, scratch=scratch,
                       grid=(num_items, kv_heads), grid_names=("w", "h"), num_threads=2, thread_name="wg",
                       compiler_params=compiler_params(approx_math=True, reduction_scratch_bytes=0),
                       interpret=interpret, kernel_name=f"kvjax_mgpu_ragged_g{items.gp}_p{tiles.pages_per_block}"
                                                        f"_st{c.stages}{'_tok' if per_token else ''}{variant}")
    o, lse = call(items.meta, items.tables, (logit_scale * scale).astype(jnp.float32), rows, k_pages, v_pages,
                  *(token_scales or ()))
    return st.scatter_rows(o, lse, items, sinks=sinks, v_scale=v_scale, group=group, t=t, dtype=q4.dtype)


# ----------------------------------------------------------------------- validation, public API

def check_shapes(q_dtype, page_dtype, *, head_dim: int, block_size: int, num_kv_heads: int, group: int,
                 kv_dtype: str | None = None, tiles: MosaicRaggedTiles | None = None) -> MosaicRaggedTiles:
    """The rules of the Mosaic GPU ragged kernels for pages of this format (module docstring) →
    the tiles (None: the default) checked; ValueError naming the value that breaks one.
    kvjax.attention.mgpu_dispatch.eligible asks this too, so the two cannot disagree."""
    fmt = None if kv_dtype is None else kv_format(kv_dtype)
    kind = "none" if fmt is None else fmt.scale
    if jnp.dtype(q_dtype) not in Q_DTYPES:
        raise ValueError(f"q dtype {jnp.dtype(q_dtype).name} unsupported by the Mosaic GPU kernel (wgmma has no exact "
                         "f32 product); use bf16 / f16 queries or the Triton kernel")
    if kind not in ("none", "static", "per_token", "per_block"):
        raise ValueError(f"{kv_dtype} pages ({kind} scales) are not read by the Mosaic GPU ragged kernels")
    if fmt is not None and jnp.dtype(page_dtype) != jnp.dtype(fmt.dtype):
        raise ValueError(f"{fmt.name} pages are {jnp.dtype(fmt.dtype).name}, got {jnp.dtype(page_dtype).name}")
    if kind == "per_block":  # nvfp4: mgpu_nvfp4's rules (a TMA view of [P, Z, K·W], H in [64, 128])
        width = head_dim // 2 + head_dim // 16
        mgpu_nvfp4.check_pages(jax.ShapeDtypeStruct((head_dim,), q_dtype),
                               jax.ShapeDtypeStruct((1, block_size, num_kv_heads, width), page_dtype))
    elif kind == "per_token" and num_kv_heads % 8:
        raise ValueError(f"per-token scales of {num_kv_heads} kv heads: the Mosaic GPU kernel reads a page's scales "
                         "of every head as one [Z, K] box into WGMMA columns, so K must be a multiple of 8")
    elif kind in ("none", "static") and jnp.dtype(page_dtype) not in (jnp.dtype(q_dtype), *FP8_DTYPES):
        raise ValueError(f"k_pages dtype {jnp.dtype(page_dtype).name} unsupported with {jnp.dtype(q_dtype).name} "
                         "queries; use pages of q's dtype, float8_e4m3fn or float8_e5m2")
    if block_size % 8 or head_dim % 16 or pow2_bucket(group) > st.ROWS:
        raise ValueError(f"the Mosaic GPU ragged kernel needs Z % 8 == 0, H % 16 == 0 and a group of <= {st.ROWS} "
                         f"heads; got Z={block_size}, H={head_dim}, group {group}")
    tiles = tiles or MosaicRaggedTiles.default(block_size)
    tiles.check(block_size=block_size)
    block_kv = tiles.pages_per_block * block_size
    if kind == "per_block":
        need = mgpu_nvfp4.smem_bytes(head_dim=head_dim, block_kv=block_kv, stages=tiles.stages, table_width=0)
    else:
        dot = jnp.dtype(q_dtype) if kind == "per_token" else st.dot_dtype(q_dtype, page_dtype)
        need = smem_bytes(head_dim=head_dim, page_dtype=page_dtype, dot_dtype=dot, tiles=tiles, block_size=block_size,
                          token_scale_heads=num_kv_heads if kind == "per_token" else 0)
    if need > _SMEM_BYTES:
        raise ValueError(f"MosaicRaggedTiles {tiles} need {need} bytes of shared memory (> {_SMEM_BYTES})")
    return tiles


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: BatchMetadata, *,
                           scale: float, k_scale=None, v_scale=None, window: int | None = None, sinks=None,
                           softcap: float | None = None, kv_dtype: str | None = None,
                           tiles: MosaicRaggedTiles | None = None, interpret: bool | None = None) -> jax.Array:
    """kvjax.attention.pallas_ragged.ragged_paged_attention on Mosaic GPU (module docstring says what
    it takes): q [T, N, H] (bf16 / f16), pages [P, Z, K, H] (nvfp4: uint8 [P, Z, K, H/2 + H/16]) of
    the format kv_dtype; k_scale, v_scale: None, a scalar or f32[K] static scales (per-token
    formats: f32[P, Z, K] scale pages) → [T, N, H] in q's dtype, zero for padding tokens. Bad
    shapes or formats raise ValueError (KvjaxError)."""
    ref._check("q", q, 3, "[T, N, H]")
    ref._check_pages(q, k_pages, v_pages, kv_dtype)
    window, sinks, softcap = ref.check_variant(q.shape[1], window, sinks, softcap)
    kind = ref.scale_kind(k_pages, k_scale, kv_dtype)
    t, heads, head_dim = q.shape
    pages, block_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    tiles = check_shapes(q.dtype, k_pages.dtype, head_dim=head_dim, block_size=block_size, num_kv_heads=kv_heads,
                         group=group, kv_dtype=kv_dtype, tiles=tiles)
    token_scales = None
    if kind == "per_token":  # f32[P, Z, K] each, read in the kernel; no static scale
        token_scales = tuple(check_token_scales(name, x, (pages, block_size, kv_heads))
                             for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
        k_scale = v_scale = None
    k_scale = check_scale("k_scale", k_scale, kv_heads, "per kv head")
    v_scale = check_scale("v_scale", v_scale, kv_heads, "per kv head")
    q4 = q.reshape(t, kv_heads, group, head_dim)
    sinks = None if sinks is None else sinks.reshape(kv_heads, group)
    kw = dict(group=group, scale=float(scale), window=window, softcap=softcap, tiles=tiles,
              interpret=resolve_interpret(interpret))
    if kind == "per_block":
        out = mgpu_ragged_nvfp4(q4, k_pages, v_pages, md, k_scale, v_scale, sinks, **kw)
    else:
        out = _mgpu_ragged(q4, k_pages, v_pages, token_scales, md, k_scale, v_scale, sinks, **kw)
    return out.reshape(t, heads, head_dim)
