"""fp8 KV scales from a model's own K/V over calibration text.

The model prefills windows of the data through a bf16 paged cache (kvjax.evaluation.scoring); the max
|value| of every layer's written K and V per kv head (MLA: of each latent channel, latent and
rope key apart) is the calibration statistic, and scale = amax / format max (448 for e4m3,
57344 for e5m2), taken per layer (`per_tensor`) or per layer per kv head (`per_head`). vLLM
leaves this step to llm-compressor and defaults every scale to 1.0; the `KVScales` this
returns is what `kvjax.LLM(scales=...)`, `kvjax decode --scales` and the accuracy evaluation load.
"""
from __future__ import annotations

import jax.numpy as jnp

from kvjax.evaluation.scoring import cache_amax, prefill_caches
from kvjax.quant import formats as quant


def calibrate(config, model, params, token_windows, fmt: str, mode: str, block_size: int = 16) -> quant.KVScales:
    """Scales for `model` (a decoder built from `config`, a kvjax.config.model.ModelConfig) from
    prefilling token_windows i32[W, S] (batches of 16) in bf16. fmt: fp8_e4m3 | fp8_e5m2;
    mode: per_tensor | per_head."""
    spec = config.kv_spec("bf16")
    stats = []
    for i in range(0, len(token_windows), 16):
        caches = prefill_caches(model, params, jnp.asarray(token_windows[i:i + 16]), spec, block_size)
        stats.append(cache_amax(caches))
    amax_k = [jnp.max(jnp.stack([s[0][i] for s in stats]), axis=0) for i in range(config.num_layers)]
    amax_v = [jnp.max(jnp.stack([s[1][i] for s in stats]), axis=0) for i in range(len(stats[0][1]))]
    return quant.scales_from_amax(amax_k, amax_v, quant.FORMATS[fmt], mode,
                                  mla_rank=config.kv_lora_rank if config.is_mla else None)
