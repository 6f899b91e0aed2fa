"""Pallas paged-decode attention for MLA (DeepSeek-V2/V3) in the absorbed form, with split-K.

MLA caches one latent vector per token: c_kv (kv_lora_rank lanes, the compressed K/V) followed
by the decoupled rope key (qk_rope_head_dim lanes), pages [P, Z, C] (SPEC: f = 1, one kv head).
With W_UK absorbed into the query and W_UV into the output (DeepSeek-V2 §2.1.2; vLLM's
`MLACommonImpl` decode path, FlashMLA), decode attention runs on the latent directly:

    score[n, t] = scale · (q_latent[n] · c_kv[t] + q_rope[n] · k_rope[t])
    out[n]      = Σ_t softmax(score)[n, t] · c_kv[t]              → [B, N, kv_lora_rank]

so every query head attends to the same single "kv head". One program owns a tile of block_h
heads of one sequence (all of them for N <= 64) and one split of its context, so a latent page
is read once per head tile: with DeepSeek-V3's 128 heads per rank the default tile of 64 reads
it twice; tiles.block_h = 128 reads it once, at 128 × 512 f32 of accumulator per program.

The kernel reads c_kv and k_rope as two lane slices of the same page ([.., :kv_lora_rank] and
[.., kv_lora_rank:]), so both widths must be powers of two (Triton tiles), as they are for
DeepSeek (512, 64).

fp8: `latent_scale` f32[C] is a per-channel dequant scale (page.astype(f32) × scale[c]), which
lets a calibrated c_kv scale and a separate rope-key scale coexist; None means 1.0. Per channel
it factors exactly out of both products: score uses (q × scale) · page and out is
scale × (p · page), so the kernel scales the query tile once, and the f32 output once, and feeds
the fp8 → bf16 cast (exact) to the dot. With a bf16 query the scaled query is rounded to bf16
once — a bf16-level error, like the P·V cast. See pallas_decode for the other numeric rules
(in-kernel softmax scale, null-block sanitizing, f32 accumulation, context length 0 → 0).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.attention.pallas_decode import (MASK_VALUE, check_dtypes, check_scale, check_tables, compute_dtype_for,
                                           dot_f32, dot_precision, merge_splits, online_softmax_step, resolve_interpret,
                                           split_block_tables, split_inputs, split_outputs, split_pages, step_pages,
                                           write_partial)
from kvjax.attention.reference import mla_paged_decode_reference  # noqa: F401  the kernel's plain jnp twin
from kvjax.attention.tiles import DecodeTiles, default_mla_tiles
from kvjax.math_utils import cdiv, is_power_of_two


def _mla_kernel(
    lens_ref,  # i32[1]: this sequence's context length
    tables_ref,  # i32[M + pages_per_block - 1]: this sequence's block table, null-padded
    q_latent_ref,  # [block_h, kv_lora_rank]: this head tile's absorbed queries (padded heads are zero)
    q_rope_ref,  # [block_h, rope]: this head tile's rope queries
    latent_ref,  # [P, Z, C]: latent pages, C = kv_lora_rank + rope
    scale_ref,  # f32[C]: per-channel dequant scale
    o_ref,  # f32[block_h, kv_lora_rank]: this split's normalized output
    lse_ref,  # f32[block_h]: this split's logsumexp (-inf when it saw no token)
    *, sm_scale: float, pages_per_block: int, pages_per_split: int, max_blocks: int, compute_dtype, precision,
):
    block_h, rank = q_latent_ref.shape
    rope_dim = q_rope_ref.shape[1]
    block_size = latent_ref.shape[1]
    block_k = pages_per_block * block_size
    length = lens_ref[0]
    first_page, n_pages, n_steps = split_pages(pl.program_id(2), length, block_size=block_size,
                                               pages_per_block=pages_per_block, pages_per_split=pages_per_split,
                                               max_blocks=max_blocks)

    latent_scale = scale_ref[pl.ds(0, rank)]  # f32[kv_lora_rank]
    rope_scale = scale_ref[pl.ds(rank, rope_dim)]  # f32[rope]
    # The per-channel dequant scale moves onto the query: (q × s) · page == q · (page × s).
    q_latent = (q_latent_ref[...].astype(jnp.float32) * latent_scale[None, :]).astype(compute_dtype)
    q_rope = (q_rope_ref[...].astype(jnp.float32) * rope_scale[None, :]).astype(compute_dtype)

    def body(step, carry):
        pages, pos = step_pages(tables_ref, step, n_pages, first_page, block_size, pages_per_block)
        valid = pos < length  # bool[block_k]
        c_kv = latent_ref[pages, :, pl.ds(0, rank)].reshape(block_k, rank).astype(compute_dtype)
        k_rope = latent_ref[pages, :, pl.ds(rank, rope_dim)].reshape(block_k, rope_dim).astype(compute_dtype)
        logits = (dot_f32(q_latent, c_kv, contract_b=1, precision=precision)
                  + dot_f32(q_rope, k_rope, contract_b=1, precision=precision)) * sm_scale  # f32[block_h, block_k]
        c_kv = jnp.where(valid[:, None], c_kv, 0)  # c_kv is also the value: keep garbage out
        return online_softmax_step(carry, logits, valid, c_kv, compute_dtype, precision)

    init = (jnp.zeros((block_h, rank), jnp.float32), jnp.full((block_h,), MASK_VALUE, jnp.float32),
            jnp.zeros((block_h,), jnp.float32))
    o, m, l = lax.fori_loop(0, n_steps, body, init)
    write_partial(o_ref, lse_ref, o, m, l, latent_scale[None, :])


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def _mla_paged_decode(q_latent, q_rope, latent_pages, block_tables, context_lens, latent_scale, *, scale, tiles,
                      interpret):
    batch, num_heads, rank = q_latent.shape  # [B, N, kv_lora_rank]
    rope_dim = q_rope.shape[2]  # [B, N, rope]
    num_pages, block_size, channels = latent_pages.shape  # [P, Z, C]
    block_h = tiles.block_h
    head_blocks = cdiv(num_heads, block_h)
    pad = ((0, 0), (0, head_blocks * block_h - num_heads), (0, 0))
    q_latent_p = jnp.pad(q_latent, pad)  # [B, N', kv_lora_rank], N' = head_blocks × block_h
    q_rope_p = jnp.pad(q_rope, pad)  # [B, N', rope]
    tables, pages_per_split = split_block_tables(block_tables, tiles.num_splits, tiles.pages_per_block)
    num_splits = tiles.num_splits
    compute_dtype = compute_dtype_for(q_latent.dtype, latent_pages.dtype)
    kernel = functools.partial(_mla_kernel, sm_scale=scale, pages_per_block=tiles.pages_per_block,
                               pages_per_split=pages_per_split, max_blocks=block_tables.shape[1],
                               compute_dtype=compute_dtype, precision=dot_precision(compute_dtype))
    o, lse = pl.pallas_call(
        kernel,
        grid=(batch, head_blocks, num_splits),
        in_specs=[
            *split_inputs(tables.shape[1]),
            pl.BlockSpec((None, block_h, rank), lambda b, n, s: (b, n, 0)),  # q_latent
            pl.BlockSpec((None, block_h, rope_dim), lambda b, n, s: (b, n, 0)),  # q_rope
            pl.BlockSpec((num_pages, block_size, channels), lambda b, n, s: (0, 0, 0)),  # latent pages
            pl.BlockSpec((channels,), lambda b, n, s: (0,)),  # latent_scale
        ],
        **split_outputs(batch, head_blocks, num_splits, block_h, rank),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"kvjax_mla_paged_decode_h{block_h}_p{tiles.pages_per_block}_s{num_splits}",
    )(context_lens.astype(jnp.int32), tables, q_latent_p, q_rope_p, latent_pages, latent_scale)
    out = o[:, :, 0] if num_splits == 1 else merge_splits(o, lse, axis=2)  # f32[B, head_blocks, block_h, kv_lora_rank]
    return out.reshape(batch, head_blocks * block_h, rank)[:, :num_heads].astype(q_latent.dtype)


def mla_paged_decode(q_latent, q_rope, latent_pages, block_tables, context_lens, *, scale: float,
                     latent_scale=None, tiles: DecodeTiles | None = None, interpret: bool | None = None) -> jax.Array:
    """Absorbed-MLA decode attention over a paged latent cache (Pallas kernel).

    q_latent [B, N, kv_lora_rank] (W_UK already applied), q_rope [B, N, rope] (rotated; rope =
    qk_rope_head_dim), both f32/bf16/f16 and unscaled; latent_pages [P, Z, C], C = kv_lora_rank
    + rope (f32, bf16, f16, e4m3, e5m2); block_tables i32[B, M]; context_lens i32[B] (0 gives a
    zero output); scale: softmax scale, applied in the kernel; latent_scale: None (1.0), a
    per-tensor scalar or per-channel f32[C] dequant scale; tiles: None → `default_mla_tiles`;
    interpret: None → True on CPU. Returns [B, N, kv_lora_rank] in q_latent's dtype (apply W_UV
    outside). Bad shapes raise ValueError.
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
    rope_dim = q_rope.shape[2]
    _, block_size, channels = latent_pages.shape
    if channels != rank + rope_dim:
        raise ValueError(f"latent_pages channel dim C={channels} must equal kv_lora_rank + qk_rope_head_dim"
                         f" = {rank} + {rope_dim}")
    check_dtypes(q_latent.dtype, latent_pages.dtype, "q_latent", "latent_pages")
    for name, n in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope_dim), ("block size", block_size)):
        if not is_power_of_two(n):
            raise ValueError(f"{name} {n} must be a power of two (Triton tiles); use the reference path")
    check_tables(batch, block_tables, context_lens)
    latent_scale = check_scale("latent_scale", latent_scale, channels, "per latent channel")
    if tiles is None:
        tiles = default_mla_tiles(batch=batch, num_heads=num_heads, kv_lora_rank=rank, block_size=block_size,
                                  max_blocks=block_tables.shape[1])
    tiles.check(block_size=block_size)
    return _mla_paged_decode(q_latent, q_rope, latent_pages, block_tables, context_lens, latent_scale,
                             scale=float(scale), tiles=tiles, interpret=resolve_interpret(interpret))
