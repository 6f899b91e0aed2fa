"""Rotary position embeddings as the supported checkpoints use them.

Matches transformers 5.x `modeling_rope_utils.py` (inverse frequencies and the cos/sin
"attention factor") and the models' `apply_rotary_pos_emb` variants:

- rope types: `default` (RoFormer, arXiv 2104.09864), `linear` (position interpolation),
  `llama3` (Llama 3.1's piecewise frequency scaling), `yarn` (arXiv 2309.00071, with
  DeepSeek's mscale / mscale_all_dim). Frequency-dependent types are computed on the host in
  float64 and stored as f32 constants; positions stay dynamic.
- layouts: `half` (GPT-NeoX `rotate_half`, Llama/Qwen), `interleaved` (DeepSeek-V3 with
  `rope_interleave`: pairs (x0, x1), (x2, x3), … rotated, results written as [evens | odds]),
  `complex` (DeepSeek-V2's `view_as_complex`: pairs rotated and kept interleaved). The two
  DeepSeek layouts give equal q·k; each is reproduced exactly so the cached rope key equals
  the checkpoint's own.

DeepSeek additionally multiplies the softmax scale by mscale(factor, mscale_all_dim)² for yarn
(`yarn_apply_mscale` in modeling_deepseek_v3.py): see `deepseek_softmax_scale`.

The parameters (`RopeConfig`) and their parsing from config.json live in kvjax.config.model and kvjax.config.hf.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config.model import LAYOUTS, RopeConfig, RopeError


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(rope: RopeConfig, max_position_embeddings: int) -> float:
    # transformers: a missing factor is the ratio of the extended to the pretrained context.
    return rope.factor or max_position_embeddings / rope.original_max_position_embeddings


def inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(f32[dim // 2] inverse frequencies, attention factor that scales cos and sin)."""
    if rope.unsupported:
        raise RopeError(rope.unsupported)
    if dim % 2:
        raise RopeError(f"rotary dim must be even, got {dim}")
    base = rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    freq = 1.0 / base
    attention_factor = 1.0
    if rope.rope_type == "linear":
        freq = freq / rope.factor
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freq = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        factor = _yarn_factor(rope, max_position_embeddings)
        attention_factor = rope.attention_factor
        if attention_factor is None:
            if rope.mscale and rope.mscale_all_dim:
                attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        fast, slow = rope.beta_fast or 32, rope.beta_slow or 1
        old = rope.original_max_position_embeddings

        def correction_dim(rotations):
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        low, high = correction_dim(fast), correction_dim(slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers: avoid a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
        freq = (freq / factor) * (1 - extrapolate) + freq * extrapolate
    with np.errstate(over="ignore"):
        freq32 = freq.astype(np.float32)
    # kvjax.config.model checks each parameter's domain; this catches what they give together
    # (a factor of 1e-40 divides the frequencies past float32), which would make attention NaN.
    if not (np.all(np.isfinite(freq32)) and math.isfinite(attention_factor) and attention_factor > 0):
        raise RopeError(f"{rope.rope_type} rope (rope_theta {rope.theta:g}, factor {rope.factor}) gives frequencies "
                        f"or an attention factor that are not finite and positive in float32")
    return freq32, float(attention_factor)


def deepseek_softmax_scale(rope: RopeConfig, qk_head_dim: int, max_position_embeddings: int) -> float:
    """DeepSeek's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² for yarn."""
    scale = qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor if rope.factor is not None else _yarn_factor(rope, max_position_embeddings),
                         rope.mscale_all_dim)
        scale *= m * m
    return scale


def apply_rope(x: jax.Array, positions: jax.Array, freq: np.ndarray, attention_factor: float,
               layout: str) -> jax.Array:
    """Rotate x: [T, heads, rope] at positions i32[T] by freq f32[rope // 2] → x's shape and dtype
    (heads: N, K or 1; rope: the rotated width, H or MLA's qk_rope_head_dim).

    The rotation runs in f32 for every layout (transformers does so for DeepSeek-V2 and in the
    input dtype elsewhere: identical in f32, within bf16 rounding otherwise).
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(freq)[None, :]  # f32[T, rope/2]
    cos = (jnp.cos(angles) * attention_factor)[:, None, :]  # f32[T, 1, rope/2]
    sin = (jnp.sin(angles) * attention_factor)[:, None, :]
    xf = x.astype(jnp.float32)
    if layout == "half":
        a, b = jnp.split(xf, 2, axis=-1)
    elif layout in ("interleaved", "complex"):
        a, b = xf[..., 0::2], xf[..., 1::2]
    else:
        raise RopeError(f"unknown rope layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    rot_a, rot_b = a * cos - b * sin, b * cos + a * sin
    if layout == "complex":
        out = jnp.stack([rot_a, rot_b], axis=-1).reshape(x.shape)
    else:
        out = jnp.concatenate([rot_a, rot_b], axis=-1)
    return out.astype(x.dtype)

