"""Absorbed-MLA ragged paged attention (DeepSeek's prefill / mixed step) on Pallas Mosaic GPU.

The Mosaic GPU twin of the "mla" kind of kvjax.attention.pallas_ragged (its docstring has the work
items, masks and numerics; kvjax.attention.pallas_mla's the absorbed form: every head attends to
one latent "kv head" whose key is the whole latent [c_kv, k_rope], C lanes, and whose value is
c_kv, its first kv_lora_rank lanes). Same arguments, same result. It is mgpu_mla's decode kernel
with mgpu_ragged's work items:

    grid (work item w, head tile t), three warpgroups. An item is 64 query rows (wgmma's M) of
    one sequence: q_tile = 64 / G' new tokens × G' heads, G' = N padded to a power of two when
    N <= 64 (row r: token r // G', head r % G'), else one token × a tile of 64 heads (N padded
    to a multiple of 64, t picks the tile). Each row is masked to its own token's position;
    the item walks the latent blocks from position 0 to its last row's position.

    memory warpgroup     copies the item's query rows into SMEM, then keeps `stages` latent
                         blocks [block_kv, C] in flight (TMA, one copy per page, page ids read
                         from the block table in GMEM; per-token formats: each page's [Z] f32
                         scales beside it), refilling a slot once both compute warpgroups
                         released it;
    compute warpgroup 0  S = Q·Lᵀ over all C lanes (wgmma), the per-row causal mask, the online
                         softmax, P into SMEM and each row's rescale factor beside it, then
                         O[:, :rank/2] += P·c_kv;
    compute warpgroup 1  O[:, rank/2:] += P·c_kv with warpgroup 0's P and factors.

Why this split (mgpu_mla's): the f32 accumulator of 64 rows × 512 lanes is 256 registers per
thread of one warpgroup, more than a thread has; halved, 128 each. Warpgroup 0 publishes P and
the factors on a barrier (p_ready) and waits for warpgroup 1 to be done with them (p_done) before
overwriting them. SMEM at DeepSeek's C = 576 (bf16, block_kv = 64): query 72 KiB + 2 latent slots
144 KiB + P 8 KiB; fp8 / per-token pages: 2 slots of 36 KiB + the widened slot 72 KiB. Two stages
of 64 positions are what fit. Each compute warpgroup writes its half of the normalized f32 output
from registers straight to GMEM; the rows are gathered and scattered outside the kernel (a copy of
q, not of the cache), as pallas_ragged does. There is no split-K, as in pallas_ragged: a prefill
step has many items, but a decode token of a mixed step walks its whole context in one program
(pure decode steps go to mgpu_mla, which splits).

Numerics are pallas_ragged's MLA kind: q × latent_scale (per channel) rounded once to q's dtype
outside the kernel, the f32 output × latent_scale[:rank], the softmax scale on the f32 logits in
the kernel. fp8 latents are widened to f16 in SMEM by warpgroup 0, one SMEM tile of columns at a
time to keep its registers for the accumulator (the query then f16 too: mgpu_steps.dot_dtype).
Per-token formats (int8 / e4m3 with f32 scale pages [P, Z]) are widened the same way, each row ×
its token's scale in f32, rounded once to q's dtype, as mgpu_decode does (the Triton kernel
scales logit and probability columns instead: both within the bf16 tolerance). Latent rows
outside the item's span [0, last row's position] are zeroed before P·V (0 × NaN is NaN in the
tensor core: mgpu_steps).

What it takes: bf16 / f16 queries (wgmma has no exact f32 product), q_rope of q_latent's dtype;
latent pages of q's dtype, static-scale fp8 (e4m3, e5m2) or per-token int8 / e4m3 with Z a
multiple of 32 (a page's [Z] f32 scales are one TMA copy, and Mosaic GPU's Lane semantics copy
multiples of 128 bytes); kv_lora_rank a multiple of 128 (two warpgroups each take half of the
value lanes), C a multiple of 64, Z a multiple of 8, block_kv 64 / 128 / 256 within 227 KiB of
SMEM; any number of heads. nvfp4 latents are read by neither kernel. Everything else raises
ValueError naming the value; kvjax.attention.pallas_ragged takes the rest.
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
from kvjax.attention.mgpu_mla import value_half
from kvjax.attention.mgpu_interpret import compiler_params, kernel_call, require_mgpu, resolve_interpret
from kvjax.attention.pallas_decode import check_scale
from kvjax.attention.pallas_ragged import padded_work_items
from kvjax.attention.reference import mla_paged_attention_reference  # noqa: F401  the kernel's plain jnp twin
from kvjax.attention.tiles import _SMEM_BYTES, MosaicRaggedTiles
from kvjax.core.block_pool import NULL_BLOCK
from kvjax.math_utils import cdiv, pow2_bucket


@dataclasses.dataclass(frozen=True)
class _Static:
    block_size: int
    pages_per_block: int
    stages: int
    rank: int  # kv_lora_rank: the value lanes
    group_shift: int  # log2 of the heads per token in an item's rows (G')
    sm_scale: float
    widen: bool  # the latent slot is converted to the dot dtype before the products
    per_token: bool  # ... multiplied row by row by its token's scale on the way

    @property
    def block_kv(self) -> int:
        return self.pages_per_block * self.block_size


def _ragged_mla_kernel(
    meta_ref,  # i32[W, 4]: per item (its tokens, context length, first row's position, sequence row)
    tables_ref,  # i32[B, M']: block tables, null-padded by a block
    q_ref,  # [W, HT, 64, C] dot dtype: each item's rows [q_latent × s, q_rope × s] of each head tile
    lat_ref,  # [P, Z, C]: latent pages
    *refs,  # per-token formats: ts_ref f32[P, Z]; then the output and the scratch below
    c: _Static,
):
    if c.per_token:
        ts_ref, *refs = refs
    (o_ref,  # f32[W, HT, 64, rank]: normalized outputs (0 for a row that saw nothing)
     q_smem,  # [64, C] dot dtype
     lat_smem,  # [stages, block_kv, C] page dtype
     w_smem,  # [block_kv, C] dot dtype: the widened slot (fp8 / per-token pages), else unused
     p_smem,  # [64, block_kv] dot dtype: P, from warpgroup 0 for both
     row_smem,  # f32[64]: each row's rescale factor (alpha), at the end its sum
     q_bar, kv_bars, consumed_bars, p_ready, p_done, final_bar,
     *ts_smem) = refs  # per-token: f32[stages, block_kv], the slot's token scales
    plgpu = require_mgpu()
    w, t, wg = lax.axis_index("w"), lax.axis_index("t"), lax.axis_index("wg")
    tokens, length, first_pos, seq = meta_ref[w, 0], meta_ref[w, 1], meta_ref[w, 2], meta_ref[w, 3]
    span_hi = jnp.minimum(first_pos + tokens, length)  # past the item's last row's position: nobody looks
    n_steps = jnp.where(tokens > 0, pl.cdiv(span_hi, c.block_kv), 0)
    live_pages = pl.cdiv(length, c.block_size)  # table entries past these may be garbage
    half = c.rank // 2

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[w, t], q_smem, q_bar)

        def issue(step, slot):
            copies = [(lambda page: lat_ref.at[page], lat_smem.at[slot], kv_bars.at[slot])]
            if c.per_token:
                copies.append((lambda page: ts_ref.at[page], ts_smem[0].at[slot], kv_bars.at[slot]))
            st.issue_pages(lambda i: tables_ref[seq, i], step, live_pages, c.pages_per_block, c.block_size, copies)

        st.produce(n_steps, c.stages, issue, consumed_bars)  # a slot is released once both compute warpgroups are done

    def tile_of(step):
        """The step's latent tile in the dot dtype, after its barrier (and warpgroup 0's widening)."""
        slot = lax.rem(step, c.stages)
        plgpu.barrier_wait(kv_bars.at[slot])
        return slot, (w_smem if c.widen else lat_smem.at[slot])

    @pl.when(wg == 0)
    def _softmax_and_first_half():
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(q_bar)
        row_pos = lax.shift_right_logical(st.positions((st.ROWS, c.block_kv), 0, 0), c.group_shift) + first_pos
        row_live = row_pos < first_pos + tokens

        def body(step, carry):
            o, m, l = carry
            slot, tile = tile_of(step)
            pl.when(step > 0)(lambda: plgpu.barrier_wait(p_done))  # warpgroup 1 is done with step - 1
            if c.widen:
                _widen(lat_smem.at[slot], w_smem, ts_smem[0].at[slot] if c.per_token else None)
            pos0 = step * c.block_kv
            logits = st.qk_logits(q_smem, tile, st.ROWS, c.block_kv) * (c.sm_scale * st.LOG2E)
            pos = st.positions(logits.shape, 1, pos0)
            seen = row_live & (pos <= row_pos) & (pos < length)  # each row: its own token's causal view
            p, alpha, m, l = st.softmax_step(m, l, logits, seen)
            st.zero_rows_outside_span(tile, pos0, 0, span_hi)  # the values of both halves
            p_smem[...] = p.astype(p_smem.dtype)
            row_smem[...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)
            o = st.rescale(o, alpha, st.pv_product(p_smem, tile.at[:, pl.ds(0, half)], st.ROWS, half))
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return o, m, l

        o, m, l = lax.fori_loop(0, n_steps, body, st.softmax_init(st.ROWS, half))
        pl.when(n_steps > 0)(lambda: plgpu.barrier_wait(p_done))  # the last step's factors were read
        out, _ = st.finish(o, m, l)
        row_smem[...] = l
        plgpu.commit_smem()
        plgpu.barrier_arrive(final_bar)
        o_ref.at[w, t, :, pl.ds(0, half)][...] = out

    @pl.when(wg == 1)
    def _second_half():
        o_ref.at[w, t, :, pl.ds(half, half)][...] = value_half(
            n_steps, tile_of, half, p_smem, row_smem, p_ready, p_done, consumed_bars, final_bar)


def _widen(slot, w_smem, scales):
    """The latent slot [block_kv, C] (fp8 / int8) into w_smem in the dot dtype, in column chunks of
    one SMEM tile (a whole [64, 576] slot in f32 would be 288 registers a thread): fp8 → f16
    exactly, or (scales: the slot's per-token f32[block_kv]) each row × its token's scale in f32,
    rounded once."""
    plgpu = require_mgpu()
    chunk = st.swizzle_bytes(slot.shape[1], slot.dtype) // jnp.dtype(slot.dtype).itemsize
    if scales is not None:
        scales = plgpu.layout_cast(scales[...], plgpu.Layout.WGMMA.reduce(1))  # broadcasts along the rows
    for lo in range(0, slot.shape[1], chunk):
        x = slot.at[:, pl.ds(lo, chunk)][...]
        if scales is not None:
            x = plgpu.layout_cast(x, plgpu.Layout.WGMMA).astype(jnp.float32)
            x = x * lax.broadcast_in_dim(scales, x.shape, [0])
        w_smem.at[:, pl.ds(lo, chunk)][...] = x.astype(w_smem.dtype)
    plgpu.commit_smem()


def smem_bytes(*, channels: int, page_dtype, dot_dtype, tiles: MosaicRaggedTiles, block_size: int,
               per_token: bool = False) -> int:
    """Shared memory one program allocates (the scratch of `_ragged_mla_kernel`)."""
    block_kv = tiles.pages_per_block * block_size
    page, qb = jnp.dtype(page_dtype).itemsize, jnp.dtype(dot_dtype).itemsize
    widened = block_kv * channels * qb if per_token or jnp.dtype(page_dtype) != jnp.dtype(dot_dtype) else 0
    return (st.ROWS * channels * qb + tiles.stages * block_kv * channels * page + widened + st.ROWS * block_kv * qb
            + st.ROWS * 4 + (tiles.stages * block_kv * 4 if per_token else 0) + 2048)  # + alignment, barriers


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def _mgpu_ragged_mla(q_latent, q_rope, latent_pages, token_scales, md, channel_scale, *, scale, tiles, interpret):
    """→ [T, N, kv_lora_rank] in q_latent's dtype (the module docstring's layout)."""
    plgpu = require_mgpu()
    t, heads, rank = q_latent.shape  # [T, N, kv_lora_rank]
    _, block_size, channels = latent_pages.shape  # [P, Z, C]
    gp = min(pow2_bucket(heads), st.ROWS)  # heads of a token in an item's rows
    head_tiles, tq = cdiv(heads, gp), st.ROWS // gp  # tq: tokens of an item
    num_items = cdiv(t, tq) + md.num_seqs
    seq, first, tokens = padded_work_items(md, tq, num_items)
    meta = jnp.stack([tokens, md.context_lens[seq], md.positions[first], seq], axis=1).astype(jnp.int32)
    tables = jnp.pad(md.block_tables.astype(jnp.int32), ((0, 0), (0, tiles.pages_per_block)),
                     constant_values=NULL_BLOCK)  # a step's last page may index past M (then unused)
    idx = first[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]  # i32[W, Tq]: the items' tokens
    idx = jnp.where(jnp.arange(tq, dtype=jnp.int32)[None, :] < tokens[:, None], idx, t)  # past the end: dropped
    per_token = token_scales is not None
    # Per-token pages are scaled while widening, so the products see no exact page values: q's dtype.
    dot = jnp.dtype(q_latent.dtype) if per_token else st.dot_dtype(q_latent.dtype, latent_pages.dtype)
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32) * channel_scale  # (q × s) · page
    q = st.to_dot_dtype(q.astype(q_latent.dtype), dot)
    q = jnp.pad(q, ((0, 1), (0, head_tiles * gp - heads), (0, 0)))[idx]  # [W, Tq, HT·G', C]
    q = q.reshape(num_items, tq, head_tiles, gp, channels).transpose(0, 2, 1, 3, 4)
    q = q.reshape(num_items, head_tiles, st.ROWS, channels)  # [W, HT, 64, C]
    c = _Static(block_size=block_size, pages_per_block=tiles.pages_per_block, stages=tiles.stages, rank=rank,
                group_shift=gp.bit_length() - 1, sm_scale=scale,
                widen=per_token or jnp.dtype(latent_pages.dtype) != dot, per_token=per_token)
    scratch = [
        st.tiled_smem((st.ROWS, channels), dot),
        st.tiled_smem((c.stages, c.block_kv, channels), latent_pages.dtype),
        st.tiled_smem((c.block_kv, channels) if c.widen else (8, 64), dot),  # 8 rows: unused
        st.tiled_smem((st.ROWS, c.block_kv), dot, swizzle=st.swizzle_bytes(channels, dot)),  # the latent's swizzle
        plgpu.SMEM((st.ROWS,), jnp.float32),
        plgpu.Barrier(num_arrivals=1),  # q
        plgpu.Barrier(num_arrivals=(2 if per_token else 1) * tiles.pages_per_block, num_barriers=c.stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=c.stages),  # both compute warpgroups released a slot
        plgpu.Barrier(num_arrivals=1),  # p_ready
        plgpu.Barrier(num_arrivals=1),  # p_done
        plgpu.Barrier(num_arrivals=1),  # final sums published
    ]
    if per_token:
        scratch.append(plgpu.SMEM((c.stages, c.block_kv), jnp.float32))
    out_shape = jax.ShapeDtypeStruct((num_items, head_tiles, st.ROWS, rank), jnp.float32)
    call = kernel_call(functools.partial(_ragged_mla_kernel, c=c), out_shapes=out_shape, scratch=scratch,
                       grid=(num_items, head_tiles), grid_names=("w", "t"), num_threads=3, thread_name="wg",
                       compiler_params=compiler_params(approx_math=True, reduction_scratch_bytes=0),
                       interpret=interpret, kernel_name=f"kvjax_mgpu_ragged_mla_g{gp}_p{tiles.pages_per_block}"
                                                        f"_st{c.stages}{'_tok' if per_token else ''}")
    o = call(meta, tables, q, latent_pages, *(() if token_scales is None else (token_scales,)))
    o = o * channel_scale[:rank]  # f32[W, HT, 64, rank]
    o = o.reshape(num_items, head_tiles, tq, gp, rank).transpose(0, 2, 1, 3, 4)
    o = o.reshape(num_items, tq, head_tiles * gp, rank)[:, :, :heads]  # [W, Tq, N, rank]
    out = jnp.zeros((t + 1, heads, rank), q_latent.dtype)  # rounded once, as the reference rounds
    return out.at[idx].set(o.astype(q_latent.dtype), mode="drop")[:t]


def check_shapes(q_dtype, page_dtype, *, rank: int, channels: int, block_size: int, scale_kind: str,
                 kv_dtype: str | None = None, tiles: MosaicRaggedTiles | None = None) -> MosaicRaggedTiles:
    """This kernel's rules (module docstring) for latent pages of this format (scale_kind: "none",
    "static", "per_token" ... as reference.scale_kind says) → the tiles (None: the default) checked;
    ValueError naming the value that breaks one. kvjax.attention.mgpu_dispatch.eligible asks this
    too, so the two cannot disagree."""
    if scale_kind not in ("none", "static", "per_token"):
        raise ValueError(f"{kv_dtype} latent pages are read by neither MLA kernel; use attn_impl 'reference'")
    if jnp.dtype(q_dtype) not in Q_DTYPES:
        raise ValueError(f"q_latent dtype {jnp.dtype(q_dtype).name} unsupported by the Mosaic GPU kernel (wgmma has "
                         "no exact f32 product); use bf16 / f16 or the Triton kernel (kvjax.attention.pallas_ragged)")
    if scale_kind != "per_token" and jnp.dtype(page_dtype) not in (jnp.dtype(q_dtype), *FP8_DTYPES):
        raise ValueError(f"latent_pages dtype {jnp.dtype(page_dtype).name} unsupported with {jnp.dtype(q_dtype).name} "
                         "queries; use the Triton kernel (kvjax.attention.pallas_ragged)")
    if rank % 128 or channels % 64:
        raise ValueError(f"kv_lora_rank {rank} must be a multiple of 128 and C = {channels} of 64 (two warpgroups "
                         "each take half of the value lanes; swizzled SMEM rows)")
    if block_size % 8:
        raise ValueError(f"block size {block_size} must be a multiple of 8 (a page lands on whole 8-row SMEM tiles)")
    if scale_kind == "per_token" and block_size % 32:
        raise ValueError(f"{kv_dtype} latent pages of {block_size} tokens: the Mosaic GPU kernel copies a page's "
                         "[Z] f32 scales by TMA, which moves multiples of 128 bytes (Z a multiple of 32); use "
                         "the Triton kernel (kvjax.attention.pallas_ragged)")
    tiles = tiles or MosaicRaggedTiles.default(block_size)
    tiles.check(block_size=block_size)
    per_token = scale_kind == "per_token"
    dot = jnp.dtype(q_dtype) if per_token else st.dot_dtype(q_dtype, page_dtype)
    need = smem_bytes(channels=channels, page_dtype=page_dtype, dot_dtype=dot, tiles=tiles, block_size=block_size,
                      per_token=per_token)
    if need > _SMEM_BYTES:
        raise ValueError(f"MosaicRaggedTiles {tiles} need {need} bytes of shared memory (> {_SMEM_BYTES}) at C = "
                         f"{channels}: fewer stages or pages per block")
    return tiles


def mla_ragged_paged_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, md: BatchMetadata,
                               *, scale: float, latent_scale=None, kv_dtype: str | None = None,
                               tiles: MosaicRaggedTiles | None = None, interpret: bool | None = None) -> jax.Array:
    """kvjax.attention.pallas_ragged.mla_ragged_paged_attention on Mosaic GPU (the module docstring
    says what it takes): q_latent [T, N, kv_lora_rank], q_rope [T, N, rope] (bf16 / f16, unscaled);
    latent_pages [P, Z, C] (static: latent_scale None, a scalar or f32[C]; per-token: scale pages
    f32[P, Z]); tiles: None → MosaicRaggedTiles.default(Z); interpret: None → the CPU interpreter on
    a CPU backend. → [T, N, kv_lora_rank] in q_latent's dtype, zero for padding tokens. Bad shapes
    or formats raise ValueError."""
    ref._check("q_latent", q_latent, 3, "[T, N, kv_lora_rank]")
    ref._check("q_rope", q_rope, 3, "[T, N, rope]")
    ref._check_latent(q_latent, q_rope, latent_pages)
    t, heads, rank = q_latent.shape
    pages, block_size, channels = latent_pages.shape
    kind = ref.scale_kind(latent_pages, latent_scale, kv_dtype)
    if q_rope.dtype != q_latent.dtype:
        raise ValueError(f"q_rope dtype {q_rope.dtype} must be q_latent's ({q_latent.dtype})")
    tiles = check_shapes(q_latent.dtype, latent_pages.dtype, rank=rank, channels=channels, block_size=block_size,
                         scale_kind=kind, kv_dtype=kv_dtype, tiles=tiles)
    token_scales = None
    if kind == "per_token":
        token_scales = latent_scale
        if (token_scales is None or tuple(jnp.shape(token_scales)) != (pages, block_size)
                or jnp.result_type(token_scales) != jnp.float32):
            got = None if token_scales is None else f"{jnp.result_type(token_scales)} {tuple(jnp.shape(token_scales))}"
            raise ValueError(f"{kv_dtype} latent pages need latent_scale f32[{pages}, {block_size}] (a scale per "
                             f"token); got {got}")
        latent_scale = None
    channel_scale = check_scale("latent_scale", latent_scale, channels, "per latent channel")
    return _mgpu_ragged_mla(q_latent, q_rope, latent_pages, token_scales, md, channel_scale, scale=float(scale),
                            tiles=tiles, interpret=resolve_interpret(interpret))
