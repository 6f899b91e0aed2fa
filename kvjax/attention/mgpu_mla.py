"""Absorbed-MLA paged decode (DeepSeek-V2/V3) on Pallas Mosaic GPU, with split-K.

The Mosaic GPU twin of kvjax.attention.pallas_mla (its docstring has the absorbed form: every
head attends to one latent "kv head" whose key is the whole latent [c_kv, k_rope], C lanes, and
whose value is c_kv, kv_lora_rank lanes). One program owns a tile of 64 heads (wgmma's M; N < 64
heads are padded with zero queries), one sequence and one split, and is three warpgroups, the
split FlashMLA uses on Hopper and JAX's attention_mgpu uses for flash attention:

    memory warpgroup   copies the query tile into SMEM, then keeps `stages` latent tiles
                       [block_kv, C] in flight (TMA, one copy per page, the page ids read from
                       the block table in GMEM), refilling a slot once both compute warpgroups
                       have released it;
    compute warpgroup 0  S = Q·Lᵀ over all C lanes (wgmma), the online softmax, P into SMEM and
                       each row's rescale factor beside it, then O[:, :rank/2] += P·c_kv;
    compute warpgroup 1  O[:, rank/2:] += P·c_kv with warpgroup 0's P and factors.

Why two compute warpgroups: the f32 accumulator of 64 heads × 512 lanes is 256 registers per
thread of one warpgroup, more than a thread has; halved, it is 128 each. Warpgroup 0 publishes P
and the factors on a barrier (p_ready) and waits for warpgroup 1 to be done with them (p_done)
before it overwrites them the next step. SMEM (bf16, DeepSeek's C = 576, 64 tokens a step):
query 72 KiB + 2 latent slots 144 KiB + P 8 KiB: two stages is what fits, so block_kv = 64.
Each compute warpgroup writes its half of the f32 output straight from registers to GMEM (no
SMEM is left for staging), all 64 rows; the caller keeps the first N.

Numerics are pallas_mla's: q × latent_scale (per channel) rounded once to q's dtype outside the
kernel, the f32 output × latent_scale[:rank] after the split merge, the softmax scale on the f32
logits in the kernel, fp8 latents widened to f16 in SMEM (by warpgroup 0, before S; the query is
then f16 too: mgpu_steps.dot_dtype), and a
step's latent rows outside the sequence zeroed before P·V (mgpu_steps). bf16 / f16 queries only
(wgmma); the latent width C and kv_lora_rank multiples of 64, Z a multiple of 8.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention import mgpu_steps as st
from kvjax.attention.mgpu_decode import FP8_DTYPES, Q_DTYPES
from kvjax.attention.mgpu_interpret import compiler_params, kernel_call, require_mgpu, resolve_interpret
from kvjax.attention.pallas_decode import check_scale, check_tables, merge_splits
from kvjax.attention.pallas_steps import split_pages
from kvjax.attention.reference import mla_paged_decode_reference  # noqa: F401  the kernel's plain jnp twin
from kvjax.attention.tiles import _SMEM_BYTES, MosaicDecodeTiles, default_mosaic_tiles, fit_smem
from kvjax.core.block_pool import NULL_BLOCK
from kvjax.math_utils import cdiv


@dataclasses.dataclass(frozen=True)
class _Static:
    block_size: int
    pages_per_block: int
    pages_per_split: int
    max_blocks: int
    stages: int
    rank: int  # kv_lora_rank: the value lanes
    sm_scale: float
    widen: bool

    @property
    def block_kv(self) -> int:
        return self.pages_per_block * self.block_size


def _mla_kernel(
    lens_ref,  # i32[B]
    tables_ref,  # i32[B, M']: null-padded past every split's slice
    q_ref,  # [B, T, 64, C]: each head tile's queries [q_latent × s, q_rope × s] (zero rows past N), dot dtype
    lat_ref,  # [P, Z, C]: latent pages
    o_ref,  # f32[B, T, splits, 64, rank]: each split's normalized output
    lse_ref,  # f32[B, T, splits, 64]: each split's logsumexp
    q_smem,  # [64, C] dot dtype (mgpu_steps.dot_dtype)
    lat_smem,  # [stages, block_kv, C] page dtype
    w_smem,  # [block_kv, C] f16: the widened slot (fp8 pages), else unused
    p_smem,  # [64, block_kv] dot dtype: P, from warpgroup 0 for both
    rows_smem,  # f32[2, 64]: each row's rescale factor (alpha), then its final sum; the logsumexp
    q_bar, kv_bars, consumed_bars, p_ready, p_done, final_bar,
    *, c: _Static,
):
    plgpu = require_mgpu()
    b, t, s, wg = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("s"), lax.axis_index("wg")
    length = lens_ref[b]
    first_page, n_pages, n_steps = split_pages(s, length, block_size=c.block_size, pages_per_block=c.pages_per_block,
                                               pages_per_split=c.pages_per_split, max_blocks=c.max_blocks)
    half = c.rank // 2
    row_smem, lse_smem = rows_smem.at[0], rows_smem.at[1]

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[b, t], q_smem, q_bar)

        def issue(step, slot):  # page ids straight from GMEM: this warpgroup only waits, `stages` steps ahead
            st.issue_pages(lambda i: tables_ref[b, first_page + i], step, n_pages, c.pages_per_block, c.block_size,
                           [(lambda page: lat_ref.at[page], lat_smem.at[slot], kv_bars.at[slot])])

        st.produce(n_steps, c.stages, issue, consumed_bars)  # a slot is released once both compute warpgroups are done

    def tile_of(step):
        """The step's latent tile in q's dtype, after its barrier (and warpgroup 0's widening)."""
        slot = lax.rem(step, c.stages)
        plgpu.barrier_wait(kv_bars.at[slot])
        return slot, (w_smem if c.widen else lat_smem.at[slot])

    @pl.when(wg == 0)
    def _softmax_and_first_half():
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(q_bar)

        def body(step, carry):
            o, m, l = carry
            slot, tile = tile_of(step)
            pl.when(step > 0)(lambda: plgpu.barrier_wait(p_done))  # warpgroup 1 is done with step - 1
            if c.widen:  # fp8 → f16: exact, one conversion per pair
                w_smem[...] = lat_smem.at[slot][...].astype(w_smem.dtype)
                plgpu.commit_smem()
            pos0 = (first_page + step * c.pages_per_block) * c.block_size
            logits = st.qk_logits(q_smem, tile, st.ROWS, c.block_kv) * (c.sm_scale * st.LOG2E)
            p, alpha, m, l = st.softmax_step(m, l, logits, st.visible(st.positions(logits.shape, 1, pos0), length,
                                                                       None))
            st.zero_rows_outside(tile, pos0, length, None)  # the values of both halves
            p_smem[...] = p.astype(p_smem.dtype)
            row_smem[...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)
            o = st.rescale(o, alpha, st.pv_product(p_smem, tile.at[:, pl.ds(0, half)], st.ROWS, half))
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return o, m, l

        o, m, l = lax.fori_loop(0, n_steps, body, st.softmax_init(st.ROWS, half))
        pl.when(n_steps > 0)(lambda: plgpu.barrier_wait(p_done))  # the last step's factors were read
        out, lse = st.finish(o, m, l)
        row_smem[...] = l
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.barrier_arrive(final_bar)
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, t, s])
        o_ref.at[b, t, s, :, pl.ds(0, half)][...] = out
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _second_half():
        o_ref.at[b, t, s, :, pl.ds(half, half)][...] = value_half(
            n_steps, tile_of, half, p_smem, row_smem, p_ready, p_done, consumed_bars, final_bar)


def value_half(n_steps, tile_of, half: int, p_smem, row_smem, p_ready, p_done, consumed_bars, final_bar):
    """Compute warpgroup 1 of the MLA kernels (this one and mgpu_ragged_mla's): each step
    O[:, rank/2:] += P·c_kv with warpgroup 0's P and rescale factors (p_ready), released on p_done
    and the slot's consumed barrier; at the end normalized by warpgroup 0's row sums (final_bar) →
    f32[64, rank/2]. tile_of(step) → (slot, the step's latent tile), after its barrier."""
    plgpu = require_mgpu()
    plgpu.set_max_registers(232, action="increase")
    row = plgpu.Layout.WGMMA.reduce(1)

    def body(step, o):
        slot, tile = tile_of(step)
        plgpu.barrier_wait(p_ready)
        alpha = plgpu.layout_cast(row_smem[...], row)
        o = st.rescale(o, alpha, st.pv_product(p_smem, tile.at[:, pl.ds(half, half)], st.ROWS, half))
        plgpu.barrier_arrive(p_done)
        plgpu.barrier_arrive(consumed_bars.at[slot])
        return o

    o = lax.fori_loop(0, n_steps, body, st.softmax_init(st.ROWS, half)[0])
    plgpu.barrier_wait(final_bar)
    l = plgpu.layout_cast(row_smem[...], row)
    return st.finish(o, jnp.zeros_like(l), l)[0]


def smem_bytes(*, channels: int, page_dtype, q_dtype, tiles: MosaicDecodeTiles, block_size: int) -> int:
    """Shared memory one program allocates (the scratch of `_mla_kernel`)."""
    block_kv = tiles.pages_per_block * block_size
    page, qb = jnp.dtype(page_dtype).itemsize, jnp.dtype(q_dtype).itemsize
    widened = block_kv * channels * qb if jnp.dtype(page_dtype) != jnp.dtype(q_dtype) else 0
    return (st.ROWS * channels * qb + tiles.stages * block_kv * channels * page + widened + st.ROWS * block_kv * qb
            + 2 * st.ROWS * 4 + 2048)  # + the alignment of small buffers, barriers


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def _mgpu_mla_decode(q_latent, q_rope, latent_pages, block_tables, context_lens, latent_scale, *, scale, tiles,
                     interpret):
    plgpu = require_mgpu()
    batch, num_heads, rank = q_latent.shape  # [B, N, kv_lora_rank]
    _, block_size, channels = latent_pages.shape  # [P, Z, C]
    head_tiles = cdiv(num_heads, st.ROWS)
    max_blocks = block_tables.shape[1]
    pages_per_split = cdiv(cdiv(max_blocks, tiles.num_splits), tiles.pages_per_block) * tiles.pages_per_block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, tiles.pages_per_block)),
                     constant_values=NULL_BLOCK)  # a step's last page may index past M (then unused)
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32) * latent_scale  # (q × s) · page
    q = st.to_dot_dtype(q.astype(q_latent.dtype), st.dot_dtype(q_latent.dtype, latent_pages.dtype))
    q = jnp.pad(q, ((0, 0), (0, head_tiles * st.ROWS - num_heads), (0, 0)))
    q = q.reshape(batch, head_tiles, st.ROWS, channels)  # [B, T, 64, C]
    c = _Static(block_size=block_size, pages_per_block=tiles.pages_per_block, pages_per_split=pages_per_split,
                max_blocks=max_blocks, stages=tiles.stages, rank=rank, sm_scale=scale,
                widen=jnp.dtype(latent_pages.dtype) != jnp.dtype(q.dtype))
    scratch = [
        st.tiled_smem((st.ROWS, channels), q.dtype),
        st.tiled_smem((c.stages, c.block_kv, channels), latent_pages.dtype),
        st.tiled_smem((c.block_kv, channels) if c.widen else (8, 64), q.dtype),
        st.tiled_smem((st.ROWS, c.block_kv), q.dtype, swizzle=st.swizzle_bytes(channels, q.dtype)),
        plgpu.SMEM((2, st.ROWS), jnp.float32),
        plgpu.Barrier(num_arrivals=1),  # q
        plgpu.Barrier(num_arrivals=tiles.pages_per_block, num_barriers=c.stages),  # a slot's pages landed
        plgpu.Barrier(num_arrivals=2, num_barriers=c.stages),  # both compute warpgroups released a slot
        plgpu.Barrier(num_arrivals=1),  # p_ready
        plgpu.Barrier(num_arrivals=1),  # p_done
        plgpu.Barrier(num_arrivals=1),  # final sums published
    ]
    splits = tiles.num_splits
    out_shapes = (jax.ShapeDtypeStruct((batch, head_tiles, splits, st.ROWS, rank), jnp.float32),
                  jax.ShapeDtypeStruct((batch, head_tiles, splits, st.ROWS), jnp.float32))
    call = kernel_call(functools.partial(_mla_kernel, c=c), out_shapes=out_shapes, scratch=scratch,
                       grid=(batch, head_tiles, splits), grid_names=("b", "t", "s"), num_threads=3, thread_name="wg",
                       compiler_params=compiler_params(approx_math=True, reduction_scratch_bytes=0),
                       interpret=interpret,
                       kernel_name=f"kvjax_mgpu_mla_decode_p{tiles.pages_per_block}_s{splits}_st{c.stages}")
    o, lse = call(context_lens.astype(jnp.int32), tables, q, latent_pages)
    out = o[:, :, 0] if splits == 1 else merge_splits(o, lse, axis=2)  # f32[B, T, 64, rank]
    out = out * latent_scale[:rank]
    return out.reshape(batch, head_tiles * st.ROWS, rank)[:, :num_heads].astype(q_latent.dtype)


def mla_paged_decode(q_latent, q_rope, latent_pages, block_tables, context_lens, *, scale: float, latent_scale=None,
                     tiles: MosaicDecodeTiles | None = None, interpret: bool | None = None) -> jax.Array:
    """kvjax.attention.pallas_mla.mla_paged_decode on Mosaic GPU: the same arguments and result.

    q_latent [B, N, kv_lora_rank], q_rope [B, N, rope] (bf16 / f16, unscaled); latent_pages
    [P, Z, C] (q's dtype, e4m3, e5m2), C = kv_lora_rank + rope; block_tables i32[B, M];
    context_lens i32[B]; latent_scale: None, a scalar or f32[C]; tiles: None → defaults fitted to
    SMEM; interpret: None → the CPU interpreter on a CPU backend. → [B, N, kv_lora_rank].
    """
    if len(q_latent.shape) != 3 or len(q_rope.shape) != 3:
        raise ValueError(f"q_latent and q_rope must be [B, N, kv_lora_rank] and [B, N, rope]; got shapes"
                         f" {tuple(q_latent.shape)} and {tuple(q_rope.shape)}")
    if q_rope.shape[:2] != q_latent.shape[:2] or q_rope.dtype != q_latent.dtype:
        raise ValueError(f"q_rope {tuple(q_rope.shape)} {q_rope.dtype} must share B, N and dtype with q_latent"
                         f" {tuple(q_latent.shape)} {q_latent.dtype}")
    if len(latent_pages.shape) != 3:
        raise ValueError(f"latent_pages must be [P, Z, C]; got shape {tuple(latent_pages.shape)}")
    batch, num_heads, rank = q_latent.shape
    _, block_size, channels = latent_pages.shape
    if channels != rank + q_rope.shape[2]:
        raise ValueError(f"latent_pages channel dim C={channels} must equal kv_lora_rank + qk_rope_head_dim"
                         f" = {rank} + {q_rope.shape[2]}")
    if jnp.dtype(q_latent.dtype) not in Q_DTYPES:
        raise ValueError(f"q_latent dtype {q_latent.dtype} unsupported by the Mosaic GPU kernel (wgmma has no exact "
                         "f32 product); use bf16 / f16 or the Triton kernel (kvjax.attention.pallas_mla)")
    if jnp.dtype(latent_pages.dtype) not in (jnp.dtype(q_latent.dtype), *FP8_DTYPES):
        raise ValueError(f"latent_pages dtype {latent_pages.dtype} unsupported with {q_latent.dtype} queries")
    if rank % 128 or channels % 64:
        raise ValueError(f"kv_lora_rank {rank} must be a multiple of 128 and C = {channels} of 64 (two warpgroups "
                         "each take half of the value lanes; swizzled SMEM rows)")
    if block_size % 8:
        raise ValueError(f"block size {block_size} must be a multiple of 8 (a page lands on whole 8-row SMEM tiles)")
    check_tables(batch, block_tables, context_lens)
    latent_scale = check_scale("latent_scale", latent_scale, channels, "per latent channel")
    max_blocks = block_tables.shape[1]

    def need(t: MosaicDecodeTiles) -> int:
        return smem_bytes(channels=channels, page_dtype=latent_pages.dtype, q_dtype=q_latent.dtype, tiles=t,
                          block_size=block_size)

    if tiles is None:
        tiles = fit_smem(default_mosaic_tiles(batch=batch, row_blocks=cdiv(num_heads, st.ROWS), block_size=block_size,
                                              max_blocks=max_blocks,
                                              bytes_per_token=channels * jnp.dtype(latent_pages.dtype).itemsize),
                         block_size=block_size, max_blocks=max_blocks, smem_of=need)
    tiles.check(block_size=block_size)
    if need(tiles) > _SMEM_BYTES:
        raise ValueError(f"MosaicDecodeTiles {tiles} need {need(tiles)} bytes of shared memory (> {_SMEM_BYTES}): "
                         "fewer stages, a smaller block_kv or more splits")
    return _mgpu_mla_decode(q_latent, q_rope, latent_pages, block_tables, context_lens, latent_scale,
                            scale=float(scale), tiles=tiles, interpret=resolve_interpret(interpret))
