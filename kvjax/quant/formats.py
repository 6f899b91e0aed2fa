"""Quantized KV formats: saturating casts, scales, and calibration statistics.

vLLM's `kv_cache_dtype` stores K/V in 8 bits with a dequantization scale: x ≈ q × scale, where
q = cast(x / scale). Its default fp8 scales are all 1.0 (`--kv-cache-dtype fp8` without a
calibrated checkpoint), which is fine while |x| ≤ the format's max and silently saturates (or,
with a bare cast, turns into NaN/inf) beyond it. Calibration measures amax over data and sets
scale = amax / format max, so the largest observed value lands exactly on the format's max.

Formats (max finite magnitude; the table is kvjax.quant.kv_formats's, `FORMATS` its quantized rows):
    fp8_e4m3  float8_e4m3fn   448     (no inf; a bare cast of 470 or inf gives NaN)
    fp8_e5m2  float8_e5m2     57344   (a bare cast of ≥ 61440 gives inf)
    int8      int8            127     (int8_per_token_head: scale per token per kv head,
                                       computed at write time, symmetric, half away from zero)
    fp8_e4m3  float8_e4m3fn   448     (fp8_per_token_head: the same, cast to e4m3)

Scale modes for fp8: `unit` (1.0), `per_tensor` (one K and one V scale per layer),
`per_head` (one per layer per kv head), `dynamic` (vLLM's calc_kv_scales: per layer max |k| / 200
and max |v| / 100 over the first batch, whatever the format). Scales are always stored per kv head (a per-tensor
scale is broadcast) so the attention paths take one shape: f32[K] for K and V pages; for an
MLA latent page [.., C] one f32[C] per-channel vector holding the latent scale on the first
kv_lora_rank channels and the rope-key scale on the rest.

The casts here are elementwise jnp and run under jit; nothing in this file prints.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import InputFileError, KvjaxError
from kvjax.quant.kv_formats import FP8_FORMATS, KVFormat, kv_formats
from kvjax.utils.output_files import write_json
from kvjax.utils.strict_json import json_type, read_json_object

# The quantized formats with a page format (kvjax.quant.kv_formats's table: storage dtype, max, scale kind).
FORMATS: dict[str, KVFormat] = {f.name: f for f in kv_formats("static", "per_token")}
SCALE_MODES = ("unit", "per_tensor", "per_head", "dynamic")
# vLLM's dynamic scales (`--calculate-kv-scales`, Attention.calc_kv_scales, deprecated in vLLM 0.19 and
# gone from 0.33): on the first batch, k_scale = max |k| / K_SCALE_CONSTANT and v_scale = max |v| /
# V_SCALE_CONSTANT per layer, with vllm/envs.py's defaults. Not amax / 448: a K value of 200 × the
# scale lands at 200, leaving headroom up to 448 for later batches (V: 100).
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0


def saturating_cast(x, fmt: KVFormat):
    """Cast f32 → the narrow format, clipping to ±max first (a bare fp8 cast does not saturate).

    NaN stays NaN (it must stay visible; callers count non-finite inputs), ±inf becomes ±max.
    int8 rounds to nearest (ties to even) before clipping.
    """
    x = x.astype(jnp.float32)
    if fmt.integer:
        x = jnp.round(jnp.nan_to_num(x, nan=0.0))
    return jnp.clip(x, -fmt.max, fmt.max).astype(fmt.dtype)


def quantize(x, scale, fmt: KVFormat):
    """q = saturate(x / scale); scale broadcasts against x (e.g. f32[K, 1] against [.., K, H])."""
    return saturating_cast(x.astype(jnp.float32) / scale, fmt)


def dequantize(q, scale):
    """x ≈ q × scale, in f32."""
    return q.astype(jnp.float32) * scale


def count_nonfinite(x) -> jax.Array:
    """Number of NaN/±inf elements: quantizing them is never silent, the cache keeps a count."""
    return jnp.sum(~jnp.isfinite(x.astype(jnp.float32))).astype(jnp.int32)


def scale_from_amax(amax, fmt: KVFormat):
    """scale = amax / max, so the largest observed magnitude maps to the format's max.

    An all-zero channel (amax 0) gets scale 1.0: any scale represents zeros exactly, and a zero
    scale would divide by zero on the next write.
    """
    amax = jnp.asarray(amax, jnp.float32)
    return jnp.where(amax > 0, amax / fmt.max, 1.0).astype(jnp.float32)


def quantize_per_token_head(x, fmt: KVFormat = FORMATS["int8_per_token_head"]):
    """Symmetric per-vector quantization: x [.., H] → (q [.., H], scale f32[..]), as vLLM 0.33's
    `_reshape_cache_per_token_head` (triton_reshape_and_cache_flash.py) computes it:

        scale = max(amax / max, 1e-6);  y = x × (1 / scale)
        int8: round half away from zero, clamp to [-128, 127];  fp8: clamp to ±448, cast (nearest even)

    amax ignores non-finite values (they are counted by the cache; NaN stays NaN in fp8, 0 in int8)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(jnp.where(jnp.isfinite(x), x, 0.0)), axis=-1)
    scale = jnp.maximum(amax / jnp.float32(fmt.max), jnp.float32(1e-6))
    y = x * (1.0 / scale)[..., None]
    if fmt.integer:
        y = jnp.trunc(jnp.clip(jnp.where(y >= 0, y + 0.5, y - 0.5), -fmt.max - 1, fmt.max))
        return jnp.nan_to_num(y, nan=0.0).astype(fmt.dtype), scale
    return jnp.clip(y, -fmt.max, fmt.max).astype(fmt.dtype), scale


# --------------------------------------------------------------------------------------------
# Calibration: amax statistics → scales → a JSON file the engine loads
# --------------------------------------------------------------------------------------------
def amax_per_head(x):
    """Max |x| per kv head over all tokens: x [T, K, H] → f32[K] (non-finite values ignored)."""
    x = jnp.abs(x.astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isfinite(x), x, 0.0), axis=(0, 2))


def amax_per_channel(x):
    """Max |x| per channel over tokens: x [T, C] → f32[C] (for the MLA latent + rope key)."""
    x = jnp.abs(x.astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isfinite(x), x, 0.0), axis=0)


@dataclasses.dataclass(frozen=True)
class KVScales:
    """Dequantization scales for every layer, as the cache stores them.

    k, v: per layer f32[K] (MHA/GQA/MQA), or for MLA `k` holds per layer f32[C] (latent then rope
    channels) and `v` is empty. mode says how they were made (unit / per_tensor / per_head).
    """

    format: str
    mode: str
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...] = ()
    amax_k: tuple[np.ndarray, ...] = ()  # the calibration statistics they came from, if any
    amax_v: tuple[np.ndarray, ...] = ()

    def to_json(self) -> dict[str, Any]:
        lst = lambda arrs: [np.asarray(a, np.float32).tolist() for a in arrs]  # noqa: E731
        return {"format": self.format, "mode": self.mode, "k": lst(self.k), "v": lst(self.v),
                "amax_k": lst(self.amax_k), "amax_v": lst(self.amax_v)}

    def save(self, path: str | os.PathLike, what: str = "scales file") -> None:
        """Write the scales as JSON, atomically (kvjax.utils.output_files.write_file; `what` names the path
        in a write failure's message)."""
        write_json(path, self.to_json(), what, indent=None)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KVScales":
        """A scales file as `save` writes it; every field is checked (InputFileError naming the
        field and layer): format a known fp8 format, mode a known mode, k (and v) one non-empty
        list of finite positive scales per layer, amax_k / amax_v finite and ≥ 0, no other keys."""
        d = read_json_object(path, "scales file")
        bad = lambda msg: InputFileError(path, msg)  # noqa: E731
        unknown = sorted(set(d) - {"format", "mode", "k", "v", "amax_k", "amax_v"})
        if unknown:
            raise bad(f"unknown key(s) {unknown}; a scales file has format, mode, k, v, amax_k, amax_v")
        missing = [key for key in ("format", "mode", "k") if key not in d]
        if missing:
            raise bad(f"lacks {', '.join(missing)}")
        if d["format"] not in FP8_FORMATS:
            raise bad(f'"format" must be one of {", ".join(FP8_FORMATS)}, got {json.dumps(d["format"])[:40]}')
        if d["mode"] not in SCALE_MODES:
            raise bad(f'"mode" must be one of {", ".join(SCALE_MODES)}, got {json.dumps(d["mode"])[:40]}')
        layers = {key: _layer_vectors(d.get(key, []), key, bad, positive=key in ("k", "v"))
                  for key in ("k", "v", "amax_k", "amax_v")}
        if not layers["k"]:
            raise bad('"k" holds no layers')
        if d["mode"] == "unit" and any(np.any(s != 1.0) for s in layers["k"] + layers["v"]):
            raise bad('mode "unit" means every scale is 1.0')
        return cls(d["format"], d["mode"], layers["k"], layers["v"], layers["amax_k"], layers["amax_v"])

    def check_kv_dtype(self, kv_dtype: str) -> None:
        """Scales made for one fp8 format are wrong for another (e5m2's max is 128× e4m3's)."""
        if kv_dtype != self.format:
            raise KvjaxError(f"the scales are for {self.format} but the kv cache dtype is {kv_dtype}")


_F32_MAX = float(np.finfo(np.float32).max)


def _layer_vectors(value, key: str, bad, positive: bool) -> tuple[np.ndarray, ...]:
    """A scales file's per-layer lists of numbers, checked (see KVScales.load)."""
    if not isinstance(value, list):
        raise bad(f'"{key}" must be a list with one list of numbers per layer, got a JSON {json_type(value)}')
    out = []
    for layer, xs in enumerate(value):
        if not isinstance(xs, list) or not xs:
            raise bad(f'"{key}" layer {layer} must be a non-empty list of numbers, got {json.dumps(xs)[:40]}')
        for x in xs:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 < x if positive else 0 <= x) \
                    or x > _F32_MAX:
                rule = "positive" if positive else "≥ 0"
                raise bad(f'"{key}" layer {layer} holds {json.dumps(x)[:40]}: values must be {rule} float32 numbers')
        arr = np.asarray(xs, np.float32)
        if positive and np.any(arr <= 0):
            raise bad(f'"{key}" layer {layer} holds a scale that is 0 in float32')
        out.append(arr)
    return tuple(out)


def scales_from_amax(amax_k, amax_v, fmt: KVFormat, mode: str, mla_rank: int | None = None) -> KVScales:
    """Turn per-layer per-head amax (or, for MLA, per-channel amax f32[C]) into scales for `mode`.

    per_tensor takes the max over heads and broadcasts it back to every head; unit ignores the
    statistics (vLLM's default). MLA has one "head", so per_tensor and per_head both give two
    scales per layer, one for the latent channels [:mla_rank] and one for the rope key [mla_rank:].
    dynamic: per layer amax / K_SCALE_CONSTANT for K and amax / V_SCALE_CONSTANT for V over all
    heads (MLA: one latent scale, amax over every channel / K_SCALE_CONSTANT); an amax of 0 gives 1.0.
    """
    if mode not in SCALE_MODES:
        raise KvjaxError(f"unknown scale mode {mode!r}; choose one of {', '.join(SCALE_MODES)}")

    def make(amax, constant):
        amax = np.asarray(amax, np.float32)
        if mode == "unit":
            return np.ones_like(amax)
        if mode == "dynamic":
            top = np.float32(amax.max())
            return np.full_like(amax, top / np.float32(constant) if top > 0 else 1.0)
        if mla_rank is not None:
            amax = np.concatenate([np.full(mla_rank, amax[:mla_rank].max()),
                                   np.full(amax.size - mla_rank, amax[mla_rank:].max())]).astype(np.float32)
        elif mode == "per_tensor":
            amax = np.full_like(amax, amax.max())
        return np.asarray(scale_from_amax(amax, fmt))

    return KVScales(fmt.name, mode, tuple(make(a, K_SCALE_CONSTANT) for a in amax_k),
                    tuple(make(a, V_SCALE_CONSTANT) for a in amax_v),
                    tuple(np.asarray(a, np.float32) for a in amax_k), tuple(np.asarray(a, np.float32) for a in amax_v))
