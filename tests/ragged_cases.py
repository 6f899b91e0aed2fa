"""Ragged attention steps for the tests of kvjax.attention's ragged forms (tests/attention/test_tiled.py,
test_pallas_ragged.py): a batch that mixes prefill and decode (prompts, chunks that start
mid-sequence, single decode tokens, a padding row) in rows not in token order, through permuted
block tables, with context lengths that do not fill their last page, and pages of every format
whose unread slots hold poison (NaN; for integer pages a NaN scale; for nvfp4 the byte 0x7F).
Windowed layers get vLLM's sliding tables (null blocks before the window of each sequence's first
new token)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention.metadata import build_metadata
from kvjax.quant import nvfp4

Z, H, N, SCALE = 4, 16, 4, 0.3  # block size, head dim, query heads, softmax scale
# (cached, new): a chunk past the start, a prompt, a decode, a chunk that starts mid-page, a long
# prompt, a 1-token prompt, a chunk after a prefix hit at a page boundary
SEQS = [(13, 5), (0, 9), (22, 1), (7, 6), (0, 19), (0, 1), (16, 3)]
ROWS = [4, 0, 6, 2, 7, 1, 3]  # each sequence's row; row 5 is padding
MAX_SEQS, MAX_BLOCKS, MAX_TOKENS, MAX_QUERY = 8, 8, 48, 32
RTOL, ATOL = 1e-5, 1e-6
FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2, "fp8_per_token_head": jnp.float8_e4m3fn}


def first_seen(done, window):
    """The first position the step's earliest query of a sequence (at `done`) may see."""
    return 0 if window is None else max(0, done - window + 1)


def layout(seqs, window, seed=0, extra=3, z=Z, rng=None):
    """Permuted tables, and for each sequence and page slot whether some query of the step may read it
    (pages of z tokens; rng: the generator to draw from, else one from seed).
    → (real tables, vLLM's sliding tables, number of pages, readable bool[P, Z])."""
    rng = np.random.default_rng(seed) if rng is None else rng
    blocks = [-(-(d + n) // z) for d, n in seqs]
    num_pages = 1 + sum(blocks) + extra
    free = list(rng.permutation(np.arange(1, num_pages)))
    real, sliding = [], []
    readable = np.zeros((num_pages, z), bool)
    for (done, new), count in zip(seqs, blocks):
        table = [int(free.pop()) for _ in range(count)]
        lo = first_seen(done, window)
        for s in range(lo, done + new):
            readable[table[s // z], s % z] = True
        real.append(table)
        sliding.append([0 if (j + 1) * z <= lo else p for j, p in enumerate(table)])  # vLLM frees these
    return real, sliding, num_pages, readable


def garbage_tables(seqs, rows, real, tables, *, z, max_tokens, max_seqs, rng):
    """The step's metadata over the real tables, its block tables then `tables` (vLLM's sliding ones
    or the real) in each sequence's row and random ids past each table's end (a kernel must never
    read those): what the Mosaic GPU kernels' tests give them."""
    md = build_metadata([d for d, _ in seqs], [n for _, n in seqs], real, block_size=z, max_tokens=max_tokens,
                        max_seqs=max_seqs, max_blocks_per_seq=max(map(len, real)) + 1, rows=rows,
                        max_query_len=max_tokens)
    t = rng.integers(-1000, 1000, np.shape(md.block_tables)).astype(np.int32)
    for row, table in zip(rows, tables):
        t[row, :len(table)] = table
    return md.replace(block_tables=jnp.asarray(t))


def metadata(seqs, real, sliding):
    """The step's metadata over the real tables, then given vLLM's sliding ones (build_metadata
    refuses a null block inside a table)."""
    md = build_metadata([d for d, _ in seqs], [n for _, n in seqs], real, block_size=Z, max_tokens=MAX_TOKENS,
                        max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS, rows=ROWS[:len(seqs)],
                        max_query_len=MAX_QUERY)
    tables = np.asarray(md.block_tables).copy()
    for row, table in zip(ROWS, sliding):
        tables[row, :len(table)] = table
    return md.replace(block_tables=jnp.asarray(tables))


def pages_of(fmt, shape, readable, rng):
    """Pages [P, Z, ...] (`shape`, unpacked) of format fmt with random contents where readable and
    poison elsewhere (nvfp4: packed, uint8 [P, Z, K, H/2 + H/16]), and their scale: None, per head
    f32[K] / per channel f32[C], or per-token scale pages f32[P, Z, ...]."""
    spread = rng.uniform(0.5, 2.0, shape[2:3] + (1,) * (len(shape) - 3))  # per kv head (per channel for MLA)
    values = rng.standard_normal(shape).astype(np.float32) * spread
    hole = ~readable.reshape(readable.shape + (1,) * (len(shape) - 2))
    if fmt in (None, "bf16", "fp16"):
        dtype = {None: jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[fmt]
        return jnp.asarray(np.where(hole, np.nan, values), dtype), None
    if fmt in FP8:
        stored = jnp.asarray(np.where(hole, np.nan, values * 8), FP8[fmt])  # NaN: e4m3's 0x7F, e5m2's NaN
        if fmt == "fp8_per_token_head":
            scale = rng.uniform(0.05, 0.2, shape[:-1]).astype(np.float32)
            return stored, jnp.asarray(np.where(hole[..., 0], np.nan, scale))
        return stored, jnp.asarray(rng.uniform(0.05, 0.2, shape[2:3] if len(shape) == 4 else shape[-1:]), jnp.float32)
    if fmt == "int8_per_token_head":
        stored = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        scale = rng.uniform(0.005, 0.02, shape[:-1]).astype(np.float32)
        return stored, jnp.asarray(np.where(hole[..., 0], np.nan, scale))  # a NaN scale poisons the slot
    assert fmt == "nvfp4"
    tensor_scale = rng.uniform(0.5, 2.0, shape[2]).astype(np.float32)
    packed = np.asarray(nvfp4.quantize(jnp.asarray(values), 1.0 / tensor_scale[:, None]))
    return jnp.asarray(np.where(hole, np.uint8(0x7F), packed)), jnp.asarray(tensor_scale)


def jitted(fn, *args, **kw):
    """fn(*args, **kw) compiled as one program, as a model step runs it (a third faster to test than
    op by op); kw's arrays (scales, sinks) become constants of it."""
    return jax.jit(lambda *a: fn(*a, **kw))(*args)


def assert_equal_to_reference(got, want, values_max):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(want).all() and np.isfinite(got).all(), "an unread slot leaked"
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * values_max)


def gqa_case(kv_heads, window, fmt=None, seqs=SEQS, seed=0):
    rng = np.random.default_rng(seed)
    real, sliding, num_pages, readable = layout(seqs, window, seed)
    k_pages, k_scale = pages_of(fmt, (num_pages, Z, kv_heads, H), readable, rng)
    v_pages, v_scale = pages_of(fmt, (num_pages, Z, kv_heads, H), readable, rng)
    q = jnp.asarray(rng.standard_normal((MAX_TOKENS, N, H)), jnp.float32)
    kw = dict(scale=SCALE, window=window, k_scale=k_scale, v_scale=v_scale,
              kv_dtype=None if fmt is None else fmt)
    return q, k_pages, v_pages, metadata(seqs, real, sliding), kw


def values_max(v_pages, kw):
    """max |V| over the pages a query may read: the scale the absolute tolerance is relative to."""
    v = np.asarray(v_pages, np.float32) if v_pages.dtype != jnp.uint8 else np.full(1, 6.0)
    return max(1.0, float(np.nanmax(np.abs(v)) * (np.nanmax(np.asarray(kw["v_scale"])) if kw["v_scale"] is not None
                                                   else 1.0)))


VARIANTS = {"plain": {}, "sinks": dict(sinks=True), "softcap": dict(softcap=2.0),
            "sinks+softcap": dict(sinks=True, softcap=1.5)}


def with_variant(kw, name, rng):
    extra = dict(VARIANTS[name])
    if extra.pop("sinks", False):
        extra["sinks"] = jnp.asarray(rng.normal(0.5, 1.5, N), jnp.float32)
    return {**kw, **extra}


def mla_case(fmt, seed, rank=16, rope=8, heads=4):
    """An absorbed-MLA step over latent pages [P, Z, rank + rope] of format fmt, unread slots
    poisoned: (q_latent, q_rope, latent pages, metadata, keyword arguments of the attention call)."""
    rng = np.random.default_rng(seed)
    real, sliding, num_pages, readable = layout(SEQS, None, seed)
    latent, scale = pages_of(fmt, (num_pages, Z, rank + rope), readable, rng)
    q_latent = jnp.asarray(rng.standard_normal((MAX_TOKENS, heads, rank)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((MAX_TOKENS, heads, rope)), jnp.float32)
    return q_latent, q_rope, latent, metadata(SEQS, real, sliding), dict(scale=SCALE, latent_scale=scale, kv_dtype=fmt)
