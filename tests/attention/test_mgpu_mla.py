"""The Mosaic GPU absorbed-MLA decode kernel (kvjax.attention.mgpu_mla) against float64 NumPy.

The oracle and builders of tests/attention/test_pallas_decode.py's MLA cases (permuted tables, NaN
in every slot the kernel must not read, garbage table entries past a sequence's end, lengths
1, Z·m, Z·m + 1), with the latent widths as parameters: DeepSeek's 512 + 64 in the GPU run and
the slow cases, 128 + 64 in the quick ones (the CPU interpreter runs the kernel's three
warpgroups thread by thread: a 576-lane case takes 10-30 s there). Tolerance: the bf16 one of
the Triton kernels' tests.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.mgpu_mla import mla_paged_decode
from kvjax.attention.tiles import MosaicDecodeTiles

from test_pallas_decode import BF16, E4M3, E5M2, F16, assert_close, build_pages, gather_numpy, lens_for, scales_for, \
    softmax_attend, store

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")
slow = pytest.mark.slow


def make_mla(seed, batch, heads, rank, rope, block_size, q_dtype, page_dtype, mode, m):
    rng = np.random.default_rng(seed)
    lens = lens_for(batch, block_size, m)
    channels = rank + rope
    mags, arg, per = scales_for(rng, page_dtype, mode, channels)
    gen = lambda n: np.clip(rng.standard_normal((n, channels)), -4, 4).astype(np.float32) * mags  # noqa: E731
    pages, tables = build_pages(np.random.default_rng(seed + 1), lens, block_size, (channels,), jnp.dtype(page_dtype),
                                lambda n: store(gen(n), page_dtype, per))
    q_latent = (rng.standard_normal((batch, heads, rank)) * 0.1).astype(np.float32).astype(q_dtype)
    q_rope = rng.standard_normal((batch, heads, rope)).astype(np.float32).astype(q_dtype)
    return q_latent, q_rope, (pages, arg, per), tables, np.asarray(lens, np.int32)


def mla_numpy(q_latent, q_rope, latent, tables, lens, scale):
    pages, _, per = latent
    rank = q_latent.shape[-1]
    out = np.zeros(q_latent.shape, np.float64)
    vmax = 0.0
    for b in range(len(lens)):
        if lens[b] == 0:
            continue
        c = gather_numpy(pages, tables[b], lens[b], per)  # [S, C]
        q = np.concatenate([q_latent[b], q_rope[b]], axis=-1).astype(np.float64)
        out[b] = softmax_attend(q, c, c[:, :rank], scale)
        vmax = max(vmax, np.abs(c[:, :rank]).max())
    return out, vmax


# (batch, heads, rank, rope, block_size, pages_per_block, splits, q dtype, page dtype, scale mode, m)
CASES = [
    (1, 16, 128, 64, 16, 4, 2, BF16, BF16, None, 5),
    (2, 8, 128, 64, 64, 1, 1, BF16, E4M3, "per_channel", 2),
    pytest.param((3, 16, 512, 64, 16, 4, 2, BF16, BF16, None, 5), marks=slow),  # DeepSeek's latent
    pytest.param((1, 128, 512, 64, 64, 1, 3, BF16, E5M2, "per_tensor", 4), marks=slow),  # two head tiles
    pytest.param((3, 70, 256, 64, 8, 8, 1, F16, F16, None, 9), marks=slow),  # a padded second tile
    pytest.param((2, 16, 512, 64, 32, 2, 2, BF16, E4M3, "per_channel", 3), marks=slow),
]


def _values(c):
    return c.values[0] if hasattr(c, "values") else c


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-N{}-r{}+{}-Z{}-p{}-S{}-{}-{}-{}".format(
    *_values(c)[:7], jnp.dtype(_values(c)[7]).name, jnp.dtype(_values(c)[8]).name, _values(c)[9]))
def test_mla_kernel_matches_numpy(case):
    batch, heads, rank, rope, block_size, ppb, splits, q_dtype, page_dtype, mode, m = case
    ql, qr, latent, tables, lens = make_mla(batch + heads + rank + m, batch, heads, rank, rope, block_size, q_dtype,
                                            page_dtype, mode, m)
    scale = (128 + rope) ** -0.5
    want, vmax = mla_numpy(np.asarray(ql, np.float32), np.asarray(qr, np.float32), latent, tables, lens, scale)
    out = mla_paged_decode(jnp.asarray(ql), jnp.asarray(qr), jnp.asarray(latent[0]), jnp.asarray(tables),
                           jnp.asarray(lens), scale=scale, latent_scale=latent[1],
                           tiles=MosaicDecodeTiles(ppb, splits, 2), interpret=INTERPRET)
    assert out.shape == ql.shape and out.dtype == ql.dtype
    assert_close(out, want, q_dtype, vmax)


def test_default_tiles_and_zero_lengths():
    ql, qr, latent, tables, lens = make_mla(11, 3, 8, 128, 64, 16, BF16, E4M3, "per_channel", 3)
    lens = np.array([lens[0], 0, lens[2]], np.int32)
    want, vmax = mla_numpy(np.asarray(ql, np.float32), np.asarray(qr, np.float32), latent, tables, lens, 0.07)
    out = mla_paged_decode(*[jnp.asarray(a) for a in (ql, qr, latent[0], tables, lens)], scale=0.07,
                           latent_scale=latent[1], interpret=INTERPRET)
    assert not np.asarray(out[1], np.float32).any()
    assert_close(out, want, BF16, vmax)


def _args(**override):
    args = dict(q_latent=jnp.zeros((2, 16, 128), BF16), q_rope=jnp.zeros((2, 16, 64), BF16),
                latent_pages=jnp.zeros((5, 16, 192), BF16), block_tables=jnp.zeros((2, 3), jnp.int32),
                context_lens=jnp.ones((2,), jnp.int32))
    args.update(override)
    return args


@pytest.mark.parametrize("override, kwargs, match", [
    (dict(q_latent=jnp.zeros((2, 16), BF16)), {}, "q_latent and q_rope must be"),
    (dict(q_rope=jnp.zeros((2, 16, 64), F16)), {}, "must share B, N and dtype"),
    (dict(latent_pages=jnp.zeros((5, 16, 1, 192), BF16)), {}, r"latent_pages must be \[P, Z, C\]"),
    (dict(latent_pages=jnp.zeros((5, 16, 256), BF16)), {}, "C=256 must equal"),
    (dict(q_latent=jnp.zeros((2, 16, 128)), q_rope=jnp.zeros((2, 16, 64))), {}, "no exact f32 product"),
    (dict(latent_pages=jnp.zeros((5, 16, 192), F16)), {}, "latent_pages dtype float16 unsupported"),
    (dict(q_latent=jnp.zeros((2, 16, 64), BF16), latent_pages=jnp.zeros((5, 16, 128), BF16)), {},
     "kv_lora_rank 64 must be a multiple of 128"),
    (dict(latent_pages=jnp.zeros((5, 4, 192), BF16)), {}, "multiple of 8"),
    ({}, dict(latent_scale=jnp.ones((64,))), r"latent_scale must be a scalar or \[192\]"),
    ({}, dict(tiles=MosaicDecodeTiles(2, 1)), "the wgmma tiles need 64, 128 or 256"),
])
def test_bad_inputs(override, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mla_paged_decode(**_args(**override), scale=1.0, **kwargs, interpret=INTERPRET)
