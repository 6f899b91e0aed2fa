"""nvfp4 KV: vLLM's packed layout and arithmetic, as plain jnp the cache, the reference attention
and the Pallas kernels share.

vLLM 0.33 stores an nvfp4 KV vector of H values (`--kv-cache-dtype nvfp4`; the page layout is
`vllm/utils/torch_utils.py`'s `nvfp4_kv_cache_full_dim` and `nvfp4_split_data_scale`) as
H/2 + H/16 bytes, data then scales:

    bytes [0, H/2)        E2M1 values packed two per byte: element 2i in the low nibble,
                          element 2i + 1 in the high nibble (sign bit 0x8, magnitude 0..7
                          → 0, 0.5, 1, 1.5, 2, 3, 4, 6)
    bytes [H/2, H/2+H/16) one fp8 e4m3 block scale per 16 consecutive values

and one per-tensor scale per layer beside the pages (vLLM's k_scale / v_scale, 1.0 by default).
The arithmetic is vLLM's reference `ref_nvfp4_quant` (`nvfp4_emulation_utils.py`), with the
per-tensor scale g as the encoding multiplier and 1/g as the decoding one:

    block scale  s = e4m3(clip(g × (amax16 × (1/6)), ±448))   (e4m3: round to nearest even)
    encoding     q = e2m1(clip(x × 1 / (s × (1/g)), ±6))      (0 when s is 0)
    decoding     x ≈ e2m1 value × (s × (1/g))

e2m1 rounds to nearest, ties to even (the hardware's cvt.rn.satfinite.e2m1x2 and vLLM's
`cast_to_fp4`: 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4). kvjax keeps,
as for fp8, the decoding scale beside the pages (x ≈ stored × scale), so a page's scale here is
1/g; vLLM's default 1.0 is the same either way. A NaN in a block makes that block's scale NaN,
so the whole block reads back as NaN (visible, and counted by the cache as for fp8); ±inf
saturates to ±6 × s.

Decoding is elementwise integer and float jnp (no table lookups, no bitcasts) and a broadcast
of the block scales, so the Pallas decode kernel unpacks its pages with the same `unpack`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

GROUP = 16  # values per fp8 block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# RNE boundaries between neighbouring E2M1 magnitudes: (midpoint, whether the midpoint itself rounds up).
_EDGES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def packed_width(head_dim: int) -> int:
    """Bytes of one packed vector of head_dim values: head_dim / 2 data + head_dim / 16 scales."""
    if head_dim % GROUP:
        raise ValueError(f"nvfp4 needs a head dim that is a multiple of {GROUP}, got {head_dim}")
    return head_dim // 2 + head_dim // GROUP


def page_refusal(kind: str, head_dim: int) -> str | None:
    """Why layers of this attention kind (a KVSpec's) and head dim have no nvfp4 page here, or None."""
    if kind == "mla":
        return "packs K/V heads; an MLA latent page has no nvfp4 layout here (vLLM's is nvfp4_ds_mla)"
    if head_dim % GROUP:
        return f"needs a head dim that is a multiple of {GROUP}, got {head_dim}"
    return None


def e2m1_codes(x: jax.Array) -> jax.Array:
    """f32 values already scaled into [-6, 6] → uint8 codes 0..15 (sign 0x8), rounded to nearest even."""
    a = jnp.abs(x)
    mag = sum(((a >= t) if up else (a > t)).astype(jnp.uint8) for t, up in _EDGES)
    sign = jnp.signbit(x).astype(jnp.uint8) << 3
    return sign | mag


def e2m1_values(codes: jax.Array) -> jax.Array:
    """uint8 codes 0..15 → f32 values: magnitude m = 2e + b is b/2 for e = 0, else (2 + b) · 2^e / 4."""
    codes = codes.astype(jnp.int32)
    m = codes & 7
    e, b = m >> 1, m & 1
    mag = jnp.where(e == 0, b.astype(jnp.float32) * 0.5, ((2 + b) << e).astype(jnp.float32) * 0.25)
    return jnp.where((codes & 8) != 0, -mag, mag)


def quantize(x: jax.Array, encode_scale) -> jax.Array:
    """x [..., H] → uint8 [..., H/2 + H/16]; encode_scale g (the per-tensor scale, broadcasting
    against x[..., :1], e.g. f32[K, 1] against [T, K, H]) multiplies the block maxima."""
    x = x.astype(jnp.float32)
    h = x.shape[-1]
    packed_width(h)
    blocks = x.reshape(*x.shape[:-1], h // GROUP, GROUP)
    g = jnp.asarray(encode_scale, jnp.float32)[..., None]  # against [..., H/16, 1]
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    s = jnp.clip(g * (amax * jnp.float32(1 / E2M1_MAX)), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    s32 = s.astype(jnp.float32)
    out_scale = jnp.where(s32 != 0, 1.0 / jnp.where(s32 != 0, s32 * (1.0 / g), 1.0), 0.0)
    codes = e2m1_codes(jnp.clip(blocks * out_scale, -E2M1_MAX, E2M1_MAX)).reshape(*x.shape[:-1], h // 2, 2)
    data = codes[..., 0] | (codes[..., 1] << 4)
    scale_bytes = lax.bitcast_convert_type(s[..., 0], jnp.uint8)
    return jnp.concatenate([data, scale_bytes], axis=-1)


def e4m3_values(byte: jax.Array) -> jax.Array:
    """uint8 bytes holding float8_e4m3fn → f32, by integer arithmetic (no bitcast, so the Pallas
    kernel can run it): sign 0x80, exponent e (4 bits, bias 7), mantissa m (3 bits); normal values
    (8 + m) · 2^e · 2^-10, subnormal (e = 0) 2m · 2^-10, e = 15 with m = 7 NaN. Exact: small integers
    times a power of two."""
    b = byte.astype(jnp.int32)
    e, m = (b >> 3) & 0xF, b & 7
    mag = jnp.where(e == 0, 2 * m, (8 + m) << e).astype(jnp.float32) * jnp.float32(2.0 ** -10)
    mag = jnp.where((e == 15) & (m == 7), jnp.nan, mag)
    return jnp.where((b & 0x80) != 0, -mag, mag)


def split(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 [..., H/2 + H/16] → (data uint8 [..., H/2], block-scale bytes uint8 [..., H/16])."""
    half = packed.shape[-1] * 8 // 9
    return packed[..., :half], packed[..., half:]


def unpack(data: jax.Array, scale_bytes: jax.Array, scale=1.0) -> tuple[jax.Array, jax.Array]:
    """(data uint8 [..., H/2], block-scale bytes uint8 [..., H/16]) → f32 (even, odd) [..., H/2]: the
    elements 0, 2, 4, ... (low nibbles) and 1, 3, 5, ... (high nibbles), each e2m1 value × (its
    block scale × scale). Byte i's two values share block i // 8. The Pallas kernel dots the two
    halves with q's even and odd lanes, so nothing is interleaved inside it."""
    half = data.shape[-1]
    s = e4m3_values(scale_bytes) * jnp.asarray(scale, jnp.float32)  # [..., H/16]
    s = jnp.broadcast_to(s[..., None], (*s.shape, GROUP // 2)).reshape(*s.shape[:-1], half)
    return e2m1_values(data & 0xF) * s, e2m1_values(data >> 4) * s


def dequantize(packed: jax.Array, decode_scale) -> jax.Array:
    """uint8 [..., H/2 + H/16] → f32 [..., H]: e2m1 value × (block scale × decode_scale), where
    decode_scale (1/g, broadcasting against packed[..., :1]) is the scale kvjax keeps beside the pages."""
    data, scale_bytes = split(packed)
    even, odd = unpack(data, scale_bytes, decode_scale)
    return jnp.stack([even, odd], axis=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])
