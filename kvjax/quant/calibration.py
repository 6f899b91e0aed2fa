"""fp8 KV calibration: the statistics of a model's own K/V over calibration text, and the scales.

The model prefills windows of the data through a bf16 paged cache (kvjax.evaluation.scoring's
`prefill_caches`); `cache_amax` reads the max |value| of every layer's written K and V per kv
head (MLA: of each latent channel, latent and rope key apart) from those pages, the
calibration statistic, and `calibrate` turns it into scale = amax / format max (448 for e4m3,
57344 for e5m2), taken per layer (`per_tensor`) or per layer per kv head (`per_head`). vLLM
leaves this step to llm-compressor and defaults every scale to 1.0; the `KVScales` this
returns is what `kvjax.LLM(scales=...)`, `kvjax decode --scales` and the accuracy evaluation load.

Axes: the kvjax package docstring's legend; B is a prefill batch's windows (one per row).
"""
from __future__ import annotations

import jax.numpy as jnp

from kvjax.evaluation.scoring import prefill_caches
from kvjax.quant import formats as quant


def cache_amax(caches) -> tuple[list, list]:
    """Calibration statistics of stacked caches from `prefill_caches`: per layer max |K| and
    max |V| per kv head (f32[K] each), or for MLA max |latent| per channel (f32[C], V empty).

    Only real blocks count: block 0 (the null block, never written by a full prefill) is
    excluded, and every other slot of a prefill layout holds a written token or zeros, which
    cannot raise a max of absolute values.
    """
    amax_k, amax_v = [], []
    for layer in caches.layers:
        if hasattr(layer, "latent"):
            lat = jnp.abs(layer.latent[:, 1:].astype(jnp.float32))  # [B, P-1, Z, C]
            amax_k.append(jnp.max(lat, axis=(0, 1, 2)))
        else:
            amax_k.append(jnp.max(jnp.abs(layer.k[:, 1:].astype(jnp.float32)), axis=(0, 1, 2, 4)))  # f32[K]
            amax_v.append(jnp.max(jnp.abs(layer.v[:, 1:].astype(jnp.float32)), axis=(0, 1, 2, 4)))
    return amax_k, amax_v


def calibrate(config, model, params, token_windows, fmt: str, mode: str, block_size: int = 16) -> quant.KVScales:
    """Scales for `model` (a decoder built from `config`, a kvjax.config.model.ModelConfig) from
    prefilling token_windows i32[W, S] (batches of 16) in bf16. fmt: fp8_e4m3 | fp8_e5m2;
    mode: per_tensor | per_head | dynamic (vLLM's calc_kv_scales on a first batch of these windows)."""
    spec = config.kv_spec("bf16")
    stats = []
    for i in range(0, len(token_windows), 16):
        caches = prefill_caches(model, params, jnp.asarray(token_windows[i:i + 16]), spec, block_size)
        stats.append(cache_amax(caches))
    amax_k = [jnp.max(jnp.stack([s[0][i] for s in stats]), axis=0) for i in range(config.num_layers)]
    amax_v = [jnp.max(jnp.stack([s[1][i] for s in stats]), axis=0) for i in range(len(stats[0][1]))]
    return quant.scales_from_amax(amax_k, amax_v, quant.FORMATS[fmt], mode,
                                  mla_rank=config.kv_lora_rank if config.is_mla else None)
