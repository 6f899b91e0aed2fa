"""The Mosaic GPU ragged kernel (kvjax.attention.mgpu_ragged, mgpu_ragged_nvfp4) on per-token-head and
nvfp4 pages, against float64 NumPy.

Steps as tests/attention/test_mgpu_ragged.py builds them — a chunk after a cached prefix starting
mid-page (the default cases, under a window; the slow ones add a prompt over several items, a
decode token, a one-token prompt, rows out of token order and a padding row), permuted tables,
garbage past each table's end, vLLM's null blocks before a window — with the pages of
test_mgpu_per_token.py and test_mgpu_nvfp4.py: per-token int8 / e4m3 values and f32 scales drawn
directly (the oracle is x × scale in float64), nvfp4 written by kvjax's quantizer and decoded on
the NumPy side from the layout alone (tests/nvfp4_numpy.py). Every slot no query of the step may
read is poisoned: a NaN scale (and NaN e4m3 bytes) for per-token pages, the byte 0x7F (a NaN block
scale) for nvfp4. The attention is test_mgpu_ragged's float64 loop (window, sinks, softcap).
Tolerances: the Triton kernels' for these formats, 1e-2 relative to the largest value for bf16 /
f16 queries.

Runs under Mosaic GPU's CPU interpreter (about half a second a program, and a program is one item
× one kv head: per-token pages need 8 kv heads, so the default cases are one short chunk);
`JAX_PLATFORMS=cuda KVJAX_INTERPRET=0` runs them on a GPU. test_mgpu_lowering.py lowers both for sm_90.
"""
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from nvfp4_numpy import decode as decode_numpy
from ragged_cases import garbage_tables, layout

from kvjax.attention.metadata import build_metadata
from kvjax.attention.mgpu_ragged import ragged_paged_attention
from kvjax.attention.pallas_ragged import ragged_paged_attention as triton_ragged
from kvjax.attention.tiles import MosaicRaggedTiles
from kvjax.quant import nvfp4

from test_mgpu_ragged import attention_numpy

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")
BF16, F16 = jnp.bfloat16, jnp.float16
TOL = 1e-2
slow = pytest.mark.slow
# (cached, new) per sequence, rows, max tokens, max seqs. SHORT: one chunk after a prefix starting
# mid-page; MIXED adds a prompt over several items, a decode token, a one-token prompt, rows out of
# token order and a padding row.
SHORT = ([(21, 11)], [0], 16, 1)
MIXED = ([(40, 37), (0, 20), (130, 1), (0, 1)], [3, 0, 1, 2], 64, 5)


def make_step(seed, fmt, z, kv_heads, group, head_dim, q_dtype, window, step=SHORT):
    """(q [T, N, H], k_pages, v_pages, metadata, k_scale, v_scale, f64 keys, f64 values [P, Z, K, H])."""
    seqs, rows, max_tokens, max_seqs = step
    rng = np.random.default_rng(seed)
    tables, sliding, num_pages, readable = layout(seqs, window, extra=2, z=z, rng=rng)
    shape = (num_pages, z, kv_heads, head_dim)
    pages, scales, true = [], [], []
    for _ in range(2):
        if fmt == "nvfp4":
            tensor_scale = rng.choice([0.5, 1.0, 2.0], kv_heads).astype(np.float32)
            x = rng.standard_normal(shape) * rng.uniform(0.2, 3.0, (1, 1, kv_heads, 1))
            x[..., 3] *= 8  # one larger channel: blocks with different scales
            stored = np.asarray(nvfp4.quantize(jnp.asarray(x, jnp.float32), 1.0 / tensor_scale[:, None]))
            stored = np.where(readable[:, :, None, None], stored, np.uint8(0x7F))
            scale, value = tensor_scale, decode_numpy(stored) * tensor_scale[:, None].astype(np.float64)
        else:
            if fmt == "int8_per_token_head":
                stored = rng.integers(-128, 128, shape).astype(np.int8)  # garbage in unread slots: their scale is NaN
            else:
                stored = np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
                stored = np.where(readable[:, :, None, None], stored, np.float32(np.nan).astype(stored.dtype))
            scale = np.where(readable[:, :, None], rng.uniform(0.002, 0.05, shape[:3]), np.nan).astype(np.float32)
            value = stored.astype(np.float64) * scale[..., None].astype(np.float64)
        pages.append(jnp.asarray(stored))
        scales.append(jnp.asarray(scale))
        true.append(value)
    md = garbage_tables(seqs, rows, tables, sliding, z=z, max_tokens=max_tokens, max_seqs=max_seqs, rng=rng)
    q = jnp.asarray(rng.standard_normal((max_tokens, kv_heads * group, head_dim)), q_dtype)
    return q, pages[0], pages[1], md, scales[0], scales[1], true[0], true[1]


def run(case, fn=ragged_paged_attention, **kw):
    """The case through fn → (output f64, the oracle f64, max |V|)."""
    fmt, z, kv_heads, group, head_dim, ppb, stages, q_dtype, window, with_sinks, softcap, step = case
    q, k_pages, v_pages, md, k_scale, v_scale, keys, values = make_step(z + group + head_dim, fmt, z, kv_heads,
                                                                        group, head_dim, q_dtype, window, step)
    sinks = jnp.asarray(np.random.default_rng(3).normal(0.5, 1.5, q.shape[1]), jnp.float32) if with_sinks else None
    scale = head_dim ** -0.5
    call = lambda *a: fn(*a, scale=scale, k_scale=k_scale, v_scale=v_scale, window=window, sinks=sinks,  # noqa
                         softcap=softcap, kv_dtype=fmt, interpret=INTERPRET, **kw)
    got = jax.jit(call)(q, k_pages, v_pages, md)
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), "an unread slot leaked"
    assert not got[int(np.asarray(md.valid).sum()):].any(), "padding tokens attend to nothing"
    want = attention_numpy(q, keys, values, md, z, scale, window, None if sinks is None else np.asarray(sinks),
                           softcap)
    return got, want, np.nanmax(np.abs(values))


# (format, Z, kv heads, group, head dim, pages_per_block, stages, q dtype, window, sinks, softcap, step)
CASES = [
    ("int8_per_token_head", 32, 8, 2, 32, 2, 2, BF16, 13, False, 2.0, SHORT),
    ("nvfp4", 16, 4, 2, 64, 4, 2, BF16, 17, True, 2.0, SHORT),
    pytest.param(("fp8_per_token_head", 8, 8, 2, 64, 8, 3, F16, 13, True, 1.5, MIXED), marks=slow),
    pytest.param(("int8_per_token_head", 16, 8, 4, 64, 8, 2, BF16, None, True, None, MIXED), marks=slow),  # 128 a step
    pytest.param(("nvfp4", 8, 2, 4, 128, 8, 2, F16, None, False, None, MIXED), marks=slow),
    pytest.param(("nvfp4", 32, 4, 7, 64, 2, 3, BF16, 40, True, None, MIXED), marks=slow),  # group 7 → 8
]


def _id(c):
    c = c.values[0] if hasattr(c, "values") else c
    return "{}-Z{}-K{}-G{}-H{}-p{}-st{}-{}-W{}-sinks{}-cap{}-{}".format(
        *c[:7], jnp.dtype(c[7]).name, *c[8:11], "short" if c[11] is SHORT else "mixed")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_matches_numpy(case):
    got, want, vmax = run(case, tiles=MosaicRaggedTiles(*case[5:7]))
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * vmax)


@slow
@pytest.mark.parametrize("fmt", ["fp8_per_token_head", "nvfp4"])
def test_default_tiles_match_the_triton_kernel(fmt):
    """Default tiles, against pallas_ragged (the same arguments) and the oracle."""
    case = (fmt, 16, 8, 2, 64, None, None, BF16, 20, False, None, SHORT)
    got, want, vmax = run(case)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * vmax)
    triton, _, _ = run(case, fn=triton_ragged)
    np.testing.assert_allclose(got, triton, rtol=TOL, atol=TOL * vmax)


@pytest.mark.parametrize("fmt, change, match", [
    ("int8_per_token_head", dict(kv_heads=4), "per-token scales of 4 kv heads"),
    ("int8_per_token_head", dict(k_scale="drop"), r"k_scale f32\[6, 16, 8\]"),
    ("fp8_per_token_head", dict(page_dtype=jnp.int8), "fp8_per_token_head pages are float8_e4m3fn, got int8"),
    ("nvfp4", dict(head_dim=256), r"head dim 256 outside \[64, 128\]"),
    ("nvfp4", dict(kv_heads=1), "multiple of 16 bytes"),
    ("nvfp4", dict(tiles=MosaicRaggedTiles(3)), "pages_per_block × block_size = 3 × 16 = 48"),
    ("nvfp4", dict(tiles=MosaicRaggedTiles(16)), r"MosaicRaggedTiles\(pages_per_block=16, stages=2\) need \d+ bytes"),
])
def test_bad_input_is_refused_by_name(fmt, change, match):
    kv_heads, head_dim = change.pop("kv_heads", 8), change.pop("head_dim", 64)
    md = build_metadata([3], [2], [[1]], block_size=16, max_tokens=4, max_seqs=1, max_blocks_per_seq=2)
    if fmt == "nvfp4":
        pages = jnp.zeros((6, 16, kv_heads, nvfp4.packed_width(head_dim)), jnp.uint8)
        scales = dict(k_scale=jnp.ones((kv_heads,)), v_scale=jnp.ones((kv_heads,)))
    else:
        pages = jnp.zeros((6, 16, kv_heads, head_dim), change.pop("page_dtype", jnp.dtype(per_token_storage(fmt))))
        scales = dict(k_scale=jnp.ones((6, 16, kv_heads)), v_scale=jnp.ones((6, 16, kv_heads)))
        if change.pop("k_scale", None) == "drop":
            scales["k_scale"] = jnp.ones((kv_heads,))
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(jnp.zeros((4, 2 * kv_heads, head_dim), BF16), pages, pages, md, scale=1.0,
                               kv_dtype=fmt, interpret=INTERPRET, **{**scales, **change})


def per_token_storage(fmt):
    """The storage dtype of a per-token format."""
    return jnp.int8 if fmt == "int8_per_token_head" else jnp.float8_e4m3fn
