"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

Reproduces transformers' `LlamaAttention` (and its Mistral/Qwen2/Qwen3 variants): q/k/v projections
(biases as the config says; Qwen2 has q/k/v biases and no o bias), Qwen3's per-head q/k RMSNorm
before RoPE, RoPE on q and k, grouped-query attention where query head n reads kv head
n // (N / K) (MHA: K = N; MQA: K = 1), softmax scale head_dim^-0.5.

Sliding windows are per layer (`ModelConfig.layer_windows`): a query at position q sees keys
q - W < k <= q (transformers' `sliding_window_overlay`). Mistral slides on every layer; Qwen2 /
Qwen3 with `use_sliding_window` on the layers transformers' `layer_types` marks, those from
`max_window_layers` on. models.gemma reuses this attention with Gemma's norm, scale and caps, and
models.gpt_oss with its per-head attention sinks (`GQAAttention.attention_sinks`).

Unlike transformers, the new K/V are first written into this layer's pages through the step's
slot mapping, and attention then reads every key, this step's included, back from the pages
by block table: one code path for prefill, decode and any mix of the two (vLLM V1 does the
same: `reshape_and_cache_flash` then the attention kernel).
"""
from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax

from kvjax.attention import paged_attention
from kvjax.attention.metadata import BatchMetadata
from kvjax.models.layers import Attention, CausalLM, RMSNorm, dense
from kvjax.models.rope import apply_rope, inv_freq
from kvjax.worker.paged_cache import ContiguousKV, KVPages, write_step


class GQAAttention(Attention):
    """Multi-head / grouped-query / multi-query attention; returns (output, new pages)."""

    layouts = (KVPages, ContiguousKV)
    norm_cls: ClassVar[type] = RMSNorm  # q_norm / k_norm's (Gemma 3: the (1 + weight) norm)

    @nn.compact
    def attend(self, x: jax.Array, md: BatchMetadata, pages: KVPages | ContiguousKV
                 ) -> tuple[jax.Array, KVPages | ContiguousKV]:
        c = self.config
        tokens = x.shape[0]
        n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
        q = dense(c, n * h, c.qkv_bias, "q_proj")(x).reshape(tokens, n, h)  # [T, N, H]
        key = dense(c, k * h, c.qkv_bias, "k_proj")(x).reshape(tokens, k, h)  # [T, K, H]
        value = dense(c, k * h, c.qkv_bias, "v_proj")(x).reshape(tokens, k, h)  # [T, K, H]
        if c.qk_norm:
            q = self.norm_cls(c.rms_norm_eps, c.dtype, name="q_norm")(q)
            key = self.norm_cls(c.rms_norm_eps, c.dtype, name="k_norm")(key)
        rope = c.layer_rope(self.layer)
        freq, factor = inv_freq(rope, h, c.max_position_embeddings)
        q = apply_rope(q, md.positions, freq, factor, rope.layout)
        key = apply_rope(key, md.positions, freq, factor, rope.layout)
        pages = write_step(pages, md, key, value)
        scale = (c.query_pre_attn_scalar or h) ** -0.5  # Gemma: query_pre_attn_scalar, not head_dim
        out = paged_attention(q, pages, md, scale=scale, impl=self.attn_impl, window=c.layer_windows[self.layer],
                              sinks=self.attention_sinks(), softcap=c.attn_logit_softcap)  # [T, N, H]
        return dense(c, c.hidden_size, c.o_bias, "o_proj")(out.reshape(tokens, n * h)), pages

    def attention_sinks(self) -> jax.Array | None:
        """The layer's attention-sink logits f32[N], or None: none here (models.gpt_oss learns one per head)."""
        return None


class LlamaForCausalLM(CausalLM):
    attention_cls = GQAAttention
