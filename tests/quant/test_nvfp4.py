"""nvfp4 (kvjax.quant.nvfp4) against an independent NumPy implementation, bit for bit.

The reference (tests/nvfp4_numpy.py) is written from vLLM's formulas, not from the module: the E2M1
rounding is a nearest-neighbour search over the eight magnitudes with ties to the even code, the
block scale is cast by ml_dtypes' float8_e4m3fn, and the bytes are packed one by one. The hand-picked cases:
every E2M1 code, values on and next to every rounding midpoint, block maxima whose scale lands
on an e4m3 rounding tie, in e4m3's subnormal range, below it and beyond 448, all-zero blocks, a
block of one outlier, non-unit per-tensor scales, and NaN / inf.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from nvfp4_numpy import F32, GRID, ref_dequantize, ref_quantize

from kvjax.quant import nvfp4

def _row(values, fill=6.0):
    """One 16-value block: the values, then `fill` (a block maximum of 6 gives scale 1 at g = 1)."""
    values = list(values)
    return np.array(values + [fill] * (16 - len(values)), np.float32)


def _cases():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    near = [np.nextafter(F32(m), F32(0)) for m in mids] + [np.nextafter(F32(m), F32(9)) for m in mids]
    codes = np.concatenate([GRID, -GRID])  # every code, -0.0 included
    rows = {
        "every code": np.stack([codes, codes[::-1]]),
        "midpoints": np.stack([_row(mids), _row([-m for m in mids])]),
        "next to midpoints": np.stack([_row(near[:7]), _row(near[7:])]),
        # scale g·amax/6 on e4m3 ties: 1.0625 (→ 1.0), 1.1875 (→ 1.25), 2^-10 (half the smallest
        # subnormal: → 0), 3·2^-10 (→ 2^-8), and past 448 (→ 448)
        "e4m3 ties": np.stack([_row([1.0], 6 * 1.0625), _row([1.0], 6 * 1.1875), _row([1e-4], 6 * 2.0**-10),
                               _row([1e-4], 6 * 3 * 2.0**-10), _row([1.0], 6 * 1000.0)]),
        "zeros": np.zeros((2, 16), np.float32),
        "one outlier": np.stack([_row([100.0, 0.3, -0.01, 1.9], 0.02)]),
        "random two blocks": np.random.default_rng(0).normal(0, 3, (4, 32)).astype(np.float32),
    }
    return rows


CASES = _cases()


@pytest.mark.parametrize("g", [1.0, 0.37, 9.5])
@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_equals_numpy_bit_for_bit(name, g):
    x = CASES[name]
    want = ref_quantize(x, g)
    got = np.asarray(nvfp4.quantize(jnp.asarray(x), g))
    np.testing.assert_array_equal(got, want)
    back = np.asarray(nvfp4.dequantize(jnp.asarray(got), F32(1) / F32(g)))
    np.testing.assert_array_equal(back.view(np.uint32), ref_dequantize(want, F32(1) / F32(g)).view(np.uint32))


def test_hand_worked_values():
    # at g = 1 and a block maximum of 6 the block scale is exactly 1: every grid value round-trips
    x = np.stack([CASES["every code"][0]])
    packed = np.asarray(nvfp4.quantize(jnp.asarray(x), 1.0))
    assert packed.shape == (1, 9) and packed[0, 8] == 0x38  # e4m3 1.0 = 0 0111 000
    assert list(packed[0, :8]) == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(jnp.asarray(packed), 1.0)), x)
    # ties to even: 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4
    mids = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(CASES["midpoints"][:1]), 1.0), 1.0))[0, :7]
    assert list(mids) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # a block of zeros has scale 0 and reads back as zeros; an outlier flushes its small neighbours
    assert not np.asarray(nvfp4.quantize(jnp.zeros((1, 16)), 1.0)).any()
    out = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(CASES["one outlier"]), 1.0), 1.0))[0]
    assert out[0] == pytest.approx(100.0, rel=0.07) and out[2] == 0 and np.all(out[4:] == 0)


def test_nan_makes_its_block_nan_and_inf_saturates():
    x = np.array([_row([np.nan, 1.0]), _row([np.inf, -1.0]), _row([1.0, 2.0])], np.float32)
    x = np.concatenate([x, x[::-1]], axis=1)  # two blocks per row
    back = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(x), 1.0), 1.0))
    assert np.isnan(back[0, :16]).all() and not np.isnan(back[0, 16:]).any()
    assert back[1, 0] == 6 * 448.0 and back[1, 1] == 0.0  # ±inf → 6 × the saturated scale 448
    assert np.isnan(back[2, 16:]).all()


def test_packed_width_and_refusals():
    assert nvfp4.packed_width(128) == 64 + 8 == 128 * 4 // 8 + 128 // 16
    with pytest.raises(ValueError, match="24"):
        nvfp4.packed_width(24)


def test_e4m3_bytes_decode_as_ml_dtypes_reads_them():
    """The block scales are read by integer arithmetic (the kernel has no bitcast): all 256 bytes."""
    import ml_dtypes

    raw = np.arange(256, dtype=np.uint8)
    want = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(nvfp4.e4m3_values(jnp.asarray(raw)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))
