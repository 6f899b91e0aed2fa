"""nvfp4 in plain NumPy, written from vLLM 0.33's formulas (`ref_nvfp4_quant`, the packed KV layout of
`nvfp4_split_data_scale`) and not from kvjax.quant.nvfp4, for the tests to compare against.

E2M1 rounding is a nearest-neighbour search over the eight magnitudes, ties to the even code;
block scales are cast by ml_dtypes' float8_e4m3fn; bytes are packed and read one at a time.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
F32 = np.float32


def ref_code(y: float) -> int:
    """E2M1 code of y in [-6, 6]: the nearest magnitude, ties to the even code (mantissa bit 0)."""
    a = abs(float(y))
    d = np.abs(GRID.astype(np.float64) - a)
    best = [m for m in range(8) if d[m] == d.min()]
    m = best[0] if len(best) == 1 else [m for m in best if m % 2 == 0][0]
    return (8 if np.signbit(y) else 0) | m


def ref_quantize(x: np.ndarray, g: float) -> np.ndarray:
    """x f32[n, H] → uint8[n, H/2 + H/16], vLLM's ref_nvfp4_quant written out in NumPy."""
    n, h = x.shape
    g = F32(g)
    out = np.zeros((n, h // 2 + h // 16), np.uint8)
    for r in range(n):
        for b in range(h // 16):
            block = x[r, 16 * b:16 * (b + 1)].astype(np.float32)
            amax = F32(np.max(np.abs(block)))
            s = np.clip(F32(g * F32(amax * F32(1 / 6))), F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn)
            s32 = F32(s)
            inv = F32(0) if s32 == 0 else F32(F32(1) / F32(s32 * F32(F32(1) / g)))
            codes = [ref_code(np.clip(F32(v * inv), F32(-6), F32(6))) for v in block]
            for i in range(8):
                out[r, 8 * b + i] = codes[2 * i] | (codes[2 * i + 1] << 4)
            out[r, h // 2 + b] = np.array(s).view(np.uint8)
    return out


def ref_dequantize(packed: np.ndarray, decode_scale: float) -> np.ndarray:
    n, w = packed.shape
    half = w * 8 // 9  # data bytes: H / 2 of the H / 2 + H / 16
    h = 2 * half
    out = np.zeros((n, h), np.float32)
    for r in range(n):
        for j in range(h):
            byte = int(packed[r, j // 2])
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            value = -GRID[code & 7] if code & 8 else GRID[code & 7]
            s = F32(np.array(packed[r, half + j // 16], np.uint8).view(ml_dtypes.float8_e4m3fn))
            out[r, j] = F32(value) * F32(s * F32(decode_scale))
    return out


def decode(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., H/2 + H/16] → f64 [..., H] (no per-tensor scale), vectorized, from the layout alone."""
    half = packed.shape[-1] * 8 // 9
    data, sbytes = packed[..., :half], packed[..., half:]
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1], 2 * half)
    values = np.where(codes & 8, -1.0, 1.0) * GRID[codes & 7].astype(np.float64)
    scales = np.ascontiguousarray(sbytes).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values * np.repeat(scales, 16, axis=-1)
