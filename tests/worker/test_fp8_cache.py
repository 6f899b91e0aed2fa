"""Quantized pages in the cache: writes store x / scale saturated, reads dequantize with the same
scales, and attention over a quantized cache equals f32 attention over the dequantized values.

The f32 side is an independent NumPy attention over values dequantized by hand
(stored.astype(f32) × scale), so the only tolerance is accumulation order, not quantization.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.attention import paged_attention
from kvjax.attention.metadata import build_metadata
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.quant import formats as quant
from kvjax.worker.paged_cache import KVPages, LatentPages, PagedCache, write_kv, write_latent

NP_DTYPE = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def numpy_attention(q, k, v, positions, scale):
    """One sequence, causal: q [T, N, H], k/v [S, K, H] f32 → [T, N, H] (float64 softmax)."""
    t, n, _ = q.shape
    g = n // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    for i in range(t):
        for h in range(n):
            kh = k[: positions[i] + 1, h // g].astype(np.float64)
            s = kh @ q[i, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            w /= w.sum()
            out[i, h] = w @ v[: positions[i] + 1, h // g]
    return out


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"])
def test_attention_over_quantized_cache_equals_f32_over_dequantized(kv_dtype):
    rng = np.random.default_rng(0)
    spec = KVSpec("gqa", 1, 4, 2, 8, kv_dtype=kv_dtype)
    amax_k, amax_v = np.array([3.0, 12.0], np.float32), np.array([0.5, 2.0], np.float32)
    scales = None
    if not kv_dtype.endswith("per_token_head"):
        fmt = quant.FORMATS[kv_dtype]
        scales = quant.scales_from_amax([amax_k], [amax_v], fmt, "per_head")
    cache = PagedCache.create(spec, 5, 4, scales)
    seq = 11  # not a multiple of the block size
    k = rng.standard_normal((seq, 2, 8)).astype(np.float32) * amax_k[None, :, None] / 3
    v = rng.standard_normal((seq, 2, 8)).astype(np.float32) * amax_v[None, :, None] / 3
    q = rng.standard_normal((seq, 4, 8)).astype(np.float32)
    table = [3, 1, 4]
    md = build_metadata([0], [seq], [table], block_size=4, max_tokens=12, max_seqs=1, max_blocks_per_seq=3)
    pad = lambda x: jnp.asarray(np.pad(x, ((0, 1),) + ((0, 0),) * (x.ndim - 1)))  # noqa: E731
    pages = write_kv(cache.layers[0], pad(k), pad(v), md.slot_mapping)
    out = np.asarray(paged_attention(pad(q), pages, md, scale=0.3))[:seq]

    slots = np.asarray(md.slot_mapping)[:seq]
    stored_k = np.asarray(pages.k).reshape(-1, 2, 8)[slots].astype(np.float32)
    stored_v = np.asarray(pages.v).reshape(-1, 2, 8)[slots].astype(np.float32)
    if kv_dtype.endswith("per_token_head"):  # vLLM 0.33's kernel: scale = amax / max, y = x × (1 / scale)
        qmax = 127 if kv_dtype.startswith("int8") else 448
        sk = np.asarray(pages.k_scale).reshape(-1, 2)[slots]
        sv = np.asarray(pages.v_scale).reshape(-1, 2)[slots]
        np.testing.assert_allclose(sk, np.abs(k).max(-1) / qmax, rtol=1e-6)  # scale per token per head
        y = k * (1 / sk[..., None])
        want = (np.trunc(np.where(y >= 0, y + 0.5, y - 0.5)) if qmax == 127
                else y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
        np.testing.assert_array_equal(stored_k, want)
        deq_k, deq_v = stored_k * sk[..., None], stored_v * sv[..., None]
    else:
        sk, sv = np.asarray(scales.k[0]), np.asarray(scales.v[0])
        np.testing.assert_allclose(sk, amax_k / fmt.max, rtol=1e-6)
        # stored = saturate(x / scale) cast by ml_dtypes' round-to-nearest-even
        want = np.clip(k / sk[None, :, None], -fmt.max, fmt.max).astype(NP_DTYPE[kv_dtype]).astype(np.float32)
        np.testing.assert_array_equal(stored_k, want)
        deq_k, deq_v = stored_k * sk[None, :, None], stored_v * sv[None, :, None]
    want = numpy_attention(q, deq_k, deq_v, np.arange(seq), 0.3)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
    assert int(pages.nonfinite) == 0


def test_mla_latent_fp8_per_channel_scales():
    rng = np.random.default_rng(1)
    spec = KVSpec.mla(1, 2, kv_lora_rank=8, qk_rope_head_dim=4, kv_dtype="fp8_e4m3")
    amax = np.concatenate([np.full(8, 6.0), np.full(4, 40.0)]).astype(np.float32)
    scales = quant.scales_from_amax([amax], [], quant.FORMATS["fp8_e4m3"], "per_tensor", mla_rank=8)
    cache = PagedCache.create(spec, 4, 4, scales)
    latent = rng.standard_normal((6, 12)).astype(np.float32) * amax / 3
    md = build_metadata([0], [6], [[2, 1]], block_size=4, max_tokens=6, max_seqs=1, max_blocks_per_seq=2)
    pages = write_latent(cache.layers[0], jnp.asarray(latent), md.slot_mapping)
    stored = np.asarray(pages.latent).reshape(-1, 12)[np.asarray(md.slot_mapping)].astype(np.float32)
    s = np.asarray(pages.scale)
    np.testing.assert_allclose(s[:8], 6.0 / 448, rtol=1e-6)
    np.testing.assert_allclose(s[8:], 40.0 / 448, rtol=1e-6)
    back = stored * s
    assert np.all(np.abs(back - latent) <= np.abs(latent) * 2.0**-4 + s * 2.0**-9)


def test_unit_scale_saturates_and_nonfinite_is_counted():
    spec = KVSpec("mha", 1, 1, 1, 4, kv_dtype="fp8_e4m3")
    cache = PagedCache.create(spec, 3, 2)  # no scales: vLLM's default 1.0
    np.testing.assert_array_equal(np.asarray(cache.layers[0].k_scale), [1.0])
    k = jnp.array([[[1000.0, -470.0, jnp.inf, jnp.nan]]])
    v = jnp.array([[[1.0, 2.0, 3.0, 4.0]]])
    pages = write_kv(cache.layers[0], k, v, jnp.array([2]))
    row = np.asarray(pages.k)[1, 0, 0].astype(np.float32)
    np.testing.assert_array_equal(row[:3], [448.0, -448.0, 448.0])  # saturated, not NaN
    assert np.isnan(row[3])  # NaN stays visible...
    assert int(pages.nonfinite) == 2  # ...and inf + NaN are counted
    e5 = PagedCache.create(spec.replace(kv_dtype="fp8_e5m2"), 3, 2)
    pages = write_kv(e5.layers[0], jnp.full((1, 1, 4), 1e6), v, jnp.array([2]))
    np.testing.assert_array_equal(np.asarray(pages.k)[1, 0, 0].astype(np.float32), [57344.0] * 4)


def test_quantized_cache_bytes():
    # fp8 GQA: pages 1 B/element; static scales f32[K] per layer for K and V, counted apart.
    spec = KVSpec("gqa", 3, 8, 2, 16, kv_dtype="fp8")
    cache = PagedCache.create(spec, 10, 4)
    assert cache.kv_nbytes == 10 * 3 * 2 * 4 * 2 * 16 == 10 * spec.bytes_per_block(4)
    assert cache.scale_nbytes == 3 * 2 * 2 * 4
    # int8 per token head: 1 B/element + one f32 per token per head for K and V, inside the block
    spec8 = spec.replace(kv_dtype="int8_per_token_head")
    cache8 = PagedCache.create(spec8, 10, 4)
    assert cache8.kv_nbytes == 10 * 3 * 2 * 4 * 2 * (16 + 4) == 10 * spec8.bytes_per_block(4)
    assert cache8.scale_nbytes == 0
    # skip layers keep the model dtype: layer 0 bf16, layers 1-2 fp8
    mixed = spec.replace(skip_layers=(0,), model_dtype="bf16")
    cache_m = PagedCache.create(mixed, 10, 4)
    assert cache_m.layers[0].k.dtype == jnp.bfloat16 and cache_m.layers[0].k_scale is None
    assert cache_m.layers[1].k.dtype == jnp.float8_e4m3fn
    assert cache_m.kv_nbytes == 10 * (2 * 4 * 2 * 16 * 2 + 2 * (2 * 4 * 2 * 16)) == 10 * mixed.bytes_per_block(4)


def test_scales_must_match_the_layout():
    spec = KVSpec("gqa", 2, 8, 2, 16, kv_dtype="fp8")
    bad = quant.scales_from_amax([np.ones(3)] * 2, [np.ones(3)] * 2, quant.FORMATS["fp8_e4m3"], "per_head")
    with pytest.raises(ValueError, match="layer 0 k scale has 3 values; this layout needs 2"):
        PagedCache.create(spec, 4, 4, bad)
    short = quant.scales_from_amax([np.ones(2)], [np.ones(2)], quant.FORMATS["fp8_e4m3"], "per_head")
    with pytest.raises(ValueError, match="scales hold 1 k layers, the model has 2"):
        PagedCache.create(spec, 4, 4, short)


def test_quantized_write_runs_jitted_and_donated():
    spec = KVSpec("gqa", 1, 4, 2, 8, kv_dtype="fp8_e5m2")
    cache = PagedCache.create(spec, 4, 4)
    step = jax.jit(lambda p, k, v, s: write_kv(p, k, v, s), donate_argnums=0)
    pages = step(cache.layers[0], jnp.ones((2, 2, 8)), jnp.ones((2, 2, 8)), jnp.array([4, 5]))
    assert isinstance(pages, KVPages) and pages.k.dtype == jnp.float8_e5m2
    assert isinstance(PagedCache.create(KVSpec.mla(1, 2, kv_lora_rank=8, qk_rope_head_dim=4,
                                                   kv_dtype="int8_per_token_head"), 3, 2).layers[0], LatentPages)


def test_nvfp4_pages_hold_vllms_packed_bytes_and_attention_reads_them():
    """A write stores each token's K/V heads as nvfp4.quantize packs them (checked bit for bit
    against NumPy in tests/quant/test_nvfp4.py) with the per-tensor scale's inverse as the
    encoding multiplier; prefill attention over those pages equals NumPy attention over the bytes
    decoded by tests/nvfp4_numpy.py, times the per-tensor scale."""
    from nvfp4_numpy import decode as decode_numpy

    from kvjax.quant import nvfp4

    rng = np.random.default_rng(2)
    spec = KVSpec("gqa", 1, 4, 2, 32, kv_dtype="nvfp4")
    cache = PagedCache.create(spec, 5, 4)
    pages = cache.layers[0].replace(k_scale=jnp.asarray([0.5, 2.0]), v_scale=jnp.asarray([1.0, 0.25]))
    seq = 11
    k = rng.standard_normal((seq, 2, 32)).astype(np.float32) * np.array([1.0, 6.0])[None, :, None]
    v = rng.standard_normal((seq, 2, 32)).astype(np.float32)
    k[3, 1, 5] = np.nan  # counted, and it spoils its block only
    q = rng.standard_normal((seq, 4, 32)).astype(np.float32)
    md = build_metadata([0], [seq], [[3, 1, 4]], block_size=4, max_tokens=12, max_seqs=1, max_blocks_per_seq=3)
    pad = lambda x: jnp.asarray(np.pad(x, ((0, 1),) + ((0, 0),) * (x.ndim - 1)))  # noqa: E731
    pages = write_kv(pages, pad(k), pad(v), md.slot_mapping)
    assert pages.k.dtype == jnp.uint8 and pages.k.shape == (5, 4, 2, 16 + 2) and int(pages.nonfinite) == 1
    slots = np.asarray(md.slot_mapping)[:seq]
    stored_k = np.asarray(pages.k).reshape(-1, 2, 18)[slots]
    stored_v = np.asarray(pages.v).reshape(-1, 2, 18)[slots]
    np.testing.assert_array_equal(stored_k, np.asarray(nvfp4.quantize(jnp.asarray(k), jnp.asarray([[2.0], [0.5]]))))
    k[3, 1] = 0.0  # attention below reads a token without the spoilt block
    pages = write_kv(pages, pad(k), pad(v), md.slot_mapping)
    stored_k = np.asarray(pages.k).reshape(-1, 2, 18)[slots]
    out = np.asarray(paged_attention(pad(q), pages, md, scale=0.3))[:seq]
    deq_k = decode_numpy(stored_k) * np.array([0.5, 2.0])[None, :, None]
    deq_v = decode_numpy(stored_v) * np.array([1.0, 0.25])[None, :, None]
    np.testing.assert_allclose(out, numpy_attention(q, deq_k, deq_v, np.arange(seq), 0.3), atol=2e-5, rtol=1e-5)
