"""The dense building blocks every decoder layer uses: `dense` (a Flax Dense in the model dtype,
named as transformers names the Linear) and `MLP`, the gated MLP of transformers' `LlamaMLP`
(`down_proj(act(gate_proj(x)) · up_proj(x))`), also the shared experts of models.moe.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.config.model import ModelConfig

# The MLP's gate activation by config name: silu (SwiGLU; Llama, Qwen, Mistral, DeepSeek) and
# gelu_pytorch_tanh (GeGLU with torch's tanh approximation; Gemma 2 / 3).
ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True)}


def dense(config: ModelConfig, features: int, use_bias: bool, name: str) -> nn.Dense:
    dtype = jnp.dtype(config.dtype)
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) · up(x)), `width` wide (None: the config's intermediate_size;
    models.moe's shared experts give their own)."""

    config: ModelConfig
    width: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] → [T, D]
        c = self.config
        width = self.width or c.intermediate_size
        gate = dense(c, width, c.mlp_bias, "gate_proj")(x)
        up = dense(c, width, c.mlp_bias, "up_proj")(x)
        return dense(c, c.hidden_size, c.mlp_bias, "down_proj")(ACTIVATIONS[c.hidden_act](gate) * up)
