"""The pieces kvjax's Mosaic GPU decode kernels share (mgpu_decode's GQA kernel, mgpu_mla's).

A decode program of these kernels is one CUDA block of one warpgroup (128 threads) that owns one
sequence, one row block (GQA: the query heads of one kv head; MLA: a tile of heads) and one split
of the sequence's pages in view, as the Triton kernels' programs do (kvjax.attention.pallas_steps).
What differs is how pages arrive and how the products run, the Hopper way (JAX's
`jax/experimental/pallas/ops/gpu/attention_mgpu.py`):

- **Pages by TMA into a ring of SMEM slots.** The split's slice of the block table is copied
  once into SMEM (GQA decode; the kernels with a producer warpgroup, mgpu_mla and mgpu_ragged,
  read page ids from GMEM there instead, off the compute's path); each step's pages_per_block
  pages are then copied by the tensor-memory
  accelerator, one async copy per page `k_pages.at[page, :, h]` (a [Z, H] box of the
  [P, Z, K, H] array), into rows j·Z … (j+1)·Z of a slot, all completing on the slot's barrier
  (one arrival per copy). `stages` slots are in flight: the slot a step has consumed is refilled
  with the step `stages` ahead before the next step waits, so HBM streams while the warpgroup
  computes. A step past the sequence's last page copies the null block (never read: masked).
- **wgmma from SMEM.** S = Q·Kᵀ with Q [64, H] and the K slot [block_kv, H] read transposed,
  then O += P·V with P (the probabilities, cast to the dot dtype) stored into SMEM [64, block_kv]
  and the V slot. 64 rows is wgmma's M: a GQA group of G heads uses G of them (the rest are zero
  queries whose outputs are dropped); decode is bound by the bytes of K/V, not by these products.
- **The online softmax in registers** (WGMMA layout), in base 2 (exp2 of log2e-scaled logits,
  as attention_mgpu does), f32, with the masks of pallas_steps.in_view on the step's positions.
- **Unreadable slots stay out.** Logits outside the view are replaced (select, not multiply) by
  MASK_VALUE, so NaN keys never matter; a V row outside the view would, since 0 × NaN is NaN in
  the tensor core: a step whose positions are not all in view (the split's last step past the
  length, a window's first step, a step of the null block) zeroes those V rows in SMEM before
  P·V. Every other step reads only full pages in view and skips it.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention.mgpu_interpret import require_mgpu
from kvjax.attention.pallas_steps import MASK_VALUE
from kvjax.core.block_pool import NULL_BLOCK

LOG2E = math.log2(math.e)
ROWS = 64  # wgmma's M: query rows of one program
TMA_BOX = 256  # the most elements a TMA box spans in one dimension


def swizzle_bytes(minor: int, dtype) -> int:
    """The widest SMEM swizzle (32, 64 or 128 bytes) a row of `minor` elements fills."""
    row = minor * jnp.dtype(dtype).itemsize
    for swizzle in (128, 64, 32):
        if row % swizzle == 0:
            return swizzle
    raise ValueError(f"a row of {minor} × {jnp.dtype(dtype).name} ({row} bytes) is no multiple of 32 bytes")


F16_MAX = 65504.0


def dot_dtype(q_dtype, page_dtype):
    """The wgmma input dtype: q's for pages of q's dtype; f16 for fp8 pages, whatever q's dtype.

    Hopper converts e4m3 / e5m2 to f16 in one instruction per pair and has no direct fp8 → bf16
    conversion (Mosaic GPU goes through f32: three), and every fp8 value is exact in f16, so fp8
    pages are widened to f16 and a bf16 query is cast to f16 to meet them: exact for |q| in
    [2^-14, 65504] (f16's normal range; bf16 has fewer mantissa bits), clipped at 65504 above and
    rounded to f16's subnormals below, where a component adds under 2^-24 × |k| to a logit.
    """
    return jnp.dtype(jnp.float16) if jnp.dtype(page_dtype) != jnp.dtype(q_dtype) else jnp.dtype(q_dtype)


def to_dot_dtype(q, dtype):
    """q in the dot dtype (`dot_dtype`): clipped into f16's range when that is a narrowing."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float16) and jnp.dtype(q.dtype) != jnp.dtype(jnp.float16):
        q = jnp.clip(q.astype(jnp.float32), -F16_MAX, F16_MAX)
    return q.astype(dtype)


def tiled_smem(shape, dtype, swizzle: int | None = None):
    """SMEM scratch [..., rows, minor] in the tiled, swizzled layout TMA and wgmma read (swizzle:
    the widest a row fills unless given; a wgmma's two SMEM operands must share theirs)."""
    plgpu = require_mgpu()
    swizzle = swizzle or swizzle_bytes(shape[-1], dtype)
    tile = (8, swizzle // jnp.dtype(dtype).itemsize)
    return plgpu.SMEM(tuple(shape), dtype, transforms=(plgpu.TilingTransform(tile), plgpu.SwizzleTransform(swizzle)))


def copy_table(tables_ref, b, first_page, table_smem, barrier):
    """Start copying the split's table entries into SMEM, from tables[b, first_page rounded down to
    a multiple of 4] (a bulk copy starts on a 16-byte boundary: an unaligned start is an illegal
    instruction on the H200, which the interpreter does not check), in boxes of <= TMA_BOX entries,
    each one arrival on `barrier`. Returns the SMEM index of entry first_page."""
    plgpu = require_mgpu()
    lead = lax.rem(first_page, 4)
    start = first_page - lead
    width = table_smem.shape[0]
    for lo in range(0, width, TMA_BOX):
        n = min(TMA_BOX, width - lo)
        plgpu.copy_gmem_to_smem(tables_ref.at[b, pl.ds(start + lo, n)], table_smem.at[pl.ds(lo, n)], barrier)
    return lead


def table_width(pages_per_split: int) -> int:
    """SMEM entries of a split's table slice: pages_per_split + 3 (the aligned start's lead),
    rounded up to 32 (a TMA copy into SMEM moves a multiple of 128 bytes, one per thread of the
    warpgroup that waits on it)."""
    return -(-(pages_per_split + 3) // 32) * 32


def table_boxes(width: int) -> int:
    """Arrivals `copy_table` makes for a table slice of `width` entries."""
    return -(-width // TMA_BOX)


def issue_pages(page_of, step, n_pages, pages_per_block: int, block_size: int, copies):
    """Start the TMA copies of one step's pages. page_of(i): the physical page of the split's
    i-th page (read from the table); `copies`: [(page → GMEM ref [Z, ...], SMEM slot
    [block_kv, ...], barrier)]; entries past the split's n_pages copy the null block."""
    plgpu = require_mgpu()
    pages = [page_of(step * pages_per_block + j) for j in range(pages_per_block)]  # all loads in flight at once
    for j, page in enumerate(pages):
        page = jnp.where(step * pages_per_block + j < n_pages, page, NULL_BLOCK)
        for src, slot, barrier in copies:
            plgpu.copy_gmem_to_smem(src(page), slot.at[pl.ds(j * block_size, block_size)], barrier)


def qk_logits(q_smem, k_slot, rows: int, block_kv: int):
    """f32[rows, block_kv] = Q · Kᵀ (wgmma, K slot read transposed), WGMMA layout."""
    plgpu = require_mgpu()

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_slot.transpose((1, 0)))  # plgpu.transpose_ref, deprecated in 0.11
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((rows, block_kv), jnp.float32))


def pv_product(p_smem, v_slot, rows: int, width: int):
    """f32[rows, width] = P · V (wgmma from SMEM), WGMMA layout."""
    plgpu = require_mgpu()

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_slot)
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((rows, width), jnp.float32))


def positions(shape, axis: int, first):
    """i32 iota along `axis` of a WGMMA-layout array of `shape`, plus `first`."""
    plgpu = require_mgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA) + first


def visible(pos, length, window: int | None):
    """bool: positions the decode query at length - 1 sees (pallas_steps.in_view)."""
    ok = pos < length
    if window is not None:
        ok = ok & (pos >= length - window)
    return ok


def zero_rows_outside(v_slot, pos0, length, window: int | None):
    """Zero the rows of a [block_kv, width] V slot whose positions pos0 + r are out of the decode
    query's view, in place, when there are any (module docstring: 0 × NaN)."""
    zero_rows_outside_span(v_slot, pos0, 0 if window is None else length - window, length)


def zero_rows_outside_span(v_slot, pos0, lo, hi):
    """Zero the rows of a [block_kv, width] V slot whose positions pos0 + r fall outside [lo, hi),
    in place, when the slot has any."""
    block_kv = v_slot.shape[0]

    @pl.when((pos0 < lo) | (pos0 + block_kv > hi))
    def _():
        rows = positions(v_slot.shape, 0, pos0)
        v_slot[...] = jnp.where((rows >= lo) & (rows < hi), v_slot[...], jnp.zeros((), v_slot.dtype))


def softmax_init(rows: int, width: int):
    """(o, m, l) = (0 f32[rows, width], MASK_VALUE f32[rows], 0 f32[rows]) in the layouts the
    products and their row reductions give."""
    plgpu = require_mgpu()
    wgmma, row = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
    return (plgpu.layout_cast(jnp.zeros((rows, width), jnp.float32), wgmma),
            plgpu.layout_cast(jnp.full((rows,), MASK_VALUE, jnp.float32), row),
            plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row))


def softmax_step(m, l, logits2, ok):
    """One step of the online softmax on base-2 logits f32[rows, block_kv] (already × log2e)
    where `ok`: → (p f32[rows, block_kv], alpha f32[rows], m, l)."""
    logits2 = jnp.where(ok, logits2, MASK_VALUE)
    m_new = jnp.maximum(m, logits2.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    # Masked: exp2(MASK - m) = 0, except in a row that has seen nothing yet (m = MASK): select.
    p = jnp.where(ok, jnp.exp2(logits2 - lax.broadcast_in_dim(m_new, logits2.shape, [0])), 0.0)
    return p, alpha, m_new, l * alpha + p.sum(axis=1)


def rescale(o, alpha, pv):
    """o · alpha (per row) + pv."""
    return o * lax.broadcast_in_dim(alpha, o.shape, [0]) + pv


def finish(o, m, l):
    """(o / l, natural-log logsumexp) per row; a row that saw nothing: (0, -inf)."""
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = o / lax.broadcast_in_dim(l_safe, o.shape, [0])
    lse = jnp.where(seen, (m + jnp.log2(l_safe)) / LOG2E, -jnp.inf)
    return out, lse


OUT_COLS = 128  # output columns staged in SMEM at a time (f32[64, 128]: 32 KiB)


def store_partial(out, lse, o_smem, lse_smem, o_dst, lse_dst, rows_out: int):
    """Write a split's rows [:rows_out] of (out f32[64, width], lse f32[64]) to GMEM through SMEM
    (o_smem f32[64, min(width, OUT_COLS)]: wider outputs go in column chunks)."""
    plgpu = require_mgpu()
    chunk = o_smem.shape[1]
    lse_smem[...] = lse
    for lo in range(0, out.shape[1], chunk):
        o_smem[...] = out[:, lo:lo + chunk] if out.shape[1] > chunk else out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], o_dst.at[:, pl.ds(lo, chunk)])
        if lo == 0:
            plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows_out)], lse_dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem is rewritten next
    plgpu.wait_smem_to_gmem(0)
