"""Activation-outlier stress: inflate a few cached K channels without changing the model.

Large real models have a few key channels with magnitudes far beyond the rest (the
"massive activations" of Sun et al., arXiv 2402.17762); a per-tensor fp8 scale must then
stretch over them, and vLLM's default scale of 1.0 saturates them at 448. Small models
trained here have no such outliers, so the accuracy experiment can create them on purpose:
multiply the rows of k_proj that produce some channels by α and the matching q_proj rows by
1/α. Every q·k product, and so the model's function, is unchanged in exact arithmetic, but the
cached K channels are α times larger. RoPE rotates channel i together with its partner (i +
H/2 in the `half` layout, i ^ 1 in the interleaved ones), so both of a pair are scaled alike.

For MLA, the cached latent c_kv channels are inflated through kv_a_layernorm's weight and
compensated in kv_b_proj's rows (both W_UK and W_UV read c_kv linearly).
"""
from __future__ import annotations

import jax
import numpy as np

from kvjax.config.model import ModelConfig


def rope_pairs(channels, head_dim: int, layout: str) -> list[int]:
    """The channels plus their RoPE partners, sorted."""
    partner = (lambda c: (c + head_dim // 2) % head_dim) if layout == "half" else (lambda c: c ^ 1)
    return sorted({c for ch in channels for c in (ch, partner(ch))})


def inflate_k_channels(config: ModelConfig, params, channels=(0, 5), factor: float = 100.0):
    """Params whose cached K (GQA) or latent (MLA) has `channels` × factor; same function."""
    params = jax.tree_util.tree_map(np.array, params)  # mutable host copies
    for i in range(config.num_layers):
        attn = params[f"layers_{i}"]["self_attn"]
        if config.is_mla:
            attn["kv_a_layernorm"]["weight"][list(channels)] *= factor
            attn["kv_b_proj"]["kernel"][list(channels), :] /= factor
            continue
        h, group = config.head_dim, config.num_heads // config.num_kv_heads
        cols = rope_pairs(channels, h, config.rope.layout)
        if config.qk_norm:  # Qwen3 / Gemma 3 normalize each head after the projection: scale the norm weights
            k_norm, q_norm = attn["k_norm"]["weight"], attn["q_norm"]["weight"]
            if config.model_type == "gemma3_text":  # its norm multiplies by 1 + weight
                k_norm[cols] = (1 + k_norm[cols]) * factor - 1
                q_norm[cols] = (1 + q_norm[cols]) / factor - 1
            else:
                k_norm[cols] *= factor
                q_norm[cols] /= factor
            continue
        for kv_head in range(config.num_kv_heads):
            attn["k_proj"]["kernel"][:, [kv_head * h + c for c in cols]] *= factor
            if "bias" in attn["k_proj"]:
                attn["k_proj"]["bias"][[kv_head * h + c for c in cols]] *= factor
            for n in range(kv_head * group, (kv_head + 1) * group):
                attn["q_proj"]["kernel"][:, [n * h + c for c in cols]] /= factor
                if "bias" in attn["q_proj"]:
                    attn["q_proj"]["bias"][[n * h + c for c in cols]] /= factor
    return params
