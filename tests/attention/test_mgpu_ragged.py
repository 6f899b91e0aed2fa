"""The Mosaic GPU ragged paged-attention kernel (kvjax.attention.mgpu_ragged) against float64 NumPy.

A mixed step as tests/ragged_cases.py builds them, at the Mosaic kernels' page sizes (Z of 8 or
16, head dim 64): chunks after a cached prefix (one starting mid-page), prompts longer than an item,
a decode token, a one-token prompt, a padding row, sequences in rows out of token order, permuted
tables, lengths that do not fill their last page, NaN in every slot no query may read, and vLLM's
sliding tables (null blocks before a window). The oracle scores each token against its own
sequence's dequantized positions in float64, token by token. Tolerance: the bf16 one of the Triton
kernels' tests (bf16 / f16 queries only: wgmma).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_cases import garbage_tables, layout

from kvjax.attention.mgpu_ragged import ragged_paged_attention
from kvjax.attention.reference import paged_attention_reference
from kvjax.attention.tiles import MosaicRaggedTiles

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")
slow = pytest.mark.slow
BF16, F16, E4M3, E5M2 = jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2
# (cached, new) of each sequence and its row (row 4 is padding): a chunk after a prefix starting
# mid-page, a prompt over two items, a decode token, a one-token prompt. The slow cases add longer
# ones (the CPU interpreter takes about 1.5 s per program of this kernel's two warpgroups).
SEQS = [(21, 13), (0, 18), (45, 1), (0, 1)]
ROWS = [3, 0, 1, 2]
LONG_SEQS = [(40, 37), (0, 70), (130, 1), (7, 20), (0, 1), (16, 3)]
LONG_ROWS = [3, 0, 5, 1, 2, 6]
TOL = 1e-2


def make_step(seed, z, kv_heads, group, head_dim, q_dtype, page_dtype, window, long=False):
    """(q [T, N, H], k_pages, v_pages, metadata, k_scale, v_scale, f64 keys, f64 values): pages hold NaN
    wherever no query of the step may read."""
    seqs, rows = (LONG_SEQS, LONG_ROWS) if long else (SEQS, ROWS)
    max_tokens, max_seqs = (160, 8) if long else (40, 5)
    rng = np.random.default_rng(seed)
    tables, sliding, num_pages, readable = layout(seqs, window, extra=2, z=z, rng=rng)
    fp8 = jnp.dtype(page_dtype) in (jnp.dtype(E4M3), jnp.dtype(E5M2))
    pages, scales, true = [], [], []
    for _ in range(2):
        scale = rng.uniform(0.05, 0.2, kv_heads).astype(np.float32) if fp8 else None
        values = rng.standard_normal((num_pages, z, kv_heads, head_dim)).astype(np.float32)
        stored = (values * 8 if fp8 else values)
        stored = np.where(readable[:, :, None, None], stored, np.nan).astype(page_dtype)
        pages.append(jnp.asarray(stored))
        scales.append(None if scale is None else jnp.asarray(scale))
        true.append(np.asarray(stored.astype(np.float32), np.float64) * (1.0 if scale is None else scale[:, None]))
    md = garbage_tables(seqs, rows, tables, sliding, z=z, max_tokens=max_tokens, max_seqs=max_seqs, rng=rng)
    q = jnp.asarray(rng.standard_normal((max_tokens, kv_heads * group, head_dim)), q_dtype)
    return q, pages[0], pages[1], md, scales[0], scales[1], true[0], true[1]


def attention_numpy(q, keys, values, md, z, scale, window=None, sinks=None, softcap=None):
    """f64 [T, N, H]: each valid token over its own sequence's positions <= its own (window: > pos - W)."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    heads, kv_heads = q.shape[1], keys.shape[2]
    tables, lens = np.asarray(md.block_tables), np.asarray(md.context_lens)
    out = np.zeros(q.shape)
    for t in range(q.shape[0]):
        if not md.valid[t]:
            continue
        b, pos = int(md.seq_ids[t]), int(md.positions[t])
        s = np.arange(min(pos + 1, lens[b]))
        if window is not None:
            s = s[s > pos - window]
        pages, slots = tables[b][s // z], s % z
        for n in range(heads):
            h = n // (heads // kv_heads)
            logits = keys[pages, slots, h] @ q[t, n] * scale
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            peak = logits.max(initial=-np.inf if sinks is None else float(sinks[n]))
            w = np.exp(logits - peak)
            denom = w.sum() + (0.0 if sinks is None else np.exp(float(sinks[n]) - peak))
            out[t, n] = w @ values[pages, slots, h] / denom
    return out


# (Z, kv heads, group, head dim, pages_per_block, stages, q dtype, page dtype, window, sinks, softcap, long)
CASES = [
    (16, 1, 4, 64, 4, 2, BF16, BF16, None, False, None, False),
    (8, 1, 4, 64, 8, 2, BF16, E4M3, 17, True, 2.0, False),
    pytest.param((16, 1, 2, 32, 8, 2, F16, F16, 5, False, None, False), marks=slow),
    pytest.param((16, 4, 1, 128, 4, 3, BF16, E5M2, None, True, None, True), marks=slow),  # MHA, 3 stages
    pytest.param((8, 1, 7, 64, 16, 2, BF16, BF16, 1, False, 1.5, True), marks=slow),  # group 7 → 8, block_kv 128
    pytest.param((16, 2, 4, 64, 4, 2, BF16, E4M3, 70, False, None, True), marks=slow),
]


def _v(c):
    return c.values[0] if hasattr(c, "values") else c


@pytest.mark.parametrize("case", CASES, ids=lambda c: "Z{}-K{}-G{}-H{}-p{}-st{}-{}-{}-W{}-sinks{}-cap{}-long{}".format(
    *_v(c)[:6], jnp.dtype(_v(c)[6]).name, jnp.dtype(_v(c)[7]).name, *_v(c)[8:]))
def test_kernel_matches_numpy(case):
    z, kv_heads, group, head_dim, ppb, stages, q_dtype, page_dtype, window, with_sinks, softcap, long = case
    q, k_pages, v_pages, md, k_scale, v_scale, keys, values = make_step(z + group + head_dim, z, kv_heads, group,
                                                                        head_dim, q_dtype, page_dtype, window, long)
    sinks = jnp.asarray(np.random.default_rng(3).normal(0.5, 1.5, q.shape[1]), jnp.float32) if with_sinks else None
    scale = head_dim ** -0.5
    kv_dtype = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(jnp.dtype(page_dtype).name)
    fn = lambda *a: ragged_paged_attention(*a, scale=scale, k_scale=k_scale, v_scale=v_scale, window=window,  # noqa
                                           sinks=sinks, softcap=softcap, kv_dtype=kv_dtype,
                                           tiles=MosaicRaggedTiles(ppb, stages), interpret=INTERPRET)
    got = np.asarray(jax.jit(fn)(q, k_pages, v_pages, md).astype(jnp.float32), np.float64)
    assert got.shape == q.shape
    assert np.isfinite(got).all(), "an unread slot leaked"
    want = attention_numpy(q, keys, values, md, z, scale, window, None if sinks is None else np.asarray(sinks),
                           softcap)
    vmax = np.nanmax(np.abs(values))
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * vmax)
    assert not got[int(np.asarray(md.valid).sum()):].any(), "padding tokens attend to nothing"


@slow
def test_equals_the_reference_with_default_tiles():
    q, k_pages, v_pages, md, k_scale, v_scale, _, values = make_step(9, 16, 1, 4, 64, BF16, E4M3, None)
    kw = dict(scale=0.125, k_scale=k_scale, v_scale=v_scale, kv_dtype="fp8_e4m3")
    got = jax.jit(lambda *a: ragged_paged_attention(*a, **kw, interpret=INTERPRET))(q, k_pages, v_pages, md)
    want = jax.jit(lambda *a: paged_attention_reference(*a, **kw))(q, k_pages, v_pages, md)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=TOL,
                               atol=TOL * np.nanmax(np.abs(values)))


@pytest.mark.parametrize("change, match", [
    (dict(q_dtype=jnp.float32), "no exact f32 product"),
    (dict(kv_dtype="int8_per_token_head"), "2 kv heads: .* K must be a multiple of 8"),
    (dict(tiles=MosaicRaggedTiles(2)), "MosaicRaggedTiles: pages_per_block × block_size = 2 × 16"),
    (dict(tiles=MosaicRaggedTiles(4, 1)), "MosaicRaggedTiles.stages must be >= 2"),
    (dict(window=0), "window"),
])
def test_bad_input_is_refused_by_name(change, match):
    q, k_pages, v_pages, md, *_ = make_step(1, 16, 2, 2, 64, BF16, BF16, None)
    q = q.astype(change.pop("q_dtype", q.dtype))
    if change.get("kv_dtype") == "int8_per_token_head":
        k_pages = v_pages = jnp.zeros(k_pages.shape, jnp.int8)
        change.update(k_scale=jnp.ones(k_pages.shape[:3]), v_scale=jnp.ones(k_pages.shape[:3]))
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(q, k_pages, v_pages, md, scale=1.0, interpret=INTERPRET, **change)
