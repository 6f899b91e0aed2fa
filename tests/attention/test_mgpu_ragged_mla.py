"""The Mosaic GPU absorbed-MLA ragged kernel (kvjax.attention.mgpu_ragged_mla) against float64 NumPy.

A mixed step over latent pages [P, Z, kv_lora_rank + rope]: a chunk after a cached prefix starting
mid-page, a prompt over two work items, a decode token, a padding row, sequences in rows out of
token order, permuted tables with garbage past their ends, lengths that do not fill their last
page, and poison in every slot no query may read (NaN values; per-token formats: a NaN scale). The
oracle gathers each token's own sequence through its table and attends in float64 over the
positions up to its own: key = the dequantized latent [c_kv, k_rope], value = c_kv. Quick cases use
a 128 + 64 latent and 8 heads (the CPU interpreter runs the three warpgroups thread by thread);
the slow ones DeepSeek's 512 + 64, 64 and 80 heads (one token an item, two head tiles), fp8 and
f16. Tolerance: the bf16 one of the Triton kernels' tests (bf16 / f16 queries only: wgmma).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_cases import garbage_tables, layout

from kvjax.attention.mgpu_ragged_mla import _mgpu_ragged_mla, mla_ragged_paged_attention
from kvjax.attention.reference import mla_paged_attention_reference
from kvjax.attention.tiles import MosaicRaggedTiles

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")
slow = pytest.mark.slow
BF16, F16, E4M3, E5M2 = jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2
# (cached, new) of each sequence and its row (row 1 is padding): a chunk after a prefix starting
# mid-page, a decode token, a prompt over two items of 8 tokens. LONG adds a longer context.
SEQS, ROWS = [(21, 11), (45, 1), (0, 9)], [2, 0, 3]
LONG_SEQS, LONG_ROWS = [(21, 11), (130, 1), (0, 9), (7, 3)], [2, 0, 3, 4]
TOL = 1e-2
FORMATS = {None: BF16, "fp16": F16, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2, "int8_per_token_head": jnp.int8,
           "fp8_per_token_head": E4M3}


def make_step(seed, z, heads, rank, rope, fmt, scale_mode=None, long=False, q_dtype=BF16):
    """(q_latent, q_rope, latent pages, latent_scale, metadata, f64 dequantized pages [P, Z, C])."""
    seqs, rows = (LONG_SEQS, LONG_ROWS) if long else (SEQS, ROWS)
    max_tokens, max_seqs = (32, 6) if long else (24, 4)
    rng = np.random.default_rng(seed)
    channels = rank + rope
    tables, _, num_pages, readable = layout(seqs, None, extra=2, z=z, rng=rng)
    values = rng.standard_normal((num_pages, z, channels)).astype(np.float32)
    hole = ~readable[:, :, None]
    dtype = FORMATS[fmt]
    per_token = fmt is not None and fmt.endswith("per_token_head")
    if per_token:  # a scale per token; NaN where unread (int8 has no NaN: the scale poisons the slot)
        ints = dtype == jnp.int8
        stored = rng.integers(-127, 128, values.shape).astype(np.float32) if ints else values * 8
        token_scale = rng.uniform(0.005, 0.02, (num_pages, z)) if ints else rng.uniform(0.05, 0.2, (num_pages, z))
        pages = jnp.asarray(stored if ints else np.where(hole, np.nan, stored), dtype)
        latent_scale = jnp.asarray(np.where(hole[..., 0], np.nan, token_scale), jnp.float32)
        true = np.asarray(pages.astype(jnp.float32), np.float64) * np.asarray(latent_scale, np.float64)[..., None]
    else:
        fp8 = jnp.dtype(dtype) in (jnp.dtype(E4M3), jnp.dtype(E5M2))
        pages = jnp.asarray(np.where(hole, np.nan, values * 8 if fp8 else values), dtype)
        scale = {None: None, "per_tensor": np.float32(0.1),
                 "per_channel": rng.uniform(0.05, 0.2, channels).astype(np.float32)}[scale_mode]
        latent_scale = None if scale is None else jnp.asarray(scale)
        true = np.asarray(pages.astype(jnp.float32), np.float64) * (1.0 if scale is None else scale)
    md = garbage_tables(seqs, rows, tables, tables, z=z, max_tokens=max_tokens, max_seqs=max_seqs, rng=rng)
    q_latent = jnp.asarray(rng.standard_normal((max_tokens, heads, rank)), q_dtype)
    q_rope = jnp.asarray(rng.standard_normal((max_tokens, heads, rope)), q_dtype)
    return q_latent, q_rope, pages, latent_scale, md, true


def mla_numpy(q_latent, q_rope, latent, md, z, scale):
    """f64 [T, N, rank]: each valid token over its own sequence's positions <= its own."""
    q = np.concatenate([np.asarray(q_latent.astype(jnp.float32)), np.asarray(q_rope.astype(jnp.float32))], -1)
    q, rank = q.astype(np.float64), q_latent.shape[-1]
    tables, lens = np.asarray(md.block_tables), np.asarray(md.context_lens)
    out = np.zeros(q_latent.shape)
    for t in range(q.shape[0]):
        if not md.valid[t]:
            continue
        b, pos = int(md.seq_ids[t]), int(md.positions[t])
        s = np.arange(min(pos + 1, lens[b]))
        c = latent[tables[b][s // z], s % z]  # [S, C]
        logits = q[t] @ c.T * scale  # [N, S]
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[t] = (w / w.sum(axis=1, keepdims=True)) @ c[:, :rank]
    return out


def run(q_latent, q_rope, pages, latent_scale, md, fmt, scale, tiles=None):
    kv_dtype = None if fmt in (None, "fp16") else fmt
    fn = lambda *a: mla_ragged_paged_attention(*a, scale=scale, latent_scale=latent_scale, kv_dtype=kv_dtype,  # noqa
                                               tiles=tiles, interpret=INTERPRET)
    return jax.jit(fn)(q_latent, q_rope, pages, md)


# (Z, heads, rank, rope, pages_per_block, stages, format, static scale, long, q dtype)
CASES = [
    (16, 8, 128, 64, 4, 2, None, None, False, BF16),
    (32, 8, 128, 64, 2, 2, "int8_per_token_head", None, False, BF16),
    pytest.param((16, 4, 128, 64, 4, 2, "fp8_e4m3", "per_channel", True, BF16), marks=slow),
    pytest.param((8, 16, 128, 64, 16, 3, "fp8_e5m2", "per_tensor", False, BF16), marks=slow),  # 128 a step
    pytest.param((16, 8, 512, 64, 4, 2, None, None, True, BF16), marks=slow),  # DeepSeek's latent
    pytest.param((32, 64, 128, 64, 2, 2, "fp8_per_token_head", None, False, BF16), marks=slow),  # a token an item
    pytest.param((16, 80, 256, 64, 4, 2, "fp16", None, False, F16), marks=slow),  # two head tiles, the second padded
    pytest.param((32, 16, 512, 64, 2, 2, "int8_per_token_head", None, True, BF16), marks=slow),
]


def _v(c):
    return c.values[0] if hasattr(c, "values") else c


@pytest.mark.parametrize("case", CASES, ids=lambda c: "Z{}-N{}-r{}+{}-p{}-st{}-{}-{}-long{}-{}".format(
    *_v(c)[:9], jnp.dtype(_v(c)[9]).name))
def test_kernel_matches_numpy(case):
    z, heads, rank, rope, ppb, stages, fmt, scale_mode, long, q_dtype = case
    q_latent, q_rope, pages, latent_scale, md, true = make_step(z + heads + rank, z, heads, rank, rope, fmt,
                                                                scale_mode, long, q_dtype)
    scale = (128 + rope) ** -0.5
    got = run(q_latent, q_rope, pages, latent_scale, md, fmt, scale, MosaicRaggedTiles(ppb, stages))
    assert got.shape == q_latent.shape and got.dtype == q_latent.dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), "an unread slot leaked"
    want = mla_numpy(q_latent, q_rope, true, md, z, scale)
    vmax = np.nanmax(np.abs(true[..., :rank]))
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * vmax)
    assert not got[int(np.asarray(md.valid).sum()):].any(), "padding tokens attend to nothing"


@slow
def test_equals_the_reference_with_default_tiles():
    q_latent, q_rope, pages, latent_scale, md, true = make_step(5, 16, 8, 128, 64, "fp8_e4m3", "per_channel")
    kw = dict(scale=0.07, latent_scale=latent_scale, kv_dtype="fp8_e4m3")
    got = jax.jit(lambda *a: mla_ragged_paged_attention(*a, **kw, interpret=INTERPRET))(q_latent, q_rope, pages, md)
    want = jax.jit(lambda *a: mla_paged_attention_reference(*a, **kw))(q_latent, q_rope, pages, md)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=TOL,
                               atol=TOL * np.nanmax(np.abs(true[..., :128])))


def _bad(**change):
    q_latent, q_rope, pages, _, md, _ = make_step(1, 16, 8, 128, 64, None)
    args = dict(q_latent=q_latent, q_rope=q_rope, latent_pages=pages, md=md)
    args.update({k: v for k, v in change.items() if k in args})
    kw = {k: v for k, v in change.items() if k not in args}
    return args, kw


@pytest.mark.parametrize("change, match", [
    (dict(q_latent=jnp.zeros((24, 8, 128), jnp.float32), q_rope=jnp.zeros((24, 8, 64), jnp.float32)),
     "q_latent dtype float32 unsupported .* no exact f32 product"),
    (dict(q_rope=jnp.zeros((24, 8, 64), F16)), "q_rope dtype float16 must be q_latent's"),
    (dict(latent_pages=jnp.zeros((9, 16, 192), F16)), "latent_pages dtype float16 unsupported"),
    (dict(q_latent=jnp.zeros((24, 8, 64), BF16), latent_pages=jnp.zeros((9, 16, 128), BF16)),
     "kv_lora_rank 64 must be a multiple of 128"),
    (dict(latent_pages=jnp.zeros((9, 12, 192), BF16), tiles=MosaicRaggedTiles(8)), "block size 12 must be"),
    (dict(latent_pages=jnp.zeros((9, 16, 200), BF16)), "the latent page width 200"),
    (dict(latent_pages=jnp.zeros((9, 32, 192), jnp.int8), kv_dtype="int8_per_token_head", tiles=MosaicRaggedTiles(2),
          latent_scale=jnp.ones((9, 32, 1))), r"latent_scale f32\[9, 32\] .* got float32 \(9, 32, 1\)"),
    (dict(latent_pages=jnp.zeros((9, 16, 192), E4M3), kv_dtype="fp8_per_token_head",
          latent_scale=jnp.ones((9, 16), jnp.float32)), "fp8_per_token_head latent pages of 16 tokens"),
    (dict(latent_pages=jnp.zeros((9, 16, 192), jnp.uint8), kv_dtype="nvfp4", latent_scale=1.0), "nvfp4 latent pages"),
    (dict(latent_pages=jnp.zeros((9, 16, 192), E4M3), latent_scale=jnp.ones((64,)), kv_dtype="fp8_e4m3"),
     r"latent_scale must be a scalar or \[192\]"),
    (dict(tiles=MosaicRaggedTiles(2)), "pages_per_block × block_size = 2 × 16"),
    (dict(tiles=MosaicRaggedTiles(16, 2), q_latent=jnp.zeros((24, 8, 512), BF16),
          q_rope=jnp.zeros((24, 8, 64), BF16), latent_pages=jnp.zeros((9, 16, 576), BF16)),
     "need .* bytes of shared memory"),
])
def test_bad_input_is_refused_by_name(change, match):
    args, kw = _bad(**change)
    with pytest.raises(ValueError, match=match):
        mla_ragged_paged_attention(**args, scale=1.0, **{"interpret": INTERPRET, **kw})


S = jax.ShapeDtypeStruct
PAGES = {"bf16": (BF16, None), "e4m3": (E4M3, "fp8_e4m3"), "int8_tok": (jnp.int8, "int8_per_token_head"),
         "e4m3_tok": (E4M3, "fp8_per_token_head")}


@pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
@pytest.mark.parametrize("kv, heads, block_size, ppb", [
    ("bf16", 128, 64, 1), ("int8_tok", 70, 32, 2),
    pytest.param("e4m3", 16, 16, 4, marks=slow), pytest.param("e4m3_tok", 8, 64, 1, marks=slow)])
def test_lowers_for_cuda(monkeypatch, semantics, kv, heads, block_size, ppb):
    """DeepSeek's 512 + 64 latent through the whole Pallas → Mosaic GPU lowering for sm_90 without a GPU
    (tests/attention/test_mgpu_lowering.py says what that checks): three warpgroups, two stages, each
    page format, the SMEM a block holds (Mosaic GPU refuses a kernel over 227 KiB when lowering)."""
    from test_gpu_lowering import ragged_metadata

    monkeypatch.setenv("KVJAX_MGPU_SEMANTICS", semantics)
    _mgpu_ragged_mla.clear_cache()  # the semantics are read while tracing: a cached trace would keep the last ones
    tokens, seqs, pages, max_blocks, rank, rope = 256, 4, 40, 32, 512, 64
    dtype, fmt = PAGES[kv]
    per_token = fmt is not None and fmt.endswith("per_token_head")
    scale = S((pages, block_size), jnp.float32) if per_token else (None if fmt is None else S((), jnp.float32))

    def fn(q_latent, q_rope, latent, md, latent_scale):
        return mla_ragged_paged_attention(q_latent, q_rope, latent, md, scale=0.07, latent_scale=latent_scale,
                                          kv_dtype=fmt, tiles=MosaicRaggedTiles(ppb), interpret=False)

    args = (S((tokens, heads, rank), BF16), S((tokens, heads, rope), BF16), S((pages, block_size, rank + rope), dtype),
            ragged_metadata(tokens, seqs, max_blocks, 128), scale)
    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert len([line for line in module.splitlines() if "@mosaic_gpu" in line]) == 1
