"""Attention over nvfp4 pages: the Pallas decode kernel (interpret mode on CPU) and the jnp
reference against a float64 NumPy attention over the same stored bytes, and against each other
elementwise.

Pages are uint8 [P, Z, K, H/2 + H/16] (kvjax.quant.nvfp4's packed layout, vLLM's). The NumPy side
decodes them on its own (a table of the eight E2M1 magnitudes, ml_dtypes' e4m3 for the block
scales; tests/nvfp4_numpy.py), so the kernels are checked on what the bytes mean, not on kvjax's decoder. Every slot a
kernel must not read holds the byte 0x7F, whose block scale is e4m3's NaN: a stray read turns
the output NaN. Tolerances are those of tests/attention/test_pallas_decode.py (the dot dtype's
accumulation, relative to the largest value): nvfp4's values times their block scales are exact
in bf16 as in f32, so quantization error is not in them.

Stated tolerance between kernel and reference on nvfp4 pages: |kernel − reference| ≤ tol ×
(1 + |reference|) elementwise, tol 1e-5 for f32 queries and 1e-2 for bf16.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from nvfp4_numpy import decode as decode_numpy

from kvjax.attention.pallas_decode import paged_decode, paged_decode_reference
from kvjax.attention.tiles import DecodeTiles
from kvjax.errors import KvjaxError
from kvjax.quant import nvfp4

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: 1e-5, BF16: 1e-2}
def build(seed, batch, group, kv_heads, head_dim, block_size, lens, tensor_scale):
    """q f32[B, N, H], K/V pages, tables, and the true (dequantized) K/V per sequence in f64."""
    rng = np.random.default_rng(seed)
    blocks = [-(-n // block_size) for n in lens]
    m = max(blocks) + 1
    num_pages = 1 + sum(blocks) + 3
    width = nvfp4.packed_width(head_dim)
    tables = rng.integers(-1000, num_pages + 1000, size=(batch, m)).astype(np.int32)  # garbage past the end
    physical = rng.permutation(np.arange(1, num_pages))
    pages, dense = {}, {}
    for name in ("k", "v"):
        page = np.full((num_pages, block_size, kv_heads, width), 0x7F, np.uint8)  # unread slots decode to NaN
        used, rows = 0, []
        for b, n in enumerate(lens):
            tables[b, :blocks[b]] = physical[used:used + blocks[b]]
            used += blocks[b]
            x = (rng.standard_normal((n, kv_heads, head_dim)) * rng.uniform(0.2, 3.0, (1, kv_heads, 1)))
            x[:, :, 3] *= 8  # one larger channel: blocks with different scales
            packed = np.asarray(nvfp4.quantize(jnp.asarray(x, F32), 1.0 / np.asarray(tensor_scale)[:, None]))
            for t in range(n):
                page[tables[b, t // block_size], t % block_size] = packed[t]
            rows.append(decode_numpy(packed) * np.asarray(tensor_scale, np.float64)[:, None])
        pages[name], dense[name] = page, rows
    q = rng.standard_normal((batch, group * kv_heads, head_dim)).astype(np.float32)
    return q, pages, tables, dense


def attend_numpy(q, dense, lens, scale, group, window=None):
    out = np.zeros(q.shape)
    for b, n in enumerate(lens):
        lo = 0 if window is None else max(0, n - window)
        k, v = dense["k"][b][lo:n], dense["v"][b][lo:n]
        for n_head in range(q.shape[1]):
            h = n_head // group
            logits = scale * (k[:, h] @ q[b, n_head].astype(np.float64))
            w = np.exp(logits - logits.max())
            out[b, n_head] = (w / w.sum()) @ v[:, h]
    return out


CASES = [  # (batch, group, kv heads, head dim, block size, pages per block, splits, q dtype, per-head scales, window)
    (2, 2, 2, 64, 16, 2, 2, BF16, False, None),
    (3, 1, 2, 32, 8, 2, 2, F32, True, 13),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-G{}-K{}-H{}-Z{}-p{}-S{}-{}-{}-w{}".format(
    *c[:7], jnp.dtype(c[7]).name, "head" if c[8] else "unit", c[9]))
def test_kernel_and_reference_read_nvfp4_pages(case):
    batch, group, kv_heads, head_dim, z, ppb, splits, q_dtype, per_head, window = case
    lens = [1, 3 * z, 5 * z + 1][-batch:]
    tensor_scale = np.array([0.5, 2.0][:kv_heads] if per_head else [1.0] * kv_heads, np.float32)
    q, pages, tables, dense = build(CASES.index(case), batch, group, kv_heads, head_dim, z, lens, tensor_scale)
    scale = head_dim ** -0.5
    q_in = jnp.asarray(q).astype(q_dtype)
    want = attend_numpy(np.asarray(q_in.astype(F32)), dense, lens, scale, group, window)
    args = (q_in, jnp.asarray(pages["k"]), jnp.asarray(pages["v"]), jnp.asarray(tables), jnp.asarray(lens, np.int32))
    kw = dict(scale=scale, k_scale=jnp.asarray(tensor_scale), v_scale=jnp.asarray(tensor_scale), window=window,
              kv_dtype="nvfp4")  # the format the pages carry in a cache (KVPages.kv_dtype)
    tiles = DecodeTiles(pages_per_block=ppb, num_splits=splits, block_h=16)
    kernel = np.asarray(paged_decode(*args, **kw, tiles=tiles).astype(F32), np.float64)
    reference = np.asarray(paged_decode_reference(*args, **kw).astype(F32), np.float64)
    tol = TOL[q_dtype]
    vmax = max(np.abs(v).max() for v in dense["v"])
    for out in (kernel, reference):
        assert np.isfinite(out).all(), "an unread slot (NaN block scale) leaked"
        np.testing.assert_allclose(out, want, rtol=tol, atol=tol * vmax)
    assert np.all(np.abs(kernel - reference) <= tol * (1 + np.abs(reference)))


def test_bad_pages_are_refused():
    q = jnp.zeros((1, 2, 64), F32)
    pages = jnp.zeros((4, 16, 2, 64), jnp.uint8)  # 64 bytes per head: not H/2 + H/16 = 36
    tables, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="H/2 \\+ H/16"):
        paged_decode(q, pages, pages, tables, lens, scale=1.0, kv_dtype="nvfp4")
    # the pages' format is named, never guessed from their dtype: uint8 pages without it, or nvfp4 with bf16 pages
    with pytest.raises(ValueError, match="uint8 pages nvfp4's"):
        paged_decode(q, pages, pages, tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="uint8 pages nvfp4's"):
        paged_decode(q, jnp.zeros((4, 16, 2, 64), jnp.bfloat16), jnp.zeros((4, 16, 2, 64), jnp.bfloat16), tables,
                     lens, scale=1.0, kv_dtype="nvfp4")
    with pytest.raises(KvjaxError, match="need their kv_dtype"):
        paged_decode_reference(q, pages, pages, tables, lens, scale=1.0)
