"""The pieces the Pallas split-K decode kernels share (kvjax.attention.pallas_decode's GQA kernel,
pallas_nvfp4's on nvfp4 pages, pallas_mla's): where a program's split starts, which positions a
step sees, the online softmax, the partial outputs and the BlockSpecs of the per-sequence inputs
and per-split outputs. See pallas_decode's docstring for the kernels' structure and numerics.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kvjax.core.block_pool import NULL_BLOCK
from kvjax.math_utils import cdiv

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: MASK - MASK is 0, not NaN


def dot_f32(a, b, *, contract_b: int, precision):
    """a [rows, depth] · b ([depth, cols] if contract_b == 0, [cols, depth] if 1) → f32[rows, cols]."""
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def window_pages(window: int, block_size: int) -> int:
    """The most pages W consecutive positions touch: cdiv(W - 1, Z) + 1."""
    return cdiv(window - 1, block_size) + 1


def split_pages(split, length, *, block_size: int, pages_per_block: int, pages_per_split: int, max_blocks: int,
                window: int | None = None):
    """Split `split`'s pages of a sequence of `length` tokens: (first logical page, valid pages, steps).

    The splits tile the sequence's pages in view from the first: page 0, or with a window W the
    page of position length - W, the first the query sees; no split reaches a page before it.
    Plain jnp on scalars, so the kernel (split = pl.program_id(2)) and a test share it.
    """
    start = 0 if window is None else lax.div(jnp.maximum(length - window, 0), block_size)
    first_page = start + split * pages_per_split
    end = jnp.minimum(pl.cdiv(length, block_size), max_blocks)  # a length past M × Z reads no further
    n_pages = jnp.clip(end - first_page, 0, pages_per_split)
    return first_page, n_pages, pl.cdiv(n_pages, pages_per_block)


def program_split(lens_ref, pages_ref, *, pages_per_block: int, pages_per_split: int, max_blocks: int,
                  window: int | None):
    """Every kernel's prologue: this program's view of its sequence, from its length and a page
    ref [P, Z, ...] → (Z, tokens per step, length, first page, valid pages, steps)."""
    block_size, length = pages_ref.shape[1], lens_ref[0]
    return (block_size, pages_per_block * block_size, length,
            *split_pages(pl.program_id(2), length, block_size=block_size, pages_per_block=pages_per_block,
                         pages_per_split=pages_per_split, max_blocks=max_blocks, window=window))


def in_view(pos, length, window: int | None):
    """bool[block_k]: the step's positions the decode query sees (before its length; within its window)."""
    valid = pos < length
    if window is not None:  # the first page in view may start before the window
        valid = valid & (pos >= length - window)
    return valid


def step_pages(tables_ref, step, n_pages, first_page, block_size, pages_per_block):
    """Physical pages and token positions of one step of pages_per_block pages."""
    local = step * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
    pages = tables_ref[pl.ds(first_page + step * pages_per_block, pages_per_block)]  # i32[pages_per_block]
    # Entries past the sequence's last page may be garbage: never let one address memory.
    pages = jnp.where(local < n_pages, pages, NULL_BLOCK)
    block_k = pages_per_block * block_size
    pos = (first_page + step * pages_per_block) * block_size + jnp.arange(block_k, dtype=jnp.int32)
    return pages, pos  # pos: i32[block_k] token positions of this step


def online_softmax_step(carry, logits, valid, v, compute_dtype, precision):
    """Fold one step's f32 logits [block_h, block_k] and values [block_k, H] (MLA: [block_k, kv_lora_rank])
    into (o, m, l)."""
    o, m, l = carry
    logits = jnp.where(valid[None, :], logits, MASK_VALUE)
    m_new = jnp.maximum(m, logits.max(axis=-1))  # every step holds >= 1 valid token: finite
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(logits - m_new[:, None])  # masked slots: exp(MASK - m) = 0
    l = alpha * l + p.sum(axis=-1)

    def fold(o_, v_):
        return alpha[:, None] * o_ + dot_f32(p.astype(compute_dtype), v_, contract_b=0, precision=precision)

    o = tuple(map(fold, o, v)) if isinstance(v, tuple) else fold(o, v)  # nvfp4: even and odd lanes apart
    return o, m_new, l


def write_partial(o_ref, lse_ref, o, m, l, out_scale):
    """Store out / sum (× the V or latent dequant scale) and logsumexp; an empty split: 0, -inf."""
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    for ref, o_ in (zip(o_ref, o) if isinstance(o_ref, tuple) else [(o_ref, o)]):  # nvfp4: two lane planes
        ref[...] = jnp.where(seen[:, None], o_ / l_safe[:, None], 0.0) * out_scale
    lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def split_inputs(table_width: int) -> list:
    """in_specs of a split-K decode kernel's per-sequence inputs, for its (sequence, head block,
    split) program: the context length and the sequence's padded block table."""
    return [pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, table_width), lambda b, h, s: (b, 0))]


def split_outputs(batch: int, head_blocks: int, num_splits: int, block_h: int, width: int) -> dict:
    """pallas_call's out_specs and out_shape for a split-K decode kernel: per (sequence, head
    block, split) program, the partial output f32[block_h, width] and its log-sum-exp
    f32[block_h], which `merge_splits` combines."""
    return dict(out_specs=[pl.BlockSpec((None, None, None, block_h, width), lambda b, h, s: (b, h, s, 0, 0)),
                           pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0))],
                out_shape=[jax.ShapeDtypeStruct((batch, head_blocks, num_splits, block_h, width), jnp.float32),
                           jax.ShapeDtypeStruct((batch, head_blocks, num_splits, block_h), jnp.float32)])
