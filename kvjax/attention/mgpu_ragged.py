"""Ragged paged attention (a prefill / mixed step) for MHA/GQA/MQA on Pallas Mosaic GPU.

The Mosaic GPU twin of kvjax.attention.pallas_ragged's GQA kernel (its docstring has the work
items, masks and numerics; the arguments and the result are the same), built the way JAX's
attention_mgpu builds flash attention on Hopper, over pages:

    grid (work item w, kv head h), two warpgroups: the producer copies the item's query rows
    into SMEM and keeps `stages` K/V blocks of block_kv = pages_per_block × Z positions in flight
    (TMA, one copy per page, page ids read from the block table in GMEM, a slot refilled once
    the consumer released it); the consumer runs S = Q·Kᵀ and O += P·V on the tensor cores
    (wgmma), the masks and the online softmax in registers, from the block holding the item's
    window start to the block holding its last row's position.

An item is 64 query rows (wgmma's M): q_tile = 64 / G' new tokens of one sequence times the G'
query heads of kv head h (G' the group padded to a power of two), row r = token r // G', head
r % G'. The rows are gathered into [items, K, 64, H] outside the kernel (a copy of q, not of the
cache), and the outputs scattered back, as pallas_ragged does; sinks join each row's denominator
from its logsumexp outside, and V's static scale multiplies the output. A block's V rows outside
the item's span [first row's window start, last row's position] are zeroed before P·V (0 × NaN),
as in mgpu_steps. Why one consumer warpgroup per block (FlashAttention-3 has two): with 64 rows
a block takes < 113 KiB of SMEM at block_kv = 64, so two blocks share an SM and their
warpgroups overlap each other's softmax with wgmma, without the two-consumer bookkeeping.

What it takes: bf16 / f16 queries (wgmma), pages of q's dtype or static-scale fp8 (widened to f16
in SMEM: mgpu_steps.dot_dtype), window, sinks, softcap; Z a multiple of 8, H a multiple of 16,
G' <= 64. Per-token-scale pages (int8 / fp8 per token head), nvfp4 and MLA latents stay on the
Triton kernel (kvjax.attention.mgpu_dispatch keeps them there): ValueError here.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention import mgpu_steps as st
from kvjax.attention import reference as ref
from kvjax.attention.metadata import BatchMetadata
from kvjax.attention.mgpu_decode import FP8_DTYPES, Q_DTYPES
from kvjax.attention.mgpu_interpret import compiler_params, kernel_call, require_mgpu, resolve_interpret
from kvjax.attention.pallas_decode import check_scale, merge_splits
from kvjax.attention.pallas_ragged import padded_work_items
from kvjax.attention.tiles import _SMEM_BYTES, MosaicRaggedTiles
from kvjax.core.block_pool import NULL_BLOCK
from kvjax.math_utils import cdiv, pow2_bucket


@dataclasses.dataclass(frozen=True)
class _Static:
    block_size: int
    pages_per_block: int
    stages: int
    group_shift: int  # log2 G'
    window: int | None
    softcap: float | None
    widen: bool

    @property
    def block_kv(self) -> int:
        return self.pages_per_block * self.block_size


def _ragged_kernel(
    meta_ref,  # i32[W, 4]: per item (its tokens, context length, first row's position, sequence row)
    tables_ref,  # i32[B, M']: block tables, null-padded by a block
    scale_ref,  # f32[K]: softmax scale × K's static scale
    q_ref,  # [W, K, 64, H] dot dtype: each item's rows of each kv head
    k_ref, v_ref,  # [P, Z, K, H]: pages
    o_ref,  # f32[W, K, 64, H]: normalized outputs
    lse_ref,  # f32[W, K, 64]: logsumexp per row (-inf: saw nothing)
    q_smem,  # [64, H]
    k_smem, v_smem,  # [stages, block_kv, H] page dtype
    kw_smem, vw_smem,  # [block_kv, H] f16: widened slots (fp8 pages), else unused
    p_smem,  # [64, block_kv]
    o_smem,  # f32[64, min(H, 64)]: output staging
    lse_smem,  # f32[64]
    q_bar, kv_bars, consumed_bars,
    *, c: _Static,
):
    plgpu = require_mgpu()
    w, h, wg = lax.axis_index("w"), lax.axis_index("h"), lax.axis_index("wg")
    tokens, length, first_pos, seq = meta_ref[w, 0], meta_ref[w, 1], meta_ref[w, 2], meta_ref[w, 3]
    span_lo = 0 if c.window is None else jnp.maximum(first_pos - c.window + 1, 0)  # what any row may see
    span_hi = jnp.minimum(first_pos + tokens, length)
    lo_step = lax.div(span_lo, c.block_kv)
    n_steps = jnp.where(tokens > 0, jnp.maximum(pl.cdiv(span_hi, c.block_kv) - lo_step, 0), 0)
    first_page = lo_step * c.pages_per_block
    live_pages = pl.cdiv(length, c.block_size) - first_page  # table entries past these may be garbage

    @pl.when(wg == 1)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[w, h], q_smem, q_bar)

        def issue(step, slot):
            st.issue_pages(lambda i: tables_ref[seq, first_page + i], step, live_pages, c.pages_per_block,
                           c.block_size, [(lambda page: k_ref.at[page, :, h], k_smem.at[slot], kv_bars.at[slot]),
                                          (lambda page: v_ref.at[page, :, h], v_smem.at[slot], kv_bars.at[slot])])

        for i in range(c.stages):
            pl.when(i < n_steps)(functools.partial(issue, i, i))

        @pl.loop(0, jnp.maximum(n_steps - c.stages, 0))
        def _refill(step):
            slot = lax.rem(step, c.stages)
            plgpu.barrier_wait(consumed_bars.at[slot])
            issue(step + c.stages, slot)

        @pl.loop(jnp.maximum(n_steps - c.stages, 0), n_steps)
        def _drain(step):  # observe every release (mgpu_mla)
            plgpu.barrier_wait(consumed_bars.at[lax.rem(step, c.stages)])

    @pl.when(wg == 0)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        head_dim = q_smem.shape[1]
        logit_scale = scale_ref[h] * st.LOG2E
        plgpu.barrier_wait(q_bar)
        row_pos = lax.shift_right_logical(st.positions((st.ROWS, c.block_kv), 0, 0), c.group_shift) + first_pos
        row_live = row_pos < first_pos + tokens

        def body(step, carry):
            o, m, l = carry
            slot = lax.rem(step, c.stages)
            plgpu.barrier_wait(kv_bars.at[slot])
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            if c.widen:
                kw_smem[...] = k_tile[...].astype(kw_smem.dtype)
                vw_smem[...] = v_tile[...].astype(vw_smem.dtype)
                k_tile, v_tile = kw_smem, vw_smem
                plgpu.commit_smem()
            pos0 = (lo_step + step) * c.block_kv
            logits = st.qk_logits(q_smem, k_tile, st.ROWS, c.block_kv) * logit_scale
            if c.softcap is not None:
                cap = c.softcap * st.LOG2E
                logits = cap * jnp.tanh(logits / cap)
            pos = st.positions(logits.shape, 1, pos0)
            seen = row_live & (pos <= row_pos) & (pos < length)
            if c.window is not None:
                seen = seen & (pos > row_pos - c.window)
            p, alpha, m, l = st.softmax_step(m, l, logits, seen)
            st.zero_rows_outside_span(v_tile, pos0, span_lo, span_hi)
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            o = st.rescale(o, alpha, st.pv_product(p_smem, v_tile, st.ROWS, head_dim))
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return o, m, l

        o, m, l = lax.fori_loop(0, n_steps, body, st.softmax_init(st.ROWS, head_dim))
        out, lse = st.finish(o, m, l)
        st.store_partial(out, lse, o_smem, lse_smem, o_ref.at[w, h], lse_ref.at[w, h], st.ROWS)


def smem_bytes(*, head_dim: int, page_dtype, dot_dtype, tiles: MosaicRaggedTiles, block_size: int) -> int:
    block_kv = tiles.pages_per_block * block_size
    page, qb = jnp.dtype(page_dtype).itemsize, jnp.dtype(dot_dtype).itemsize
    widened = 2 * block_kv * head_dim * qb if jnp.dtype(page_dtype) != jnp.dtype(dot_dtype) else 0
    return (st.ROWS * head_dim * qb + 2 * tiles.stages * block_kv * head_dim * page + widened + st.ROWS * block_kv * qb
            + st.ROWS * min(head_dim, 64) * 4 + st.ROWS * 4 + 2048)


@functools.partial(jax.jit, static_argnames=("group", "scale", "window", "softcap", "tiles", "interpret"))
def _mgpu_ragged(q4, k_pages, v_pages, md, logit_scale, v_scale, sinks, *, group, scale, window, softcap, tiles,
                 interpret):
    """q4 [T, K, G, H] → [T, K, G, H] in q's dtype (the module docstring's layout)."""
    plgpu = require_mgpu()
    t, kv_heads, _, head_dim = q4.shape
    block_size = k_pages.shape[1]
    gp = pow2_bucket(group)
    tq = st.ROWS // gp
    num_items = cdiv(t, tq) + md.num_seqs
    seq, first, tokens = padded_work_items(md, tq, num_items)
    meta = jnp.stack([tokens, md.context_lens[seq], md.positions[first], seq], axis=1).astype(jnp.int32)
    tables = jnp.pad(md.block_tables.astype(jnp.int32), ((0, 0), (0, tiles.pages_per_block)),
                     constant_values=NULL_BLOCK)
    idx = first[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]  # i32[W, Tq]: the items' tokens
    idx = jnp.where(jnp.arange(tq, dtype=jnp.int32)[None, :] < tokens[:, None], idx, t)  # past the end: dropped
    dot = st.dot_dtype(q4.dtype, k_pages.dtype)
    rows = jnp.pad(st.to_dot_dtype(q4, dot), ((0, 1), (0, 0), (0, gp - group), (0, 0)))[idx]  # [W, Tq, K, G', H]
    rows = rows.transpose(0, 2, 1, 3, 4).reshape(num_items, kv_heads, st.ROWS, head_dim)
    c = _Static(block_size=block_size, pages_per_block=tiles.pages_per_block, stages=tiles.stages,
                group_shift=gp.bit_length() - 1, window=window, softcap=softcap,
                widen=jnp.dtype(k_pages.dtype) != jnp.dtype(dot))
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
        plgpu.Barrier(num_arrivals=2 * tiles.pages_per_block, num_barriers=c.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
    ]
    out_shapes = (jax.ShapeDtypeStruct((num_items, kv_heads, st.ROWS, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((num_items, kv_heads, st.ROWS), jnp.float32))
    variant = ("" if window is None else f"_w{window}") + ("" if softcap is None else "_cap")
    call = kernel_call(functools.partial(_ragged_kernel, c=c), out_shapes=out_shapes, scratch=scratch,
                       grid=(num_items, kv_heads), grid_names=("w", "h"), num_threads=2, thread_name="wg",
                       compiler_params=compiler_params(approx_math=True, reduction_scratch_bytes=0),
                       interpret=interpret,
                       kernel_name=f"kvjax_mgpu_ragged_g{gp}_p{tiles.pages_per_block}_st{c.stages}{variant}")
    o, lse = call(meta, tables, (logit_scale * scale).astype(jnp.float32), rows, k_pages, v_pages)
    if sinks is not None:  # once per row, from its logsumexp (pallas_ragged)
        sinks = jnp.pad(sinks, ((0, 0), (0, gp - group)), constant_values=-jnp.inf)
        sink_rows = jnp.broadcast_to(sinks[None, :, None, :], (num_items, kv_heads, tq, gp)).reshape(
            num_items, kv_heads, 1, st.ROWS)
        o = merge_splits(o[:, :, None], lse[:, :, None], axis=2, sinks=sink_rows)
    o = o * v_scale[None, :, None, None]
    o = o.reshape(num_items, kv_heads, tq, gp, head_dim)[:, :, :, :group].transpose(0, 2, 1, 3, 4)  # [W, Tq, K, G, H]
    out = jnp.zeros((t + 1, kv_heads, group, head_dim), q4.dtype)
    return out.at[idx].set(o.astype(q4.dtype), mode="drop")[:t]


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: BatchMetadata, *,
                           scale: float, k_scale=None, v_scale=None, window: int | None = None, sinks=None,
                           softcap: float | None = None, kv_dtype: str | None = None,
                           tiles: MosaicRaggedTiles | None = None, interpret: bool | None = None) -> jax.Array:
    """kvjax.attention.pallas_ragged.ragged_paged_attention on Mosaic GPU (module docstring says what
    it takes): q [T, N, H] (bf16 / f16), pages [P, Z, K, H] → [T, N, H] in q's dtype, zero for padding
    tokens. Bad shapes or formats raise ValueError (KvjaxError)."""
    ref._check("q", q, 3, "[T, N, H]")
    ref._check_pages(q, k_pages, v_pages, kv_dtype)
    window, sinks, softcap = ref.check_variant(q.shape[1], window, sinks, softcap)
    kind = ref.scale_kind(k_pages, k_scale, kv_dtype)
    if kind not in ("none", "static"):
        raise ValueError(f"the Mosaic GPU ragged kernel reads unscaled and static-scale pages; {kv_dtype} pages "
                         "need the Triton kernel (kvjax.attention.pallas_ragged)")
    t, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    if jnp.dtype(q.dtype) not in Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} unsupported by the Mosaic GPU kernel (wgmma has no exact f32 product); "
                         "use bf16 / f16 queries or the Triton kernel")
    if jnp.dtype(k_pages.dtype) not in (jnp.dtype(q.dtype), *FP8_DTYPES):
        raise ValueError(f"k_pages dtype {k_pages.dtype} unsupported with {q.dtype} queries")
    if block_size % 8 or head_dim % 16 or pow2_bucket(group) > st.ROWS:
        raise ValueError(f"the Mosaic GPU ragged kernel needs Z % 8 == 0, H % 16 == 0 and a group of <= {st.ROWS} "
                         f"heads; got Z={block_size}, H={head_dim}, group {group}")
    tiles = tiles or MosaicRaggedTiles.default(block_size)
    tiles.check(block_size=block_size)
    dot = st.dot_dtype(q.dtype, k_pages.dtype)
    need = smem_bytes(head_dim=head_dim, page_dtype=k_pages.dtype, dot_dtype=dot, tiles=tiles, block_size=block_size)
    if need > _SMEM_BYTES:
        raise ValueError(f"MosaicRaggedTiles {tiles} need {need} bytes of shared memory (> {_SMEM_BYTES})")
    k_scale = check_scale("k_scale", k_scale, kv_heads, "per kv head")
    v_scale = check_scale("v_scale", v_scale, kv_heads, "per kv head")
    out = _mgpu_ragged(q.reshape(t, kv_heads, group, head_dim), k_pages, v_pages, md, k_scale, v_scale,
                       None if sinks is None else sinks.reshape(kv_heads, group), group=group, scale=float(scale),
                       window=window, softcap=softcap, tiles=tiles, interpret=resolve_interpret(interpret))
    return out.reshape(t, heads, head_dim)
