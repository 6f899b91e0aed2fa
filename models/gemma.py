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

from kvjax.models.layers import CausalLM, DecoderLayer, RMSNorm
from kvjax.models.llama import GQAAttention


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) × (1 + weight), all in f32 (models.layers.RMSNorm with unit_offset)."""

    unit_offset: bool = True


class GemmaAttention(GQAAttention):
    norm_cls = GemmaRMSNorm


class GemmaDecoderLayer(DecoderLayer):
    """The sandwich block (the config's sandwich_norms) with Gemma's (1 + weight) norms."""

    norm_cls = GemmaRMSNorm


class GemmaForCausalLM(CausalLM):
    attention_cls = GemmaAttention
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm
    scale_embeddings = True
