"""gpt-oss (OpenAI's open-weight MoE decoders, model_type gpt_oss) over the paged KV cache.

Reproduces transformers 5's `GptOssForCausalLM` (models/gpt_oss/modeling_gpt_oss.py), which vLLM 0.33's
model_executor/models/gpt_oss.py serves with the same math:

- attention: q/k/v/o projections with biases (`attention_bias`, default true), grouped-query (gpt-oss-20b:
  64 query heads over 8 kv heads of 64 dims), softmax scale head_dim^-0.5, and one learned **sink** logit
  per query head (`self_attn.sinks`, f32[N]) that joins every softmax's denominator and nothing else:
  p(s) = exp(score_s) / (Σ_s' exp(score_s') + exp(sink)), so a head can put weight "nowhere" instead of
  on the first tokens (StreamingLLM's attention sinks, arXiv 2309.17453, learned rather than kept). The
  sinks are passed to kvjax.attention.paged_attention, whose reference and Pallas kernels add them to
  the denominator (transformers' `eager_attention_forward` takes the max over scores and sink together);
- RoPE as the config says, YaRN by default (factor 32 over 4096 original positions, θ 150000, betas
  32 / 1, `truncate` false: the correction range is not rounded to whole dims), NeoX's half layout
  (transformers' `_apply_rotary_emb` chunks each head in two halves, as vLLM's `is_neox_style=True`);
- sliding and full attention alternating by `layer_types` (even layers slide, window 128, a query at q
  seeing keys q - W < k <= q), each layer's window from `ModelConfig.layer_windows`;
- a mixture-of-experts MLP on every layer (models.moe: top-k of the biased router logits then a softmax
  over those k, per-expert biases, the clamped SwiGLU (up + 1) · gate · σ(1.702 · gate));
- RMSNorm whose weight multiplies the float32 normalized value before the cast back
  (`GptOssRMSNorm`: `(weight * hidden_f32).to(dtype)`, where Llama casts first).

The attention is models.llama's GQAAttention with the sinks added; its parameter names are
transformers': `self_attn.sinks`, `mlp.router.{weight,bias}`, `mlp.experts.{gate_up_proj, gate_up_proj_bias,
down_proj, down_proj_bias}` (models.loader reads the interleaved gate/up columns and the MXFP4 experts).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.models.layers import CausalLM, DecoderLayer, RMSNorm, rms_normalized
from kvjax.models.llama import GQAAttention


class GptOssRMSNorm(RMSNorm):
    """weight × x / rms(x), the product taken in float32 and cast to x's dtype afterwards."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] → [..., D]
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.dtype(self.dtype))
        return (weight.astype(jnp.float32) * rms_normalized(x, self.eps)).astype(x.dtype)


class GptOssAttention(GQAAttention):
    """GQA attention with one learned sink logit per query head."""

    def attention_sinks(self) -> jax.Array:
        c = self.config
        sinks = self.param("sinks", nn.initializers.zeros, (c.num_heads,), jnp.dtype(c.dtype))  # [N]
        return sinks.astype(jnp.float32)


class GptOssDecoderLayer(DecoderLayer):
    norm_cls = GptOssRMSNorm


class GptOssForCausalLM(CausalLM):
    attention_cls = GptOssAttention
    layer_cls = GptOssDecoderLayer
    norm_cls = GptOssRMSNorm
