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
import numpy as np

from kvjax.evaluation.scoring import prefill_caches
from kvjax.quant import formats as quant


def cache_amax(caches, layer_types: tuple = ()) -> tuple[list, list]:
    """Calibration statistics of stacked caches from `prefill_caches`: per layer max |K| and
    max |V| per kv head (f32[K] each), or for MLA max |latent| per channel (f32[C], V empty).
    layer_types: a hybrid's (ModelConfig.layer_types), whose attention layers' pages are read (`attention_pages`).

    Only real blocks count: block 0 (the null block, never written by a full prefill) is
    excluded, and every other slot of a prefill layout holds a written token or zeros, which
    cannot raise a max of absolute values.
    """
    amax_k, amax_v = [], []
    for layer, written in attention_pages(caches, layer_types):
        if hasattr(layer, "latent"):
            lat = jnp.abs(layer.latent[:, written].astype(jnp.float32))  # [B, P-1, Z, C]
            amax_k.append(jnp.max(lat, axis=(0, 1, 2)))
        else:
            amax_k.append(jnp.max(jnp.abs(layer.k[:, written].astype(jnp.float32)), axis=(0, 1, 2, 4)))  # f32[K]
            amax_v.append(jnp.max(jnp.abs(layer.v[:, written].astype(jnp.float32)), axis=(0, 1, 2, 4)))
    return amax_k, amax_v


def attention_pages(caches, layer_types: tuple = ()) -> list:
    """[(each attention layer's pages, the blocks a prefill wrote)]: blocks 1.. (block 0 is the null block); beside
    Mamba layers (layer_types: ModelConfig.layer_types) each attention layer's slot tensor, whose last block in the
    prefill layout holds a Mamba layer's state bytes (kvjax.evaluation.scoring.prefill_layout), left out too."""
    if "mamba" not in layer_types:
        return [(layer, slice(1, None)) for layer in caches.layers]
    return [(caches.layers[caches.slot_of(i)], slice(1, -1)) for i, t in enumerate(layer_types) if t == "attention"]


def channel_amax(config, model, params, token_windows, block_size: int = 16, batch: int = 16) -> tuple[list, list]:
    """Per layer max |K| and max |V| of every kv head's channels over token_windows i32[W, S],
    prefilled in bf16 `batch` windows at a time: f32[K, H] each (MLA: the latent as f32[1, C], V
    None). One pass serves every calibrated mode (`calibrate`'s channels=) and the outlier map
    (kvjax.evaluation.layers.kv_outliers): a head's amax is the max of its channels'. Block 0
    (the null block, never written by a prefill) is left out, as in `cache_amax`."""
    spec = config.kv_spec("bf16")
    ks = vs = None
    for i in range(0, len(token_windows), batch):
        caches = prefill_caches(model, params, jnp.asarray(token_windows[i:i + batch]), spec, block_size)
        k, v = [], []
        for layer, written in attention_pages(caches, config.layer_types or ()):
            if hasattr(layer, "latent"):
                k.append(np.max(np.abs(np.asarray(layer.latent[:, written], np.float32)), axis=(0, 1, 2))[None])
                v.append(None)
            else:
                k.append(np.max(np.abs(np.asarray(layer.k[:, written], np.float32)), axis=(0, 1, 2)))  # [K, H]
                v.append(np.max(np.abs(np.asarray(layer.v[:, written], np.float32)), axis=(0, 1, 2)))
        ks = k if ks is None else [np.maximum(a, b) for a, b in zip(ks, k)]
        vs = v if vs is None else [None if a is None else np.maximum(a, b) for a, b in zip(vs, v)]
    return ks, vs


def calibrate(config, model, params, token_windows, fmt: str, mode: str, block_size: int = 16,
              channels: tuple[list, list] | None = None) -> quant.KVScales:
    """Scales for `model` (a decoder built from `config`, a kvjax.config.model.ModelConfig) from
    prefilling token_windows i32[W, S] (batches of 16) in bf16. fmt: fp8_e4m3 | fp8_e5m2;
    mode: per_tensor | per_head | dynamic (vLLM's calc_kv_scales on a first batch of these windows).
    channels: `channel_amax` of these windows, already measured (then nothing is prefilled)."""
    ks, vs = channels if channels is not None else channel_amax(config, model, params, token_windows, block_size)
    amax_k = [jnp.asarray(c[0] if config.is_mla else c.max(axis=-1)) for c in ks]
    amax_v = [jnp.asarray(c.max(axis=-1)) for c in vs if c is not None]
    return quant.scales_from_amax(amax_k, amax_v, quant.FORMATS[fmt], mode,
                                  mla_rank=config.kv_lora_rank if config.is_mla else None)
