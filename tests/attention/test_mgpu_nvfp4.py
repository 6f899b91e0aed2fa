"""The Mosaic GPU decode kernel on nvfp4 pages (kvjax.attention.mgpu_nvfp4) against float64 NumPy.

The pages and the oracle are those of tests/attention/test_nvfp4_attention.py (the Triton nvfp4
kernel's tests): uint8 [P, Z, K, H/2 + H/16] written by kvjax's quantizer, decoded on the NumPy side
from the layout alone (tests/nvfp4_numpy.py), every slot the kernel must not read the byte 0x7F
(a NaN block scale), garbage table entries past a sequence's last page, permuted tables. With a
window, the pages wholly before it are poisoned too (vLLM frees them). The attention itself is
test_pallas_variants' float64 loop, which takes windows, sinks and softcap. Tolerances: the
dot dtype's, relative to the largest value (nvfp4 values times their block scales are exact in
f16, so quantization error is not in them).

Runs under Mosaic GPU's CPU interpreter by default (about 3 s a case); `JAX_PLATFORMS=cuda
KVJAX_INTERPRET=0` compiles them on a GPU. tests/attention/test_mgpu_lowering.py lowers the
kernel for sm_90.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.mgpu_decode import paged_decode
from kvjax.attention.tiles import MosaicDecodeTiles

from test_nvfp4_attention import build
from test_pallas_variants import VARIANTS, decode64

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")
BF16, F16 = jnp.bfloat16, jnp.float16
TOL = {BF16: 1e-2, F16: 1e-2}
slow = pytest.mark.slow

# (batch, group, kv heads, head dim, Z, pages per block, splits, stages, q dtype, per-head scales, window, variant)
CASES = [
    (2, 2, 2, 128, 16, 4, 2, 2, BF16, True, None, "plain"),
    (3, 1, 4, 64, 8, 8, 1, 3, F16, False, 13, "sinks+softcap"),
    pytest.param((3, 4, 2, 128, 64, 1, 3, 2, BF16, True, None, "softcap"), marks=slow),
    pytest.param((2, 8, 4, 64, 32, 4, 2, 2, BF16, True, 40, "sinks"), marks=slow),  # 128 tokens a step
    pytest.param((2, 2, 2, 128, 16, 8, 2, 2, F16, False, None, "plain"), marks=slow),  # 128 tokens a step
]


def _id(c):
    c = c.values[0] if hasattr(c, "values") else c
    return "B{}-G{}-K{}-H{}-Z{}-p{}-S{}-st{}-{}-{}-w{}-{}".format(*c[:8], jnp.dtype(c[8]).name,
                                                                   "head" if c[9] else "unit", *c[10:])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_nvfp4_kernel_matches_numpy(case):
    batch, group, kv_heads, head_dim, z, ppb, splits, stages, q_dtype, per_head, window, variant = case
    lens = [1, 3 * z, 5 * z + 1][-batch:]
    tensor_scale = np.array([0.5, 2.0, 1.0, 0.25][:kv_heads] if per_head else [1.0] * kv_heads, np.float32)
    q, pages, tables, dense = build(7 + head_dim + z, batch, group, kv_heads, head_dim, z, lens, tensor_scale)
    if window is not None:  # pages wholly before the window: freed (NaN here), never read
        for b, n in enumerate(lens):
            for i in range(max(0, n - window) // z):
                for name in ("k", "v"):
                    pages[name][tables[b, i]] = 0x7F
    with_sinks, softcap = VARIANTS[variant]
    sinks = np.random.default_rng(3).normal(0.5, 1.5, q.shape[1]).astype(np.float32) if with_sinks else None
    scale = head_dim ** -0.5
    q_in = jnp.asarray(q).astype(q_dtype)
    want = decode64(q_in, dense["k"], dense["v"], lens, scale, window, sinks, softcap)
    out = paged_decode(q_in, jnp.asarray(pages["k"]), jnp.asarray(pages["v"]), jnp.asarray(tables),
                       jnp.asarray(lens, np.int32), scale=scale, k_scale=jnp.asarray(tensor_scale),
                       v_scale=jnp.asarray(tensor_scale), window=window, sinks=sinks, softcap=softcap,
                       kv_dtype="nvfp4", tiles=MosaicDecodeTiles(ppb, splits, stages), interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q_dtype
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), "an unread slot (NaN block scale) leaked"
    vmax = max(np.abs(v).max() for v in dense["v"])
    np.testing.assert_allclose(out, want, rtol=TOL[q_dtype], atol=TOL[q_dtype] * vmax)


@pytest.mark.parametrize("q_shape, pages_shape, kv_dtype, match", [
    ((1, 4, 64), (4, 16, 4, 64), "nvfp4", r"H/2 \+ H/16"),  # 64 bytes a head: not 36
    ((1, 4, 64), (4, 16, 4, 36), None, "uint8 pages nvfp4's"),  # the format is named, never guessed
    ((1, 2, 32), (4, 16, 2, 18), "nvfp4", r"head dim 32 outside \[64, 128\]"),
    ((1, 2, 256), (4, 16, 2, 144), "nvfp4", r"head dim 256 outside"),
    ((1, 2, 64), (4, 16, 2, 36), "nvfp4", "multiple of 16 bytes"),  # 2 × 36 bytes: no TMA tensor
])
def test_bad_nvfp4_pages(q_shape, pages_shape, kv_dtype, match):
    q, pages = jnp.zeros(q_shape, BF16), jnp.zeros(pages_shape, jnp.uint8)
    with pytest.raises(ValueError, match=match):
        paged_decode(q, pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0,
                     kv_dtype=kv_dtype, interpret=INTERPRET)
