"""The Pallas paged-decode kernel on nvfp4 pages (kvjax.attention.pallas_decode's GQA kernel, split out).

nvfp4 pages are uint8 [P, Z, K, H/2 + H/16] (kvjax.quant.nvfp4: E2M1 values two per byte, then
one e4m3 block scale per 16 values). Triton's blocks must be powers of two and a head's
H/2 + H/16 bytes are not, so each page array comes in twice, as two power-of-two blocks: the
values [.., :H/2] and the block-scale bytes [.., H/2:]. The kernel unpacks them with
`nvfp4.unpack` into the even lanes (low nibbles) and the odd lanes (high nibbles), each times its
block scale, and never interleaves them: q·k is the sum of the dots of q's even and odd lanes
with the two halves, P·V is written as two halves, and the caller interleaves the outputs. The
per-tensor scale folds into the logits (K) and the output (V) as fp8's does. An E2M1 value times
an e4m3 scale is exact in bf16, so the dots run in q's dtype as for fp8.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention.pallas_steps import (MASK_VALUE, dot_f32, in_view, online_softmax_step, program_split,
                                          split_inputs, split_outputs, step_pages, write_partial)
from kvjax.quant import nvfp4


def _gqa_nvfp4_kernel(
    lens_ref, tables_ref,
    qe_ref, qo_ref,  # [block_h, H/2]: this kv head's query rows, even and odd lanes
    kd_ref, ks_ref,  # uint8 [P, Z, H/2] and [P, Z, H/16]: this kv head's K values and block-scale bytes
    vd_ref, vs_ref,  # the same for V
    k_scale_ref, v_scale_ref,  # f32[1]: the per-tensor scales of this kv head
    oe_ref, oo_ref,  # f32[block_h, H/2]: this split's normalized output, even and odd lanes
    lse_ref,
    *, sm_scale: float, pages_per_block: int, pages_per_split: int, max_blocks: int, window: int | None,
    softcap: float | None, compute_dtype, precision,
):
    """pallas_decode's _gqa_kernel on nvfp4 pages (module docstring)."""
    block_h, half = qe_ref.shape
    block_size, block_k, length, first_page, n_pages, n_steps = program_split(
        lens_ref, kd_ref, pages_per_block=pages_per_block, pages_per_split=pages_per_split, max_blocks=max_blocks,
        window=window)
    qe, qo = qe_ref[...].astype(compute_dtype), qo_ref[...].astype(compute_dtype)
    logit_scale = sm_scale * k_scale_ref[0]

    def load(data_ref, scale_ref, pages):  # (even, odd) [block_k, H/2], block-scaled, in the dot dtype
        data = data_ref[pages].reshape(block_k, half)
        scales = scale_ref[pages].reshape(block_k, scale_ref.shape[-1])
        return tuple(x.astype(compute_dtype) for x in nvfp4.unpack(data, scales))

    def body(step, carry):
        pages, pos = step_pages(tables_ref, step, n_pages, first_page, block_size, pages_per_block)
        valid = in_view(pos, length, window)
        ke, ko = load(kd_ref, ks_ref, pages)
        ve, vo = (jnp.where(valid[:, None], x, 0) for x in load(vd_ref, vs_ref, pages))
        logits = (dot_f32(qe, ke, contract_b=1, precision=precision)
                  + dot_f32(qo, ko, contract_b=1, precision=precision)) * logit_scale
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        return online_softmax_step(carry, logits, valid, (ve, vo), compute_dtype, precision)

    zeros = jnp.zeros((block_h, half), jnp.float32)
    init = ((zeros, zeros), jnp.full((block_h,), MASK_VALUE, jnp.float32), jnp.zeros((block_h,), jnp.float32))
    o, m, l = lax.fori_loop(0, n_steps, body, init)
    write_partial((oe_ref, oo_ref), lse_ref, o, m, l, v_scale_ref[0])


def nvfp4_decode_call(kernel_kw: dict, call: dict, lens, tables, q4, k_pages, v_pages, k_scale, v_scale, *,
                      block_h: int, head_scalar_spec):
    """The pallas_call of the nvfp4 kernel for pallas_decode's _paged_decode (its kernel keywords and
    call settings, q [B, K, block_h, H]) → (o f32[B, K, splits, block_h, H], lse), lanes interleaved."""
    batch, num_kv_heads, _, head_dim = q4.shape
    num_splits, block_size = call["grid"][2], k_pages.shape[1]
    half, groups = head_dim // 2, head_dim // nvfp4.GROUP
    data_spec = pl.BlockSpec((k_pages.shape[0], block_size, None, half), lambda b, h, s: (0, 0, h, 0))
    scale_spec = pl.BlockSpec((k_pages.shape[0], block_size, None, groups), lambda b, h, s: (0, 0, h, half // groups))
    q_spec = pl.BlockSpec((None, None, block_h, half), lambda b, h, s: (b, h, 0, 0))
    outs = split_outputs(batch, num_kv_heads, num_splits, block_h, half)
    oe, oo, lse = pl.pallas_call(
        functools.partial(_gqa_nvfp4_kernel, **kernel_kw),
        in_specs=[*split_inputs(tables.shape[1]), q_spec, q_spec, data_spec, scale_spec, data_spec, scale_spec,
                  head_scalar_spec, head_scalar_spec],
        out_specs=[outs["out_specs"][0]] + outs["out_specs"], out_shape=[outs["out_shape"][0]] + outs["out_shape"],
        **call,
    )(lens, tables, q4[..., 0::2], q4[..., 1::2], k_pages, k_pages, v_pages, v_pages, k_scale, v_scale)
    return jnp.stack([oe, oo], axis=-1).reshape(*oe.shape[:-1], head_dim), lse
