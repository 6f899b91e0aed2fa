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
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYOUTS = ("half", "interleaved", "complex")


class RopeError(ValueError):
    """RoPE parameters outside what kvjax reproduces; the message names the value."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    layout: str = "half"
    factor: float | None = None  # linear, llama3, yarn
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (default 32)
    beta_slow: float | None = None  # yarn (default 1)
    mscale: float | None = None  # yarn, DeepSeek
    mscale_all_dim: float | None = None  # yarn, DeepSeek
    attention_factor: float | None = None  # yarn: explicit cos/sin scale
    truncate: bool = True  # yarn correction range rounding

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise RopeError(f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.layout not in LAYOUTS:
            raise RopeError(f"unknown rope layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        if self.rope_type == "llama3" and None in (self.factor, self.low_freq_factor, self.high_freq_factor,
                                                    self.original_max_position_embeddings):
            raise RopeError("llama3 rope needs factor, low_freq_factor, high_freq_factor and "
                            "original_max_position_embeddings")
        if self.rope_type == "linear" and not self.factor:
            raise RopeError("linear rope needs a factor")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            raise RopeError("yarn rope needs original_max_position_embeddings")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(rope: RopeConfig, max_position_embeddings: int) -> float:
    # transformers: a missing factor is the ratio of the extended to the pretrained context.
    return rope.factor or max_position_embeddings / rope.original_max_position_embeddings


def inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(f32[dim // 2] inverse frequencies, attention factor that scales cos and sin)."""
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
    return freq.astype(np.float32), float(attention_factor)


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
    """Rotate x: [T, N, R] at positions i32[T] by freq f32[R // 2] → [T, N, R] in x's dtype.

    The rotation runs in f32 for every layout (transformers does so for DeepSeek-V2 and in the
    input dtype elsewhere: identical in f32, within bf16 rounding otherwise).
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(freq)[None, :]  # f32[T, R/2]
    cos = (jnp.cos(angles) * attention_factor)[:, None, :]  # f32[T, 1, R/2]
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


def from_hf(cfg: dict, layout: str = "half") -> RopeConfig:
    """RopeConfig from a config.json dict: `rope_parameters` (transformers 5) or the older
    `rope_scaling` + `rope_theta`. Unknown keys that change the result are refused."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise RopeError(f"partial_rotary_factor {partial} is not supported (only full rotary dims)")
    original = None
    if rope_type in ("llama3", "yarn"):
        original = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
    return RopeConfig(
        rope_type=rope_type, theta=float(theta), layout=layout, factor=params.get("factor"),
        original_max_position_embeddings=original, low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"), beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), attention_factor=params.get("attention_factor"),
        truncate=params.get("truncate", True))
