"""Per-token-head pages (int8_per_token_head, fp8_per_token_head) in the Pallas decode kernels
(Mosaic GPU: kvjax.attention.mgpu_decode; Triton: pallas_decode) against float64 NumPy.

The stored bytes are drawn directly — int8 or e4m3 values and an f32 scale per token and kv head,
as vLLM's `_reshape_cache_per_token_head` would leave them — so the oracle (x × scale in float64,
then test_pallas_variants' attention loop with windows, sinks and softcap) shares nothing with
kvjax's quantizer. Every slot a kernel must not read has a NaN scale (and NaN e4m3 bytes), table
entries past a sequence's last page are garbage, tables are permuted; with a window, the pages
wholly before it are poisoned too. Tolerances: the dot dtype's, relative to the largest value
(the kernels round x × scale once to q's dtype).

Mosaic GPU runs under its CPU interpreter by default, Triton in interpret mode; `JAX_PLATFORMS=cuda
KVJAX_INTERPRET=0` compiles both on a GPU.
"""
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.attention import mgpu_decode, pallas_decode
from kvjax.attention.tiles import DecodeTiles, MosaicDecodeTiles

from test_pallas_variants import VARIANTS, decode64

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {BF16: 1e-2, F16: 1e-2, F32: 1e-5}
slow = pytest.mark.slow


def build(seed, fmt, batch, group, kv_heads, head_dim, z, lens, window=None):
    """q f32[B, N, H]; K/V pages and f32[P, Z, K] scale pages (NaN scales in every unread slot);
    tables; the true K/V per sequence in f64 ([n, K, H])."""
    rng = np.random.default_rng(seed)
    blocks = [-(-n // z) for n in lens]
    num_pages = 1 + sum(blocks) + 3
    tables = rng.integers(-1000, num_pages + 1000, size=(batch, max(blocks) + 1)).astype(np.int32)
    physical = rng.permutation(np.arange(1, num_pages))
    storage = np.int8 if fmt == "int8_per_token_head" else ml_dtypes.float8_e4m3fn
    out = {}
    for name in ("k", "v"):
        page = (rng.integers(-128, 128, (num_pages, z, kv_heads, head_dim)).astype(np.int8) if storage is np.int8 else
                np.full((num_pages, z, kv_heads, head_dim), np.nan, np.float32).astype(storage))  # garbage, NaN
        scales = np.full((num_pages, z, kv_heads), np.nan, np.float32)
        used, dense = 0, []
        for b, n in enumerate(lens):
            tables[b, :blocks[b]] = physical[used:used + blocks[b]]
            used += blocks[b]
            if storage is np.int8:
                x = rng.integers(-128, 128, (n, kv_heads, head_dim)).astype(np.int8)
            else:
                x = np.clip(rng.standard_normal((n, kv_heads, head_dim)) * 100, -448, 448).astype(storage)
            s = rng.uniform(0.002, 0.05, (n, kv_heads)).astype(np.float32)
            for t in range(n):
                page[tables[b, t // z], t % z], scales[tables[b, t // z], t % z] = x[t], s[t]
            dense.append(x.astype(np.float64) * s[..., None].astype(np.float64))
            for i in range(0 if window is None else max(0, n - window) // z):  # freed before the window
                scales[tables[b, i]] = np.nan
        out[name] = (page, scales, dense)
    q = rng.standard_normal((batch, group * kv_heads, head_dim)).astype(np.float32)
    return q, out, tables


def _run(impl, case, tiles):
    fmt, batch, group, kv_heads, head_dim, z, q_dtype, window, variant = case
    lens = [1, 3 * z, 5 * z + 1][-batch:]
    q, kv, tables = build(head_dim + z + group, fmt, batch, group, kv_heads, head_dim, z, lens, window)
    with_sinks, softcap = VARIANTS[variant]
    sinks = np.random.default_rng(5).normal(0.5, 1.5, q.shape[1]).astype(np.float32) if with_sinks else None
    scale = head_dim ** -0.5
    q_in = jnp.asarray(q).astype(q_dtype)
    want = decode64(q_in, kv["k"][2], kv["v"][2], lens, scale, window, sinks, softcap)
    out = impl.paged_decode(q_in, jnp.asarray(kv["k"][0]), jnp.asarray(kv["v"][0]), jnp.asarray(tables),
                            jnp.asarray(lens, np.int32), scale=scale, k_scale=jnp.asarray(kv["k"][1]),
                            v_scale=jnp.asarray(kv["v"][1]), window=window, sinks=sinks, softcap=softcap,
                            kv_dtype=fmt, tiles=tiles, interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q_dtype
    out = np.asarray(out.astype(F32), np.float64)
    assert np.isfinite(out).all(), "an unread slot (NaN scale) leaked"
    vmax = max(np.abs(v).max() for v in kv["v"][2])
    np.testing.assert_allclose(out, want, rtol=TOL[q_dtype], atol=TOL[q_dtype] * vmax)


# (format, batch, group, kv heads, head dim, Z, q dtype, window, variant) + Mosaic tiles (ppb, splits, stages)
MOSAIC_CASES = [
    (("int8_per_token_head", 2, 1, 8, 64, 16, BF16, None, "plain"), (4, 2, 2)),
    pytest.param(("fp8_per_token_head", 2, 2, 8, 32, 8, F16, 13, "sinks+softcap"), (8, 1, 3), marks=slow),
    pytest.param(("int8_per_token_head", 3, 2, 16, 64, 64, BF16, None, "softcap"), (1, 3, 2), marks=slow),
]


@pytest.mark.parametrize("case, tiles", MOSAIC_CASES, ids=lambda c: "-".join(map(str, c)) if len(c) == 3 else
                         "{}-B{}-G{}-K{}-H{}-Z{}-{}-w{}-{}".format(*c[:6], jnp.dtype(c[6]).name, *c[7:]))
def test_mosaic_reads_per_token_pages(case, tiles):
    _run(mgpu_decode, case, MosaicDecodeTiles(*tiles))


TRITON_CASES = [
    ("int8_per_token_head", 2, 2, 2, 32, 16, BF16, 20, "sinks+softcap"),
    ("fp8_per_token_head", 3, 1, 2, 64, 8, F32, None, "plain"),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "{}-B{}-G{}-K{}-H{}-Z{}-{}-w{}-{}".format(
    *c[:6], jnp.dtype(c[6]).name, *c[7:]))
def test_triton_reads_per_token_pages(case):
    _run(pallas_decode, case, DecodeTiles(pages_per_block=2, num_splits=2, block_h=16))


@pytest.mark.parametrize("kw, match", [
    (dict(kv_heads=4), "K must be a multiple of 8"),
    (dict(k_scale=None), r"k_scale f32\[5, 16, 8\]"),
    (dict(dtype=jnp.float8_e4m3fn), "int8_per_token_head pages are int8"),
])
def test_bad_per_token_inputs(kw, match):
    kv_heads, dtype = kw.pop("kv_heads", 8), kw.pop("dtype", jnp.int8)
    pages = jnp.zeros((5, 16, kv_heads, 64), dtype)
    scales = dict(k_scale=jnp.ones((5, 16, kv_heads)), v_scale=jnp.ones((5, 16, kv_heads)))
    with pytest.raises(ValueError, match=match):
        mgpu_decode.paged_decode(jnp.zeros((1, kv_heads, 64), BF16), pages, pages, jnp.zeros((1, 2), jnp.int32),
                                 jnp.ones((1,), jnp.int32), scale=1.0, **{**scales, **kw},
                                 kv_dtype="int8_per_token_head", interpret=INTERPRET)
