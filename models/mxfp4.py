"""MXFP4 weights (OCP Microscaling, FP4 E2M1 elements with one E8M0 scale per 32) dequantized on the host.

gpt-oss ships its expert weights in MXFP4 (about 90% of its parameters; 4.25 bits a weight): each run
of 32 consecutive input-dim weights of one output row is 32 four-bit codes packed two to a byte (16
uint8 `blocks`) plus one uint8 `scales` byte, an exponent biased by 127. Weight = FP4[code] · 2^(scale -
127), with FP4 E2M1's 16 values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; the low nibble of byte j is element 2j,
the high nibble element 2j + 1 (OCP MX spec v1.0, §5.3 and §6.3).

`dequantize` reproduces transformers 5.24's `_convert_moe_packed_tensors` (integrations/mxfp4.py,
taken from OpenAI's gpt-oss reference) bit for bit: the code's value in the target dtype times
2^(scale - 127) by `ldexp`, exact except where the target dtype overflows (±inf) or underflows (its
nearest, ties to even); a zero code stays ±0 at every scale, also at 2^128 where a multiplication by
the power would give NaN. Every FP4 value has two significant bits, so the float32 product is exact
for all 256 scales (2^-128 is a float32 subnormal) and one cast rounds it to bfloat16 or float16 as
torch's ldexp in that dtype does. `unpack_experts` adds the layout step: checkpoints store
`[E, out, in / 32, 16]` blocks, transformers' expert parameters are [E, in, out].

Plain NumPy, in chunks of rows so a 5 GB expert tensor never has a float32 copy of itself.
"""
from __future__ import annotations

import numpy as np

from kvjax.models.tensors import CheckpointError

BLOCK = 32  # weights per scale (OCP MX block size)
# FP4 E2M1 by code: sign bit 3, exponent bits 2-1, mantissa bit 0 (OCP MX v1.0, table 5)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SCALE_BIAS = 127  # E8M0: 2^(byte - 127)
ROWS_PER_CHUNK = 1 << 16  # rows of 32 weights dequantized at once: 8 MB of float32


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """blocks u8[..., G, 16], scales u8[..., G] → dtype[..., G · 32]: each of the G groups of 32 weights
    along the last axis, FP4 codes (low nibble first) times 2^(scale - 127)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: "
                              f"blocks must be [..., G, {BLOCK // 2}] over scales [..., G]")
    *prefix, groups, half = blocks.shape
    rows = blocks.reshape(-1, half)  # u8[R, 16], one scale each
    exps = scales.reshape(-1).astype(np.int32) - SCALE_BIAS  # i32[R], in [-127, 128]
    out = np.empty((rows.shape[0], BLOCK), dtype)  # [R, 32]
    for r0 in range(0, rows.shape[0], ROWS_PER_CHUNK):
        r1 = min(r0 + ROWS_PER_CHUNK, rows.shape[0])
        codes = np.empty((r1 - r0, BLOCK), np.uint8)
        codes[:, 0::2] = rows[r0:r1] & 0x0F  # element 2j: the low nibble of byte j
        codes[:, 1::2] = rows[r0:r1] >> 4
        with np.errstate(over="ignore"):  # past the dtype's range: ±inf, as torch's ldexp gives
            values = np.ldexp(FP4_VALUES[codes], exps[r0:r1, None])  # f32, exact or ±inf
            out[r0:r1] = values.astype(dtype)
    return out.reshape(*prefix, groups * BLOCK)


def unpack_experts(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A checkpoint's stacked expert projection, blocks u8[E, out, in / 32, 16] and scales u8[E, out, in / 32],
    → dtype[E, in, out], transformers' parameter layout (`convert_moe_packed_tensors`)."""
    return np.swapaxes(dequantize(blocks, scales, dtype), 1, 2)
