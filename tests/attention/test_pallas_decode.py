"""The Pallas paged-decode kernels (GQA and MLA) against a plain-NumPy dense attention in float64.

The reference here is independent of kvjax: it gathers each sequence's tokens through its block
table in NumPy, dequantizes (stored.astype(f64) × scale) and does softmax attention in float64.
Kernels see the same stored values, so the tolerance is accumulation-level, per dtype of the
dots (f32 q: 1e-5; bf16 q: 2e-2), relative to the largest dequantized value — not fp8
quantization error. Every slot a kernel must not read (unused pages, the null block 0, slots
past a sequence's length) holds NaN, and table entries past a sequence's last page are random
garbage, so a single stray read shows up as NaN or a wrong value.

Runs in interpret mode on CPU; `KVJAX_INTERPRET=0` runs the compiled kernels (GPU machine).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.pallas_decode import paged_decode, paged_decode_reference
from kvjax.attention.pallas_mla import mla_paged_decode, mla_paged_decode_reference
from kvjax.attention.tiles import DecodeTiles, default_mla_tiles, default_tiles

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TOL = {F32: 1e-5, BF16: 1e-2, F16: 2e-3}  # by q dtype (the dot dtype; fp8 pages are exact in it)


# ------------------------------------------------------------------------------------ builders

def lens_for(batch, block_size, m):
    """Ragged lengths: 1, a block multiple, a block multiple + 1."""
    return [1, block_size * m, block_size * m + 1][-batch:]


def store(x, dtype, scale):
    """What the cache holds for true values x with dequant scale (fp8: saturating cast of x / scale)."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(E4M3), jnp.dtype(E5M2)):
        fmax = float(jnp.finfo(dtype).max)
        return np.clip(x / scale, -fmax, fmax).astype(dtype)
    return (x / scale).astype(dtype)


def build_pages(rng, lens, block_size, tail_shape, dtype, make_values, extra_pages=3):
    """Pages [P, Z, *tail] full of NaN, each sequence's tokens written through a permuted table.

    make_values(n) → f32[n, *tail] true values; returns (pages, block_tables i32[B, M]).
    """
    blocks = [-(-n // block_size) for n in lens]
    max_blocks = max(blocks) + 1  # one more column: every row ends in garbage entries
    num_pages = 1 + sum(blocks) + extra_pages  # + the null block 0
    pages = np.full((num_pages, block_size, *tail_shape), np.nan, np.float32).astype(dtype)
    physical = rng.permutation(np.arange(1, num_pages))
    tables = rng.integers(-1000, num_pages + 1000, size=(len(lens), max_blocks)).astype(np.int32)
    tables[rng.random(tables.shape) < 0.3] = 0
    used = 0
    for b, n in enumerate(lens):
        tables[b, :blocks[b]] = physical[used:used + blocks[b]]
        used += blocks[b]
        values = make_values(n)
        for t in range(n):
            pages[tables[b, t // block_size], t % block_size] = values[t]
    return pages, tables


def gather_numpy(pages, table, n, scale):
    """f64[n, *tail]: a sequence's first n tokens, through its table, dequantized."""
    z = pages.shape[1]
    rows = [pages[table[t // z], t % z] for t in range(n)]
    return np.stack(rows).astype(np.float64) * np.asarray(scale, np.float64)


def softmax_attend(q, k, v, scale):
    """q f64[R, D], k f64[S, D], v f64[S, Dv] → f64[R, Dv]."""
    logits = scale * q @ k.T
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def assert_close(out, want, q_dtype, value_scale):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf: a masked or unused slot leaked"
    tol = TOL[q_dtype]
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * value_scale)


def scales_for(rng, dtype, mode, n):
    """(true-value magnitudes f32[n], dequant scale passed to the kernel, scale per channel f32[n])."""
    mags = rng.uniform(0.5, 4.0, n).astype(np.float32)
    fp8 = jnp.dtype(dtype) in (jnp.dtype(E4M3), jnp.dtype(E5M2))
    if mode is None:
        return mags, None, np.ones(n, np.float32)
    per_tensor = mode == "per_tensor"  # else one scale per kv head (GQA) or latent channel (MLA)
    amax = np.full(n, 4.0 * mags.max(), np.float32) if per_tensor else 4.0 * mags  # values are clipped at 4σ
    per = (amax / float(jnp.finfo(dtype).max)).astype(np.float32) if fp8 else (amax / 8).astype(np.float32)
    return mags, (float(per[0]) if per_tensor else per), per


# ------------------------------------------------------------------------------------------ GQA

# (batch, group, kv_heads, head_dim, block_size, pages_per_block, splits, q dtype, page dtype,
#  scale mode, m: the block multiple in the lengths 1, Z·m, Z·m + 1)
GQA_CASES = [
    (1, 1, 2, 64, 16, 1, 1, F32, F32, None, 2),
    (3, 2, 2, 128, 4, 4, 4, F32, F32, None, 23),
    (3, 4, 2, 64, 64, 1, 1, BF16, BF16, None, 2),
    (1, 7, 2, 128, 16, 2, 4, BF16, BF16, "per_head", 11),
    (3, 7, 1, 64, 4, 8, 1, F32, E4M3, "per_head", 9),
    (3, 1, 4, 128, 16, 1, 4, F32, E5M2, "per_head", 6),
    (1, 4, 2, 128, 64, 1, 4, F32, E4M3, "per_tensor", 5),
    (3, 2, 2, 64, 16, 2, 4, BF16, E4M3, "per_head", 10),
    (1, 2, 2, 64, 4, 4, 1, BF16, E5M2, "per_tensor", 6),
    (3, 16, 1, 64, 16, 1, 4, BF16, BF16, None, 5),
    (3, 4, 2, 64, 4, 4, 4, F32, BF16, None, 13),
    (1, 4, 2, 64, 16, 1, 1, F16, F16, None, 3),
]


def make_gqa(seed, batch, group, kv_heads, head_dim, block_size, q_dtype, page_dtype, mode, m):
    rng = np.random.default_rng(seed)
    lens = lens_for(batch, block_size, m)
    n_heads = group * kv_heads
    out = {}
    for name in ("k", "v"):
        mags, arg, per = scales_for(rng, page_dtype, mode, kv_heads)
        gen = lambda n: np.clip(rng.standard_normal((n, kv_heads, head_dim)), -4, 4).astype(np.float32) * mags[:, None]
        make = lambda n: store(gen(n), page_dtype, per[:, None])
        pages, tables = build_pages(np.random.default_rng(seed + 1), lens, block_size, (kv_heads, head_dim),
                                    jnp.dtype(page_dtype), make)
        out[name] = (pages, arg, per)
    q = rng.standard_normal((batch, n_heads, head_dim)).astype(np.float32)
    return q.astype(q_dtype), out, tables, np.asarray(lens, np.int32)


def gqa_numpy(q, kv, tables, lens, scale):
    (k_pages, _, k_per), (v_pages, _, v_per) = kv["k"], kv["v"]
    batch, n_heads, _ = q.shape
    kv_heads = k_pages.shape[2]
    group = n_heads // kv_heads
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        k = gather_numpy(k_pages, tables[b], lens[b], k_per[:, None])  # [S, K, H]
        v = gather_numpy(v_pages, tables[b], lens[b], v_per[:, None])
        for h in range(kv_heads):
            rows = slice(h * group, (h + 1) * group)
            out[b, rows] = softmax_attend(np.asarray(q[b, rows], np.float64), k[:, h], v[:, h], scale)
    vmax = max(np.abs(gather_numpy(v_pages, tables[b], lens[b], v_per[:, None])).max() for b in range(batch))
    return out, vmax


@pytest.mark.parametrize("case", GQA_CASES, ids=lambda c: "B{}-G{}-K{}-H{}-Z{}-p{}-S{}-{}-{}-{}".format(
    *c[:7], jnp.dtype(c[7]).name, jnp.dtype(c[8]).name, c[9]))
def test_gqa_kernel_matches_numpy(case):
    batch, group, kv_heads, head_dim, block_size, ppb, splits, q_dtype, page_dtype, mode, m = case
    q, kv, tables, lens = make_gqa(GQA_CASES.index(case), batch, group, kv_heads, head_dim, block_size, q_dtype,
                                   page_dtype, mode, m)
    scale = head_dim ** -0.5
    want, vmax = gqa_numpy(np.asarray(q.astype(np.float32)), kv, tables, lens, scale)
    tiles = DecodeTiles(pages_per_block=ppb, num_splits=splits, block_h=max(16, 1 << (group - 1).bit_length()))
    out = paged_decode(jnp.asarray(q), jnp.asarray(kv["k"][0]), jnp.asarray(kv["v"][0]), jnp.asarray(tables),
                       jnp.asarray(lens), scale=scale, k_scale=kv["k"][1], v_scale=kv["v"][1], tiles=tiles,
                       interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, want, q_dtype, vmax)


@pytest.mark.parametrize("case", [GQA_CASES[4], GQA_CASES[6]], ids=["e4m3-per-head", "e4m3-per-tensor"])
def test_gqa_reference_matches_numpy(case):
    batch, group, kv_heads, head_dim, block_size, _, _, q_dtype, page_dtype, mode, m = case
    q, kv, tables, lens = make_gqa(7, batch, group, kv_heads, head_dim, block_size, q_dtype, page_dtype, mode, m)
    want, vmax = gqa_numpy(np.asarray(q, np.float32), kv, tables, lens, 0.1)
    out = paged_decode_reference(jnp.asarray(q), jnp.asarray(kv["k"][0]), jnp.asarray(kv["v"][0]),
                                 jnp.asarray(tables), jnp.asarray(lens), scale=0.1, k_scale=kv["k"][1],
                                 v_scale=kv["v"][1], kv_dtype="fp8_e4m3")  # the format the pages carry in a cache
    assert_close(out, want, q_dtype, vmax)


def test_gqa_default_tiles_and_outer_jit():
    """No tiles given: default_tiles picks them; the public function also works inside jit."""
    q, kv, tables, lens = make_gqa(3, 3, 4, 2, 64, 16, F32, BF16, None, 3)
    want, vmax = gqa_numpy(q, kv, tables, lens, 0.125)
    args = [jnp.asarray(a) for a in (q, kv["k"][0], kv["v"][0], tables, lens)]
    out = paged_decode(*args, scale=0.125, interpret=INTERPRET)
    assert_close(out, want, F32, vmax)
    jitted = jax.jit(lambda *a: paged_decode(*a, scale=0.125, interpret=INTERPRET))
    assert_close(jitted(*args), want, F32, vmax)


def test_gqa_zero_length_sequence_gives_zeros():
    """A padding sequence (context length 0, as the model's batch padding has) must not give NaN."""
    q, kv, tables, lens = make_gqa(5, 3, 2, 2, 64, 16, F32, F32, None, 2)
    lens = np.array([0, lens[1], 0], np.int32)
    want, vmax = gqa_numpy(q[1:2], kv, tables[1:2], lens[1:2], 0.125)
    for splits in (1, 4):
        out = np.asarray(paged_decode(jnp.asarray(q), jnp.asarray(kv["k"][0]), jnp.asarray(kv["v"][0]),
                                      jnp.asarray(tables), jnp.asarray(lens), scale=0.125,
                                      tiles=DecodeTiles(1, splits, 16), interpret=INTERPRET))
        assert (out[0] == 0).all() and (out[2] == 0).all()
        assert_close(out[1:2], want, F32, vmax)


# ------------------------------------------------------------------------------------------ MLA

RANK, ROPE = 512, 64
# (batch, heads, block_h, block_size, pages_per_block, splits, q dtype, page dtype, scale mode, m)
MLA_CASES = [
    (1, 16, 16, 16, 1, 1, F32, F32, None, 2),
    (3, 16, 16, 4, 4, 4, BF16, BF16, None, 13),
    (3, 8, 16, 64, 1, 4, F32, E4M3, "per_channel", 5),
    (1, 32, 16, 16, 2, 1, BF16, E5M2, "per_channel", 4),
    (3, 16, 16, 16, 1, 4, F32, E5M2, "per_tensor", 6),
    (3, 4, 16, 4, 8, 1, F32, E4M3, "per_channel", 9),
]


def make_mla(seed, batch, heads, block_size, q_dtype, page_dtype, mode, m):
    rng = np.random.default_rng(seed)
    lens = lens_for(batch, block_size, m)
    channels = RANK + ROPE
    mags, arg, per = scales_for(rng, page_dtype, mode, channels)
    gen = lambda n: np.clip(rng.standard_normal((n, channels)), -4, 4).astype(np.float32) * mags
    make = lambda n: store(gen(n), page_dtype, per)
    pages, tables = build_pages(np.random.default_rng(seed + 1), lens, block_size, (channels,),
                                jnp.dtype(page_dtype), make)
    q_latent = (rng.standard_normal((batch, heads, RANK)) * 0.1).astype(np.float32).astype(q_dtype)
    q_rope = rng.standard_normal((batch, heads, ROPE)).astype(np.float32).astype(q_dtype)
    return q_latent, q_rope, (pages, arg, per), tables, np.asarray(lens, np.int32)


def mla_numpy(q_latent, q_rope, latent, tables, lens, scale):
    pages, _, per = latent
    out = np.zeros(q_latent.shape, np.float64)
    vmax = 0.0
    for b in range(len(lens)):
        if lens[b] == 0:  # a padding sequence: zero output
            continue
        c = gather_numpy(pages, tables[b], lens[b], per)  # [S, C]
        q = np.concatenate([q_latent[b], q_rope[b]], axis=-1).astype(np.float64)  # [N, C]
        out[b] = softmax_attend(q, c, c[:, :RANK], scale)
        vmax = max(vmax, np.abs(c[:, :RANK]).max())
    return out, vmax


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: "B{}-N{}-bh{}-Z{}-p{}-S{}-{}-{}-{}".format(
    *c[:6], jnp.dtype(c[6]).name, jnp.dtype(c[7]).name, c[8]))
def test_mla_kernel_matches_numpy(case):
    batch, heads, block_h, block_size, ppb, splits, q_dtype, page_dtype, mode, m = case
    ql, qr, latent, tables, lens = make_mla(100 + MLA_CASES.index(case), batch, heads, block_size, q_dtype, page_dtype,
                                            mode, m)
    scale = (128 + ROPE) ** -0.5
    want, vmax = mla_numpy(np.asarray(ql, np.float32), np.asarray(qr, np.float32), latent, tables, lens, scale)
    out = mla_paged_decode(jnp.asarray(ql), jnp.asarray(qr), jnp.asarray(latent[0]), jnp.asarray(tables),
                           jnp.asarray(lens), scale=scale, latent_scale=latent[1],
                           tiles=DecodeTiles(ppb, splits, block_h), interpret=INTERPRET)
    assert out.shape == ql.shape and out.dtype == ql.dtype
    assert_close(out, want, q_dtype, vmax)


def test_mla_reference_and_defaults():
    """The jnp reference and the kernel with default tiles both match NumPy; length 0 gives zeros."""
    ql, qr, latent, tables, lens = make_mla(11, 3, 16, 16, F32, E4M3, "per_channel", 3)
    lens = np.array([lens[0], 0, lens[2]], np.int32)
    want, vmax = mla_numpy(ql, qr, latent, tables, lens, 0.07)
    args = [jnp.asarray(a) for a in (ql, qr, latent[0], tables, lens)]
    ref = mla_paged_decode_reference(*args, scale=0.07, latent_scale=latent[1], kv_dtype="fp8_e4m3")
    assert_close(ref, want, F32, vmax)
    out = mla_paged_decode(*args, scale=0.07, latent_scale=latent[1], interpret=INTERPRET)
    assert_close(out, want, F32, vmax)


# ---------------------------------------------------------------------------------- tile rules

def test_default_tiles_follow_the_shape():
    long_small = default_tiles(batch=1, num_kv_heads=8, group=4, head_dim=128, block_size=16, max_blocks=2048)
    big_batch = default_tiles(batch=128, num_kv_heads=8, group=4, head_dim=128, block_size=16, max_blocks=2048)
    assert long_small.num_splits > 8 and big_batch.num_splits == 1
    assert long_small.pages_per_block * 16 == 128 and long_small.block_h == 16
    assert default_tiles(batch=1, num_kv_heads=1, group=7, head_dim=64, block_size=4,
                         max_blocks=1).pages_per_block * 4 >= 16
    assert default_tiles(batch=1, num_kv_heads=1, group=32, head_dim=64, block_size=16, max_blocks=8).block_h == 32
    mla = default_mla_tiles(batch=1, num_heads=128, kv_lora_rank=512, block_size=64, max_blocks=512)
    assert mla.block_h == 64 and mla.num_splits > 1 and mla.pages_per_block == 1
    for t in (long_small, big_batch, mla):
        t.check(block_size=16)


# ------------------------------------------------------------------------------ bad inputs

def _gqa_args(**override):
    args = dict(q=jnp.zeros((2, 8, 64), F32), k_pages=jnp.zeros((5, 16, 2, 64), BF16),
                v_pages=jnp.zeros((5, 16, 2, 64), BF16), block_tables=jnp.zeros((2, 3), jnp.int32),
                context_lens=jnp.ones((2,), jnp.int32))
    args.update(override)
    return args


@pytest.mark.parametrize("override, kwargs, match", [
    (dict(q=jnp.zeros((2, 8, 64, 1))), {}, r"q must be \[B, N, H\]"),
    (dict(k_pages=jnp.zeros((5, 16, 128), BF16)), {}, r"k_pages must be \[P, Z, K, H\]"),
    (dict(v_pages=jnp.zeros((5, 16, 2, 64), F32)), {}, "v_pages"),
    (dict(q=jnp.zeros((2, 8, 128))), {}, "head dim of q"),
    (dict(q=jnp.zeros((2, 7, 64))), {}, "multiple of kv heads"),
    (dict(block_tables=jnp.zeros((3, 3), jnp.int32)), {}, "block_tables must be"),
    (dict(block_tables=jnp.zeros((2, 3), F32)), {}, "integer"),
    (dict(context_lens=jnp.ones((2, 1), jnp.int32)), {}, "context_lens must be"),
    (dict(k_pages=jnp.zeros((5, 16, 2, 64), jnp.int8), v_pages=jnp.zeros((5, 16, 2, 64), jnp.int8)), {},
     "k_pages dtype int8 unsupported"),
    (dict(q=jnp.zeros((2, 8, 64), jnp.int32)), {}, "q dtype int32 unsupported"),
    (dict(q=jnp.zeros((2, 8, 96)), k_pages=jnp.zeros((5, 16, 2, 96)), v_pages=jnp.zeros((5, 16, 2, 96))), {},
     "head dim 96 must be a power of two"),
    ({}, dict(k_scale=jnp.ones((3,))), r"k_scale must be a scalar or \[2\]"),
    ({}, dict(v_scale=jnp.ones((2,), jnp.int32)), "v_scale must be floating"),
    ({}, dict(tiles=DecodeTiles(1, 1, 16)), None),  # valid: the control case
    ({}, dict(tiles=DecodeTiles(3, 1, 16)), "pages_per_block must be a power of two"),
    ({}, dict(tiles=DecodeTiles(1, 1, 8)), "block_h must be a power of two >= 16"),
    (dict(q=jnp.zeros((2, 64, 64))), dict(tiles=DecodeTiles(1, 1, 16)), "smaller than the query group of 32"),
    (dict(k_pages=jnp.zeros((5, 4, 2, 64)), v_pages=jnp.zeros((5, 4, 2, 64))), dict(tiles=DecodeTiles(2, 1, 16)),
     "Triton dots need >= 16"),
    ({}, dict(tiles=DecodeTiles(1, 0, 16)), "num_splits must be a positive int"),
])
def test_gqa_bad_inputs(override, kwargs, match):
    args = _gqa_args(**override)
    if match is None:
        paged_decode(**args, scale=1.0, **kwargs, interpret=INTERPRET)
        return
    with pytest.raises(ValueError, match=match):
        paged_decode(**args, scale=1.0, **kwargs, interpret=INTERPRET)


def _mla_args(**override):
    args = dict(q_latent=jnp.zeros((2, 16, 64), F32), q_rope=jnp.zeros((2, 16, 16), F32),
                latent_pages=jnp.zeros((5, 16, 80), BF16), block_tables=jnp.zeros((2, 3), jnp.int32),
                context_lens=jnp.ones((2,), jnp.int32))
    args.update(override)
    return args


@pytest.mark.parametrize("override, kwargs, match", [
    (dict(q_latent=jnp.zeros((2, 16))), {}, r"q_latent and q_rope must be"),
    (dict(q_rope=jnp.zeros((2, 8, 16))), {}, "must share B, N and dtype"),
    (dict(q_rope=jnp.zeros((2, 16, 16), BF16)), {}, "must share B, N and dtype"),
    (dict(latent_pages=jnp.zeros((5, 16, 1, 80))), {}, r"latent_pages must be \[P, Z, C\]"),
    (dict(latent_pages=jnp.zeros((5, 16, 96))), {}, "C=96 must equal kv_lora_rank"),
    (dict(q_latent=jnp.zeros((2, 16, 48)), latent_pages=jnp.zeros((5, 16, 64))), {},
     "kv_lora_rank 48 must be a power of two"),
    (dict(block_tables=jnp.zeros((1, 3), jnp.int32)), {}, "block_tables must be"),
    (dict(latent_pages=jnp.zeros((5, 16, 80), jnp.int8)), {}, "latent_pages dtype int8 unsupported"),
    ({}, dict(latent_scale=jnp.ones((64,))), r"latent_scale must be a scalar or \[80\]"),
    ({}, dict(tiles=DecodeTiles(1, 1, 24)), "block_h must be a power of two"),
])
def test_mla_bad_inputs(override, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mla_paged_decode(**_mla_args(**override), scale=1.0, **kwargs, interpret=INTERPRET)
