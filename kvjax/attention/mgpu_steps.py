"""The pieces kvjax's Mosaic GPU kernels share: mgpu_decode's GQA kernel, mgpu_mla's, and the ragged
kernels (mgpu_ragged, mgpu_ragged_nvfp4), whose programs add a producer warpgroup and whose work
items are laid out by the last section here.

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

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.attention.metadata import BatchMetadata
from kvjax.attention.mgpu_interpret import require_mgpu
from kvjax.attention.pallas_decode import merge_splits
from kvjax.attention.pallas_ragged import padded_work_items
from kvjax.attention.pallas_steps import MASK_VALUE
from kvjax.core.block_pool import NULL_BLOCK
from kvjax.math_utils import cdiv, pow2_bucket

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


def scale_rows(tile, scales, h):
    """f32 tile[t, :] × scales[t, h] for a [block_kv, H] slot of per-token-head pages and its
    f32[block_kv, K] scales (every head's: a page's [Z, K] scale box, since a [Z] column of one
    head is no TMA box): head h's column is picked by a select and a row sum, which leaves it in
    the layout that broadcasts along the tile's rows (a select, so other heads' NaN never matters)."""
    plgpu = require_mgpu()
    wgmma = plgpu.Layout.WGMMA
    every = plgpu.layout_cast(scales[...], wgmma)  # f32[block_kv, K]
    mine = jnp.where(positions(every.shape, 1, 0) == h, every, 0.0).sum(axis=1)  # f32[block_kv]
    x = plgpu.layout_cast(tile[...], wgmma).astype(jnp.float32)
    return x * lax.broadcast_in_dim(mine, x.shape, [0])


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


# ------------------------------------------------------- the ragged kernels (prefill / mixed steps)
# A ragged program (mgpu_ragged, mgpu_ragged_nvfp4) owns one work item — 64 / G' new tokens of one
# sequence × the G' query heads of one kv head — and has two warpgroups: a producer issuing the
# TMA copies (`produce`) and a consumer running the products and the softmax with `seen`'s masks.
# The items are laid out and their rows gathered and scattered outside the kernel (`work_items`).


@dataclasses.dataclass(frozen=True)
class RaggedStatic:
    """What one launch of a ragged kernel (mgpu_ragged's, mgpu_ragged_nvfp4's) is specialized on."""

    block_size: int
    pages_per_block: int
    stages: int
    group_shift: int  # log2 G'
    window: int | None
    softcap: float | None
    widen: bool  # fp8 / int8 pages: widen each slot into a 16-bit tile before the products
    per_token: bool = False  # scales per token and kv head: applied while widening

    @property
    def block_kv(self) -> int:
        return self.pages_per_block * self.block_size


class Item(NamedTuple):
    """One work item's scalars, read from its meta row in the kernel."""

    tokens: jax.Array  # its new tokens (0: an item past the step's last)
    length: jax.Array  # its sequence's context length
    first_pos: jax.Array  # its first row's position
    seq: jax.Array  # its sequence's row of the block table
    span_lo: jax.Array  # the positions any of its rows may see: [span_lo, span_hi)
    span_hi: jax.Array
    lo_step: jax.Array  # the kv block holding span_lo
    n_steps: jax.Array  # kv blocks it walks
    first_page: jax.Array  # the table entry of step 0's first page
    live_pages: jax.Array  # table entries from first_page that hold pages (past them: garbage)


def item_of(meta_ref, w, c) -> Item:
    """Item w's scalars (meta_ref i32[W, 4]: tokens, context length, first row's position, sequence row)."""
    tokens, length, first_pos, seq = meta_ref[w, 0], meta_ref[w, 1], meta_ref[w, 2], meta_ref[w, 3]
    span_lo = 0 if c.window is None else jnp.maximum(first_pos - c.window + 1, 0)
    span_hi = jnp.minimum(first_pos + tokens, length)
    lo_step = lax.div(span_lo, c.block_kv)
    n_steps = jnp.where(tokens > 0, jnp.maximum(pl.cdiv(span_hi, c.block_kv) - lo_step, 0), 0)
    first_page = lo_step * c.pages_per_block
    return Item(tokens, length, first_pos, seq, span_lo, span_hi, lo_step, n_steps, first_page,
                pl.cdiv(length, c.block_size) - first_page)


def produce(n_steps, stages: int, issue, consumed_bars) -> None:
    """The producer's (memory warpgroup's) loop over n_steps steps: issue(step, slot) starts a step's
    copies; the first `stages` steps go at once, each later one into the slot its consumers
    released (consumed_bars[slot]); then the last releases are observed too (a barrier's every
    phase is, which the interpreter checks)."""
    plgpu = require_mgpu()
    for i in range(stages):
        pl.when(i < n_steps)(functools.partial(issue, i, i))

    @pl.loop(0, jnp.maximum(n_steps - stages, 0))
    def _refill(step):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(consumed_bars.at[slot])
        issue(step + stages, slot)

    @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
    def _drain(step):
        plgpu.barrier_wait(consumed_bars.at[lax.rem(step, stages)])


def row_positions(item: Item, c):
    """i32[64, block_kv]: row r's position, first_pos + r // G', along each row (WGMMA layout)."""
    return lax.shift_right_logical(positions((ROWS, c.block_kv), 0, 0), c.group_shift) + item.first_pos


def seen(item: Item, c, row_pos, pos):
    """bool[64, block_kv]: row r (at row_pos[r]) sees position pos[r, j] (pallas_ragged's masks)."""
    ok = (row_pos < item.first_pos + item.tokens) & (pos <= row_pos) & (pos < item.length)
    return ok if c.window is None else ok & (pos > row_pos - c.window)


def softcapped(logits2, softcap: float | None):
    """Gemma 2's c · tanh(x / c) on base-2 logits (the cap scaled alike)."""
    if softcap is None:
        return logits2
    cap = softcap * LOG2E
    return cap * jnp.tanh(logits2 / cap)


class Items(NamedTuple):
    """A launch's work items, laid out outside the kernel (pallas_ragged.padded_work_items)."""

    meta: jax.Array  # i32[W, 4]: `item_of`'s row
    tables: jax.Array  # i32[B, M + pages_per_block]: null-padded by a block
    idx: jax.Array  # i32[W, Tq]: each item's tokens (T past an item's last: dropped)
    tq: int  # tokens an item: 64 / G'
    gp: int  # G'


def work_items(md: BatchMetadata, t: int, group: int, pages_per_block: int) -> Items:
    """The work items of a step of t tokens whose group of G query heads pads to G' (a launch's Items)."""
    gp = pow2_bucket(group)
    tq = ROWS // gp
    num_items = cdiv(t, tq) + md.num_seqs
    seq, first, tokens = padded_work_items(md, tq, num_items)
    meta = jnp.stack([tokens, md.context_lens[seq], md.positions[first], seq], axis=1).astype(jnp.int32)
    tables = jnp.pad(md.block_tables.astype(jnp.int32), ((0, 0), (0, pages_per_block)), constant_values=NULL_BLOCK)
    idx = first[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]
    idx = jnp.where(jnp.arange(tq, dtype=jnp.int32)[None, :] < tokens[:, None], idx, t)
    return Items(meta, tables, idx, tq, gp)


def item_rows(x, items: Items):
    """[T, K, G, d] → [W, K, 64, d]: each item's rows (padding heads and tokens zero)."""
    t, kv_heads, group, d = x.shape
    x = jnp.pad(x, ((0, 1), (0, 0), (0, items.gp - group), (0, 0)))[items.idx]  # [W, Tq, K, G', d]
    return x.transpose(0, 2, 1, 3, 4).reshape(items.idx.shape[0], kv_heads, ROWS, d)


def scatter_rows(o, lse, items: Items, *, sinks, v_scale, group: int, t: int, dtype):
    """The kernel's (o f32[W, K, 64, H], lse f32[W, K, 64]) → [T, K, G, H] in dtype, with the sinks
    (once per row, from its logsumexp, as pallas_ragged) and V's static scale."""
    num_items, kv_heads, _, head_dim = o.shape
    if sinks is not None:  # sinks f32[K, G]
        sinks = jnp.pad(sinks, ((0, 0), (0, items.gp - group)), constant_values=-jnp.inf)
        sink_rows = jnp.broadcast_to(sinks[None, :, None, :], (num_items, kv_heads, items.tq, items.gp)).reshape(
            num_items, kv_heads, 1, ROWS)
        o = merge_splits(o[:, :, None], lse[:, :, None], axis=2, sinks=sink_rows)
    o = o * v_scale[None, :, None, None]
    o = o.reshape(num_items, kv_heads, items.tq, items.gp, head_dim)[:, :, :, :group].transpose(0, 2, 1, 3, 4)
    out = jnp.zeros((t + 1, kv_heads, group, head_dim), dtype)
    return out.at[items.idx].set(o.astype(dtype), mode="drop")[:t]
