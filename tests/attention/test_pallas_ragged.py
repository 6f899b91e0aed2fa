"""The Pallas ragged paged-attention kernel (kvjax.attention.pallas_ragged) in interpret mode.

Against float64 NumPy written from the definitions (each token scores the positions of its own
sequence up to its own, through its block table, on the dequantized page values), on
tests/ragged_cases.py's steps: prefill, chunks after a cached prefix, decode tokens and a padding
row mixed, permuted tables, lengths that do not fill their pages, NaN (or poison bytes, or NaN
scales) in every slot no query may read, vLLM's sliding tables with null blocks. Then against the
jnp reference and the tiled form on the same pages, elementwise. The CUDA lowering of the same
code is checked in test_gpu_lowering.py.

Stated tolerance against float64, f32 queries: 1e-5 relative + 1e-6 × max |V| absolute (f32
arithmetic with Precision.HIGHEST dots); against the reference and the tiled form the same
(tests/ragged_cases.py's RTOL, ATOL).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import paged_attention
from kvjax.attention.pallas_ragged import RaggedTiles, mla_ragged_paged_attention, ragged_paged_attention
from kvjax.attention.reference import mla_paged_attention_reference, paged_attention_reference
from kvjax.attention.tiled import PrefillTiles, paged_attention_tiled
from kvjax.errors import KvjaxError
from kvjax.worker.paged_cache import KVPages

from nvfp4_numpy import decode as nvfp4_decode
from ragged_cases import (MAX_TOKENS, SCALE, SEQS, Z, assert_equal_to_reference, gqa_case, jitted, mla_case,
                          values_max, with_variant)



def tiles_for(heads: int, kv_heads: int) -> list[RaggedTiles]:
    """16 and 32 query rows (Triton's least, and twice it) over kv steps of 4 and 8 pages of 4 positions."""
    group = heads // kv_heads
    return [RaggedTiles(q_tile=16 // group, pages_per_block=4), RaggedTiles(q_tile=32 // group, pages_per_block=8)]


# ---------------------------------------------------------------------------- float64 NumPy

def dequantized(pages, scale, fmt) -> np.ndarray:
    """f64 page values [P, Z, K, H] (MLA: [P, Z, C]) as the format defines them; poison stays poison."""
    if fmt == "nvfp4":  # per kv head: E2M1 × e4m3 block scale × the per-tensor scale
        return nvfp4_decode(np.asarray(pages)) * np.asarray(scale, np.float64)[:, None]
    x = np.asarray(jnp.asarray(pages, jnp.float32), np.float64)
    if scale is None:
        return x
    scale = np.asarray(scale, np.float64)
    if scale.ndim == x.ndim - 1:  # per-token scale pages
        return x * scale[..., None]
    return x * (scale[:, None] if x.ndim == 4 else scale)  # per kv head; MLA per channel


def attention_numpy(q, keys, values, md, *, scale, window=None, sinks=None, softcap=None):
    """q f64 [T, N, Hk]; keys f64 [P, Z, K, Hk], values f64 [P, Z, K, Hv] → f64 [T, N, Hv], token by token."""
    q, t_count = np.asarray(q, np.float64), q.shape[0]
    heads, kv_heads = q.shape[1], keys.shape[2]
    tables, lens = np.asarray(md.block_tables), np.asarray(md.context_lens)
    out = np.zeros((t_count, heads, values.shape[-1]))
    for t in range(t_count):
        if not md.valid[t]:
            continue
        b, pos = int(md.seq_ids[t]), int(md.positions[t])
        s = np.arange(min(pos + 1, lens[b]))
        if window is not None:
            s = s[s > pos - window]
        pages, slots = tables[b][s // Z], s % Z
        for n in range(heads):
            h = n // (heads // kv_heads)
            scores = keys[pages, slots, h] @ q[t, n] * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            peak = scores.max(initial=-np.inf if sinks is None else float(sinks[n]))
            weights = np.exp(scores - peak)
            denom = weights.sum() + (0.0 if sinks is None else np.exp(float(sinks[n]) - peak))
            out[t, n] = weights @ values[pages, slots, h] / denom if denom > 0 else 0.0
    return out


def assert_close_to_numpy(got, want, v_max):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.isfinite(got).all(), "an unread slot leaked"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * v_max)


def run_kernel(q, k_pages, v_pages, md, tiles, **kw):
    return jitted(ragged_paged_attention, q, k_pages, v_pages, md, tiles=tiles, interpret=True, **kw)


# ---------------------------------------------------------------------------- GQA / MQA / MHA

QUICK = {(None, 2, "fp8_e4m3"), (3, 1, "int8_per_token_head"), (2 * Z + 1, 4, None), (1, 2, "nvfp4"),
         (None, 1, "fp8_per_token_head")}


@pytest.mark.parametrize("window, kv_heads, fmt", [  # kv_heads 4, 2, 1: MHA, GQA (group 2), MQA
    pytest.param(w, k, f, marks=() if (w, k, f) in QUICK else pytest.mark.slow)
    for w in (None, 1, 3, 2 * Z + 1) for k in (4, 2, 1)
    for f in (None, "bf16", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head", "nvfp4")])
def test_kernel_matches_numpy(fmt, kv_heads, window):
    q, k_pages, v_pages, md, kw = gqa_case(kv_heads, window, fmt, seed=kv_heads)
    kw = with_variant(kw, "sinks+softcap", np.random.default_rng(kv_heads))
    keys, values = (dequantized(p, kw[s], fmt) for p, s in ((k_pages, "k_scale"), (v_pages, "v_scale")))
    want = attention_numpy(q, keys, values, md, scale=SCALE, window=window, sinks=kw["sinks"], softcap=kw["softcap"])
    for tiles in tiles_for(q.shape[1], kv_heads):
        got = run_kernel(q, k_pages, v_pages, md, tiles, **kw)
        assert_close_to_numpy(got, want, values_max(v_pages, kw))
    assert not np.asarray(got)[sum(n for _, n in SEQS):].any(), "padding tokens attend to nothing"


@pytest.mark.parametrize("variant", ["plain", "sinks", "softcap"])
def test_kernel_equals_reference_and_tiled(variant):
    """Kernel = tiled = reference elementwise on the same pages (a window shorter than a kv step)."""
    q, k_pages, v_pages, md, kw = gqa_case(2, 6, "fp8_e4m3", seed=5)
    kw = with_variant(kw, variant, np.random.default_rng(5))
    want = jitted(paged_attention_reference, q, k_pages, v_pages, md, **kw)
    tiled = jitted(paged_attention_tiled, q, k_pages, v_pages, md, tiles=PrefillTiles(q_tile=4, kv_tokens=2 * Z), **kw)
    got = run_kernel(q, k_pages, v_pages, md, tiles_for(q.shape[1], 2)[0], **kw)
    for out in (tiled, got):
        assert_equal_to_reference(out, want, values_max(v_pages, kw))


def test_bf16_queries():
    """bf16 queries: dots in bf16 (fp8 pages are exact in it), probabilities rounded to bf16 for P·V
    as FlashAttention does, f32 accumulation: within bf16's rounding of the f32 reference."""
    q, k_pages, v_pages, md, kw = gqa_case(2, None, "fp8_e4m3", seed=6)
    got = run_kernel(q.astype(jnp.bfloat16), k_pages, v_pages, md, tiles_for(q.shape[1], 2)[0], **kw)
    want = jitted(paged_attention_reference, q.astype(jnp.bfloat16), k_pages, v_pages, md, **kw)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -6,
                               atol=2 ** -6 * values_max(v_pages, kw))


# ---------------------------------------------------------------------------- MLA

@pytest.mark.parametrize("fmt", [None, pytest.param("fp8_e4m3", marks=pytest.mark.slow), "int8_per_token_head",
                                 pytest.param("fp8_per_token_head", marks=pytest.mark.slow)])
def test_mla_kernel_matches_numpy_and_reference(fmt):
    q_latent, q_rope, latent, md, kw = mla_case(fmt, 7)
    rank, heads, scale = q_latent.shape[2], q_latent.shape[1], kw["latent_scale"]
    values = dequantized(latent, scale, fmt)[:, :, None]  # one kv head: key = latent, value = c_kv
    want = attention_numpy(jnp.concatenate([q_latent, q_rope], -1), values, values[..., :rank], md, scale=SCALE)
    v_max = values_max(latent, dict(v_scale=scale))
    for tiles in (RaggedTiles(q_tile=4, pages_per_block=4), RaggedTiles(q_tile=8, pages_per_block=16)):  # 16, 32 rows
        got = jitted(mla_ragged_paged_attention, q_latent, q_rope, latent, md, tiles=tiles, interpret=True, **kw)
        assert got.shape == (MAX_TOKENS, heads, rank)
        assert_close_to_numpy(got, want, v_max)
    assert_equal_to_reference(got, jitted(mla_paged_attention_reference, q_latent, q_rope, latent, md, **kw), v_max)


# ---------------------------------------------------------------------------- tiles and bad input

def test_default_tiles_follow_the_shape():
    assert RaggedTiles().resolve(group_rows=4, block_size=16, max_query_len=512) == RaggedTiles(32, 4)
    assert RaggedTiles().resolve(group_rows=1, block_size=64, max_query_len=8) == RaggedTiles(16, 1)  # 16 rows least
    assert RaggedTiles().resolve(group_rows=64, block_size=1, max_query_len=2048) == RaggedTiles(2, 64)
    assert RaggedTiles(q_tile=64).resolve(group_rows=2, block_size=16, max_query_len=20) == RaggedTiles(32, 4)


@pytest.mark.parametrize("change, match", [
    (dict(tiles=RaggedTiles(q_tile=3)), "q_tile must be a power of two"),
    (dict(tiles=RaggedTiles(pages_per_block=-1)), "pages_per_block must be a non-negative int, got -1"),
    (dict(tiles=RaggedTiles(q_tile=2, pages_per_block=4)), "4 rows .* Triton dots need >= 16"),
    (dict(head_dim=12), "head dim 12 must be a power of two"),
    (dict(kv_dtype="fp8_e4m3"), "fp8_e4m3 pages are float8_e4m3fn, got float32"),
    (dict(q_dtype=jnp.int32), "q dtype int32 unsupported"),
    (dict(window=0), "window"),
])
def test_bad_input_is_refused_by_name(change, match):
    q, k_pages, v_pages, md, kw = gqa_case(2, None)
    head_dim = change.pop("head_dim", None)
    if head_dim is not None:
        q, k_pages, v_pages = q[..., :head_dim], k_pages[..., :head_dim], v_pages[..., :head_dim]
    q = q.astype(change.pop("q_dtype", q.dtype))
    with pytest.raises(KvjaxError, match=match):
        ragged_paged_attention(q, k_pages, v_pages, md, **{**kw, "interpret": True, **change})


def test_the_pallas_impl_runs_the_kernel_on_ragged_steps():
    """attn_impl "pallas" sends prefill and mixed steps to the kernel (decode steps to the decode
    kernels); the engine's tests with attention_backend "pallas" run it end to end against
    transformers (tests/engine/test_engine_hf.py and the sliding / gpt-oss ones)."""
    q, k_pages, v_pages, md, kw = gqa_case(2, 3, "fp8_e4m3")
    pages = KVPages(k_pages, v_pages, kw["k_scale"], kw["v_scale"], kv_dtype="fp8_e4m3")
    jaxpr = str(jax.make_jaxpr(lambda x: paged_attention(x, pages, md, scale=SCALE, impl="pallas", window=3))(q))
    assert "kvjax_ragged_paged_attention_gqa" in jaxpr
    assert "kvjax_ragged" not in str(jax.make_jaxpr(lambda x: paged_attention(x, pages, md, scale=SCALE, window=3))(q))
