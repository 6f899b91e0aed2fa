"""The Mosaic GPU paged-decode kernel (kvjax.attention.mgpu_decode) against the float64 NumPy oracles
of the Triton kernel's tests, with their tolerances.

The same builders as tests/attention/test_pallas_decode.py and test_pallas_variants.py: every
slot the kernel must not read holds NaN (unused pages, the null block, slots past a length, a
window's slots and vLLM's null blocks before it), table entries past a sequence's last page are
random garbage, tables are permuted. Cases differ from the Triton ones where the kernels' rules
differ: queries bf16 / f16 (wgmma has no exact f32 product), pages of a multiple of 8 tokens and
64-256 tokens a step.

Runs under Mosaic GPU's CPU interpreter (kvjax.attention.mgpu_interpret) by default, which takes
about 2 s to compile each kernel variant: the quick cases cover each dtype, scale mode, variant
and tile rule once. On a GPU, `JAX_PLATFORMS=cuda KVJAX_INTERPRET=0` compiles them instead.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.mgpu_decode import paged_decode
from kvjax.attention.tiles import MosaicDecodeTiles, default_mosaic_tiles

from test_pallas_decode import BF16, E4M3, E5M2, F16, assert_close, gqa_numpy, make_gqa
from test_pallas_variants import VARIANTS, build, decode64
from test_pallas_variants import assert_close as assert_close_variant

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")
slow = pytest.mark.slow

# (batch, group, kv_heads, head_dim, block_size, pages_per_block, splits, stages, q dtype, page dtype,
#  scale mode, m: the block multiple in the lengths 1, Z·m, Z·m + 1)
GQA_CASES = [
    (3, 4, 2, 64, 16, 4, 1, 2, BF16, BF16, None, 5),
    (3, 7, 1, 128, 16, 4, 3, 3, BF16, E4M3, "per_head", 9),
    (3, 1, 4, 64, 8, 8, 2, 2, BF16, E5M2, "per_tensor", 11),
    pytest.param((1, 16, 1, 64, 32, 4, 4, 2, F16, F16, None, 7), marks=slow),
    (3, 2, 2, 32, 64, 1, 2, 3, BF16, E4M3, "per_head", 3),
    pytest.param((3, 8, 1, 128, 16, 8, 2, 2, BF16, BF16, None, 20), marks=slow),  # 128 tokens a step
    pytest.param((2, 4, 2, 256, 16, 4, 2, 2, BF16, BF16, None, 6), marks=slow),  # head dim 256
    pytest.param((3, 64, 1, 64, 16, 4, 1, 2, BF16, E5M2, "per_head", 4), marks=slow),  # a full 64-row group
    pytest.param((3, 4, 2, 64, 16, 16, 1, 2, F16, E4M3, "per_tensor", 17), marks=slow),  # 256 tokens a step
]


def _case_id(c):
    c = c.values[0] if hasattr(c, "values") else c
    return "B{}-G{}-K{}-H{}-Z{}-p{}-S{}-st{}-{}-{}-{}".format(*c[:8], jnp.dtype(c[8]).name, jnp.dtype(c[9]).name,
                                                               c[10])


@pytest.mark.parametrize("case", GQA_CASES, ids=_case_id)
def test_gqa_kernel_matches_numpy(case):
    batch, group, kv_heads, head_dim, block_size, ppb, splits, stages, q_dtype, page_dtype, mode, m = case
    q, kv, tables, lens = make_gqa(100 * batch + 10 * group + m, batch, group, kv_heads, head_dim, block_size, q_dtype,
                                   page_dtype, mode, m)
    scale = head_dim ** -0.5
    want, vmax = gqa_numpy(np.asarray(q.astype(np.float32)), kv, tables, lens, scale)
    out = paged_decode(jnp.asarray(q), jnp.asarray(kv["k"][0]), jnp.asarray(kv["v"][0]), jnp.asarray(tables),
                       jnp.asarray(lens), scale=scale, k_scale=kv["k"][1], v_scale=kv["v"][1],
                       tiles=MosaicDecodeTiles(ppb, splits, stages), interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, want, q_dtype, vmax)


# (Z, group, kv heads, pages_per_block, splits, window, variant, page dtype): q is bf16
VARIANT_CASES = [
    (16, 4, 2, 4, 3, 17, "sinks+softcap", BF16),
    (8, 2, 2, 8, 2, None, "sinks", E4M3),
    (16, 8, 1, 4, 1, 1, "softcap", BF16),
    pytest.param((8, 1, 4, 8, 4, 9, "plain", BF16), marks=slow),
    pytest.param((16, 4, 2, 4, 2, 1000, "sinks+softcap", E4M3), marks=slow),
    pytest.param((16, 2, 2, 4, 4, 16, "sinks", BF16), marks=slow),
]


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: "Z{}-G{}-K{}-p{}-S{}-W{}-{}-{}".format(
    *(c.values[0] if hasattr(c, "values") else c)[:7], jnp.dtype((c.values[0] if hasattr(c, "values") else c)[7]).name))
def test_variants_match_numpy(case):
    """Sliding windows (vLLM's null blocks before them hold NaN), sinks merged once, softcap."""
    z, group, kv_heads, ppb, splits, window, name, page_dtype = case
    q, k_pages, v_pages, tables, lens, keys, values, deq = build(z + group + ppb + splits, z, group, kv_heads, window,
                                                                 BF16, page_dtype)
    with_sinks, softcap = VARIANTS[name]
    sinks = np.random.default_rng(7).normal(0.5, 1.5, q.shape[1]).astype(np.float32) if with_sinks else None
    scale = q.shape[-1] ** -0.5
    want = decode64(q, keys, values, lens, scale, window, sinks, softcap)
    out = paged_decode(*[jnp.asarray(a) for a in (q, k_pages, v_pages, tables, lens)], scale=scale, k_scale=deq,
                       v_scale=deq, window=window, sinks=sinks, softcap=softcap,
                       tiles=MosaicDecodeTiles(ppb, splits, 2), interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_variant(out, want, BF16, values)
    assert not np.asarray(out[0], np.float32).any(), "a padding row (length 0) gets zero, sink or not"


def test_default_tiles_zero_lengths_and_outer_jit():
    """No tiles given (default_mosaic_tiles); padding sequences (length 0) give zeros; jit around it."""
    q, kv, tables, lens = make_gqa(3, 3, 4, 2, 64, 16, BF16, BF16, None, 3)
    lens = np.array([0, lens[1], lens[2]], np.int32)
    want, vmax = gqa_numpy(np.asarray(q, np.float32)[1:], kv, tables[1:], lens[1:], 0.125)
    args = [jnp.asarray(a) for a in (q, kv["k"][0], kv["v"][0], tables, lens)]
    out = jax.jit(lambda *a: paged_decode(*a, scale=0.125, interpret=INTERPRET))(*args)
    assert not np.asarray(out[0], np.float32).any()
    assert_close(out[1:], want, BF16, vmax)


def test_default_mosaic_tiles_follow_the_shape():
    long_small = default_mosaic_tiles(batch=1, row_blocks=8, block_size=16, max_blocks=2048, bytes_per_token=512)
    big_batch = default_mosaic_tiles(batch=128, row_blocks=8, block_size=16, max_blocks=2048, bytes_per_token=512)
    assert long_small.num_splits > 8 and big_batch.num_splits == 1
    assert long_small.pages_per_block * 16 == 128 and long_small.stages >= 2
    mla = default_mosaic_tiles(batch=1, row_blocks=1, block_size=64, max_blocks=512, bytes_per_token=1152)
    assert mla.pages_per_block == 1 and mla.num_splits > 1
    for tiles, z in ((long_small, 16), (big_batch, 16), (mla, 64)):
        tiles.check(block_size=z)


def _args(**override):
    args = dict(q=jnp.zeros((2, 8, 64), BF16), k_pages=jnp.zeros((5, 16, 2, 64), BF16),
                v_pages=jnp.zeros((5, 16, 2, 64), BF16), block_tables=jnp.zeros((2, 3), jnp.int32),
                context_lens=jnp.ones((2,), jnp.int32))
    args.update(override)
    return args


@pytest.mark.parametrize("override, kwargs, match", [
    (dict(q=jnp.zeros((2, 8, 64, 1), BF16)), {}, r"q must be \[B, N, H\]"),
    (dict(k_pages=jnp.zeros((5, 16, 128), BF16)), {}, r"k_pages must be \[P, Z, K, H\]"),
    (dict(v_pages=jnp.zeros((5, 16, 2, 64), F16)), {}, "v_pages"),
    (dict(q=jnp.zeros((2, 8, 128), BF16)), {}, "head dim of q"),
    (dict(q=jnp.zeros((2, 7, 64), BF16)), {}, "multiple of kv heads"),
    (dict(q=jnp.zeros((2, 8, 64), jnp.float32)), {}, "no exact f32 product"),
    (dict(k_pages=jnp.zeros((5, 16, 2, 64), F16), v_pages=jnp.zeros((5, 16, 2, 64), F16)), {},
     "k_pages dtype float16 unsupported with bfloat16 queries"),
    (dict(k_pages=jnp.zeros((5, 4, 2, 64), BF16), v_pages=jnp.zeros((5, 4, 2, 64), BF16)), {},
     "block size 4 must be a multiple of 8"),
    (dict(q=jnp.zeros((2, 8, 24), BF16), k_pages=jnp.zeros((5, 16, 2, 24), BF16),
          v_pages=jnp.zeros((5, 16, 2, 24), BF16)), {}, "head dim 24 must be a multiple of 16"),
    (dict(q=jnp.zeros((2, 130, 64), BF16)), dict(tiles=MosaicDecodeTiles(4, 1)), "exceeds the 64 rows"),
    (dict(block_tables=jnp.zeros((3, 3), jnp.int32)), {}, "block_tables must be"),
    ({}, dict(k_scale=jnp.ones((3,))), r"k_scale must be a scalar or \[2\]"),
    ({}, dict(tiles=MosaicDecodeTiles(2, 1)), "= 32 tokens per step; the wgmma tiles need 64, 128 or 256"),
    ({}, dict(tiles=MosaicDecodeTiles(4, 1, 1)), "stages must be >= 2"),
    ({}, dict(tiles=MosaicDecodeTiles(4, 0)), "num_splits must be a positive int"),
    ({}, dict(tiles=MosaicDecodeTiles(16, 1, 8)), "bytes of shared memory"),
    ({}, dict(kv_dtype="int8_per_token_head"), "int8_per_token_head pages are int8"),
])
def test_bad_inputs(override, kwargs, match):
    with pytest.raises(ValueError, match=match):
        paged_decode(**_args(**override), scale=1.0, **kwargs, interpret=INTERPRET)
