"""Quantizer round trips against ml_dtypes casts, saturation, scales, calibration statistics."""
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.quant import formats as quant
from kvjax.quant.kv_formats import kv_format

E4M3, E5M2, INT8 = quant.FORMATS["fp8_e4m3"], quant.FORMATS["fp8_e5m2"], quant.FORMATS["int8_per_token_head"]


def test_format_maxima_are_the_published_ones():
    assert E4M3.max == 448.0 and E5M2.max == 57344.0 and INT8.max == 127.0
    assert kv_format("fp8") is E4M3
    assert set(quant.FORMATS) == {"fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"}


@pytest.mark.parametrize("fmt, np_dtype", [(E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2)])
def test_in_range_cast_matches_ml_dtypes(fmt, np_dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * fmt.max / 4).astype(np.float32)
    x = np.clip(x, -fmt.max, fmt.max)
    got = np.asarray(quant.saturating_cast(jnp.asarray(x), fmt)).astype(np.float32)
    want = x.astype(np_dtype).astype(np.float32)  # ml_dtypes: round to nearest even
    np.testing.assert_array_equal(got, want)


def test_bare_casts_do_not_saturate_but_ours_do():
    big = np.array([470.0, 1000.0, np.inf, -np.inf, -1e6], np.float32)
    # the hazard we guard against, as ml_dtypes shows it
    assert np.isnan(big[:3].astype(ml_dtypes.float8_e4m3fn).astype(np.float32)).all()
    assert np.isinf(np.array([61440.0, 1e6], np.float32).astype(ml_dtypes.float8_e5m2).astype(np.float32)).all()
    e4 = np.asarray(quant.saturating_cast(jnp.asarray(big), E4M3)).astype(np.float32)
    np.testing.assert_array_equal(e4, [448, 448, 448, -448, -448])
    e5 = np.asarray(quant.saturating_cast(jnp.asarray(np.array([61440.0, 1e6, np.inf, -1e9], np.float32)), E5M2))
    np.testing.assert_array_equal(e5.astype(np.float32), [57344, 57344, 57344, -57344])


def test_nan_stays_visible_and_is_counted():
    x = jnp.array([1.0, jnp.nan, jnp.inf, -2.0])
    q = np.asarray(quant.saturating_cast(x, E4M3)).astype(np.float32)
    assert np.isnan(q[1]) and q[2] == 448.0
    assert int(quant.count_nonfinite(x)) == 2


def test_scaled_round_trip_error_bound():
    # e4m3 has 3 mantissa bits: relative rounding error ≤ 2^-4 for normal values.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 4, 32)).astype(np.float32) * 30.0)
    amax = quant.amax_per_head(x)
    scale = quant.scale_from_amax(amax, E4M3)
    q = quant.quantize(x, scale[:, None], E4M3)
    assert q.dtype == jnp.float8_e4m3fn
    back = np.asarray(quant.dequantize(q, scale[:, None]))
    xs = np.asarray(x)
    normal = np.abs(xs) / np.asarray(scale)[:, None] >= 2.0**-6  # e4m3 smallest normal
    assert np.all(np.abs(back - xs)[normal] <= 2.0**-4 * np.abs(xs)[normal] + 1e-7)
    # the largest value per head lands exactly on ±448 × scale
    np.testing.assert_allclose(np.abs(back).max(axis=(0, 2)), np.asarray(amax), rtol=1e-6)


def test_calibration_amax_on_a_known_tensor():
    # K of shape [T=3, K=2, H=2] with hand-picked maxima: head 0 → 8.96, head 1 → 4.48
    k = jnp.array([[[1.0, -8.96], [0.5, 2.0]], [[3.0, 0.0], [-4.48, 1.0]], [[0.1, 0.2], [0.3, 0.4]]])
    amax = np.asarray(quant.amax_per_head(k))
    np.testing.assert_allclose(amax, [8.96, 4.48], rtol=1e-7)
    per_head = quant.scales_from_amax([amax], [amax], E4M3, "per_head")
    np.testing.assert_allclose(per_head.k[0], [8.96 / 448, 4.48 / 448], rtol=1e-6)
    per_tensor = quant.scales_from_amax([amax], [amax], E4M3, "per_tensor")
    np.testing.assert_allclose(per_tensor.k[0], [0.02, 0.02], rtol=1e-6)
    unit = quant.scales_from_amax([amax], [amax], E4M3, "unit")
    np.testing.assert_array_equal(unit.k[0], [1.0, 1.0])
    e5 = quant.scales_from_amax([amax], [amax], E5M2, "per_head")
    np.testing.assert_allclose(e5.k[0], [8.96 / 57344, 4.48 / 57344], rtol=1e-6)


def test_dynamic_scales_are_vllms_calc_kv_scales():
    # vLLM's Attention.calc_kv_scales (until 0.19): k_scale = max |k| / 200, v_scale = max |v| / 100, one
    # per layer over every head, whatever the fp8 format; an all-zero layer keeps 1.0
    amax_k, amax_v = np.array([8.96, 4.48], np.float32), np.array([0.5, 3.0], np.float32)
    for fmt in (E4M3, E5M2):
        s = quant.scales_from_amax([amax_k, np.zeros(2)], [amax_v, amax_v], fmt, "dynamic")
        np.testing.assert_allclose(s.k[0], [8.96 / 200, 8.96 / 200], rtol=1e-6)
        np.testing.assert_allclose(s.v[0], [3.0 / 100, 3.0 / 100], rtol=1e-6)
        np.testing.assert_array_equal(s.k[1], [1.0, 1.0])
        assert s.mode == "dynamic" and s.format == fmt.name
    mla = quant.scales_from_amax([np.array([1.0, 4.0, 2.0], np.float32)], [], E4M3, "dynamic", mla_rank=2)
    np.testing.assert_allclose(mla.k[0], [0.02, 0.02, 0.02], rtol=1e-6)  # one latent scale: 4 / 200


def test_mla_scales_split_latent_and_rope():
    amax = np.array([1.0, 4.48, 2.0, 0.896, 0.1], np.float32)  # 3 latent channels, 2 rope
    s = quant.scales_from_amax([amax], [], E4M3, "per_tensor", mla_rank=3)
    np.testing.assert_allclose(s.k[0], [0.01, 0.01, 0.01, 0.002, 0.002], rtol=1e-6)


def test_zero_amax_gets_unit_scale():
    np.testing.assert_allclose(np.asarray(quant.scale_from_amax(jnp.array([0.0, 4.48]), E4M3)), [1.0, 0.01], rtol=1e-6)


def _vllm_per_token_head(x, qmax, integer, scale=None):
    """vLLM 0.33's _reshape_cache_per_token_head in NumPy f32: scale = max(amax / qmax, 1e-6), y = x × (1 / scale);
    int8 rounds half away from zero (then truncates) into [-128, 127], fp8 clamps to ±448 and casts. `scale`:
    use these scales instead (XLA, like Triton, may divide by a constant through its reciprocal: an ulp apart)."""
    if scale is None:
        scale = np.maximum(np.abs(x).max(axis=-1) / np.float32(qmax), np.float32(1e-6)).astype(np.float32)
    y = (x * (np.float32(1) / scale)[..., None]).astype(np.float32)
    if integer:
        return np.trunc(np.clip(np.where(y >= 0, y + 0.5, y - 0.5), -128, 127)).astype(np.int8), scale
    return np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("name", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_equals_vllms_kernel(name):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32) * 7
    x[0, 0] = 0.0  # an all-zero vector: scale 1e-6, zeros stored
    fmt = quant.FORMATS[name]
    q, scale = quant.quantize_per_token_head(jnp.asarray(x), fmt)
    assert q.dtype == fmt.dtype and scale.shape == (5, 3)
    _, want_scale = _vllm_per_token_head(x, fmt.max, fmt.integer)
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=2e-7, atol=0)  # amax / max, to an ulp
    want_q, _ = _vllm_per_token_head(x, fmt.max, fmt.integer, np.asarray(scale))
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want_q.astype(np.float32))
    assert np.asarray(scale)[0, 0] == np.float32(1e-6) and not np.asarray(q)[0, 0].astype(np.float32).any()
    back = np.asarray(quant.dequantize(q, scale[..., None]))
    bound = want_scale[..., None] / 2 if fmt.integer else np.abs(x) * 2.0**-4 + want_scale[..., None] * 2.0**-9
    assert np.all(np.abs(back - x) <= bound + 1e-6)


def test_int8_rounds_half_away_from_zero():
    # amax 127 → scale exactly 1: y = x, and the ties go away from zero (not to even as np.rint would)
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, -126.5, 3.0]], np.float32)
    q, scale = quant.quantize_per_token_head(jnp.asarray(x), quant.FORMATS["int8_per_token_head"])
    assert float(scale[0]) == 1.0
    assert np.asarray(q).tolist() == [[127, 1, 2, 3, -1, -3, -127, 3]]


def test_quantize_runs_under_jit():
    f = jax.jit(lambda x, s: quant.quantize(x, s, E5M2))
    assert f(jnp.ones((4, 2)), jnp.float32(0.5)).dtype == jnp.float8_e5m2


def test_scales_file_round_trip_and_errors(tmp_path):
    s = quant.scales_from_amax([np.array([4.48, 8.96])], [np.array([1.0, 2.0])], E4M3, "per_head")
    path = tmp_path / "scales.json"
    s.save(path)
    back = quant.KVScales.load(path)
    assert (back.format, back.mode) == ("fp8_e4m3", "per_head")
    np.testing.assert_allclose(back.k[0], [0.01, 0.02], rtol=1e-6)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "fp8_e4m3", "mode": "per_head", "k": [[0.0, 1.0]]}))
    with pytest.raises(ValueError, match=r'"k" layer 0 holds 0.0: values must be positive'):
        quant.KVScales.load(bad)
    bad.write_text(json.dumps({"mode": "per_head"}))
    with pytest.raises(ValueError, match="lacks format, k"):
        quant.KVScales.load(bad)
    with pytest.raises(ValueError, match="does not exist"):
        quant.KVScales.load(tmp_path / "none.json")
    with pytest.raises(ValueError, match="unknown scale mode 'per_row'"):
        quant.scales_from_amax([], [], E4M3, "per_row")
