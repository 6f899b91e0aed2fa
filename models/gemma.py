"""Gemma 2 and Gemma 3 (text) decoders: the Llama attention with Gemma's norms, scale, caps and RoPE bases.

Reproduces transformers 5's `Gemma2ForCausalLM` and `Gemma3ForCausalLM` (model_type gemma3_text):

- RMSNorm scales by (1 + weight), the weight stored zero-centred; the product is taken in f32
  and cast back afterwards (`Gemma2RMSNorm`: `(x * w).to(dtype)`, where Llama casts before the
  weight; transformers PR 29402);
- four norms a block ("sandwich"): x + post_attention_layernorm(attn(input_layernorm(x))), then
  x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)));
- embeddings × sqrt(hidden_size), the factor rounded to the embedding dtype first;
- softmax scale query_pre_attn_scalar^-0.5 instead of head_dim^-0.5;
- a GeGLU MLP (gelu_pytorch_tanh), embeddings tied to the LM head;
- Gemma 2: sliding and full layers alternate (transformers' `layer_types`), attention scores are
  soft-capped (attn_logit_softcapping: c·tanh(s / c) after scaling, before the mask) and so
  are the final logits (final_logit_softcapping);
- Gemma 3: five sliding layers to one full one (`sliding_window_pattern` 6), per-head q_norm /
  k_norm (the same (1 + weight) norm, before RoPE), the sliding layers rotating with their own
  base (`rope_parameters["sliding_attention"]`, older configs' rope_local_base_freq) and the
  full layers with rope_theta and its scaling; no attention soft-cap (transformers' and vLLM's
  Gemma 3 ignore the field), the final one if the config sets it.

The per-layer window, RoPE, scale and caps come from the ModelConfig (kvjax.config.hf parses
them); the attention itself is models.llama's GQAAttention.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention.metadata import BatchMetadata
from kvjax.config.model import ModelConfig
from kvjax.models.layers import MLP, CausalLM, rms_normalized
from kvjax.models.llama import GQAAttention
from kvjax.worker.paged_cache import LayerPages, LayerRows


class GemmaRMSNorm(nn.Module):
    """x / rms(x) × (1 + weight), all in f32, cast back at the end (transformers' Gemma2RMSNorm)."""

    eps: float
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] → [..., D]
        weight = self.param("weight", nn.initializers.zeros, (x.shape[-1],), jnp.dtype(self.dtype))
        return (rms_normalized(x, self.eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class GemmaAttention(GQAAttention):
    norm_cls = GemmaRMSNorm


class GemmaDecoderLayer(nn.Module):
    """The sandwich block: every sublayer's input and output normalized."""

    config: ModelConfig
    attention_cls: type
    attn_impl: str
    layer: int

    @nn.compact
    def __call__(self, x: jax.Array, md: BatchMetadata, pages: LayerPages | LayerRows
                 ) -> tuple[jax.Array, LayerPages | LayerRows]:
        c = self.config

        def norm(name):
            return GemmaRMSNorm(c.rms_norm_eps, c.dtype, name=name)

        h = norm("input_layernorm")(x)  # [T, D]
        h, pages = self.attention_cls(c, self.attn_impl, self.layer, name="self_attn")(h, md, pages)
        x = x + norm("post_attention_layernorm")(h)
        h = MLP(c, name="mlp")(norm("pre_feedforward_layernorm")(x))
        return x + norm("post_feedforward_layernorm")(h), pages


class GemmaForCausalLM(CausalLM):
    attention_cls = GemmaAttention
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm
    scale_embeddings = True
