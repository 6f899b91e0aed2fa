"""DeepSeek-V2/V3 decoder with multi-head latent attention (MLA) over a latent paged cache.

MLA (DeepSeek-V2, arXiv 2405.04434, §2.1) compresses each token's keys and values into one
latent c_kv (kv_lora_rank lanes, RMS-normed) plus one rope key k_pe shared by all heads
(qk_rope_head_dim lanes). Only [c_kv, k_pe] is cached: one vector of C = kv_lora_rank +
qk_rope_head_dim per token per layer, with no head axis (SPEC: f = 1, one kv head).

transformers' `DeepseekV3Attention` expands the cached latent through kv_b_proj into per-head
keys [k_nope, k_pe] and values. kvjax uses the absorbed form for every step, prefill and
decode alike (vLLM's MLA decode path; mathematically equal to the expansion, and one code path
to test): with kv_b_proj's weight viewed as W [kv_lora_rank, N, nope + v] = [W_UK | W_UV],

    score(t, s, n) = (q_nope[t, n] · W_UK[:, n]) · c_kv[s] + q_pe[t, n] · k_pe[s]
    out(t, n)      = (Σ_s p(t, s, n) c_kv[s]) · W_UV[:, n]

so attention reads the latent pages directly and its output stays in latent space until W_UV.
The absorbed products run in f32. Softmax scale: qk_head_dim^-0.5, times DeepSeek's yarn
mscale² (models.rope.deepseek_softmax_scale). RoPE layout: V3 interleaved when the config's
`rope_interleave` (default True), V2 complex pairs (see models.rope).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention import mla_paged_attention
from kvjax.attention.metadata import BatchMetadata
from kvjax.config.model import ModelConfig
from kvjax.models.layers import Attention, CausalLM, RMSNorm, dense
from kvjax.models.rope import apply_rope, deepseek_softmax_scale, inv_freq
from kvjax.worker.paged_cache import ContiguousLatent, LatentPages, write_step


class KVUpProjection(nn.Module):
    """kv_b_proj's weight, kept as a matrix for absorption: returns W [kv_lora_rank, N, nope + v]."""

    config: ModelConfig

    @nn.compact
    def __call__(self) -> jax.Array:
        c = self.config
        out = c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (c.kv_lora_rank, out), jnp.dtype(c.dtype))
        return kernel.reshape(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)


class MLAAttention(Attention):
    """Multi-head latent attention; returns (output, new latent pages)."""

    layouts = (LatentPages, ContiguousLatent)

    @nn.compact
    def attend(self, x: jax.Array, md: BatchMetadata, pages: LatentPages | ContiguousLatent
                 ) -> tuple[jax.Array, LatentPages | ContiguousLatent]:
        c = self.config
        tokens, n = x.shape[0], c.num_heads
        nope, rope, rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            q = dense(c, n * (nope + rope), False, "q_proj")(x)
        else:
            q = dense(c, c.q_lora_rank, c.qkv_bias, "q_a_proj")(x)  # [T, q_lora_rank]
            q = RMSNorm(c.rms_norm_eps, c.dtype, name="q_a_layernorm")(q)
            q = dense(c, n * (nope + rope), False, "q_b_proj")(q)
        q = q.reshape(tokens, n, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]  # [T, N, nope], [T, N, rope]

        kv = dense(c, rank + rope, c.qkv_bias, "kv_a_proj_with_mqa")(x)  # [T, C]
        c_kv = RMSNorm(c.rms_norm_eps, c.dtype, name="kv_a_layernorm")(kv[:, :rank])  # [T, kv_lora_rank]
        freq, factor = inv_freq(c.rope, rope, c.max_position_embeddings)
        q_pe = apply_rope(q_pe, md.positions, freq, factor, c.rope.layout)
        k_pe = apply_rope(kv[:, None, rank:], md.positions, freq, factor, c.rope.layout)[:, 0]  # [T, rope]
        pages = write_step(pages, md, jnp.concatenate([c_kv, k_pe], axis=-1))

        w = KVUpProjection(c, name="kv_b_proj")().astype(jnp.float32)  # [kv_lora_rank, N, nope + v]
        w_uk, w_uv = w[..., :nope], w[..., nope:]
        q_latent = jnp.einsum("tnd,cnd->tnc", q_nope.astype(jnp.float32), w_uk)  # f32[T, N, kv_lora_rank]
        scale = deepseek_softmax_scale(c.rope, nope + rope, c.max_position_embeddings)
        out = mla_paged_attention(q_latent, q_pe.astype(jnp.float32), pages, md, scale=scale,
                                  impl=self.attn_impl)  # f32[T, N, kv_lora_rank]
        out = jnp.einsum("tnc,cnv->tnv", out, w_uv).astype(x.dtype)  # [T, N, v]
        return dense(c, c.hidden_size, c.o_bias, "o_proj")(out.reshape(tokens, n * c.v_head_dim)), pages


class DeepseekForCausalLM(CausalLM):
    attention_cls = MLAAttention
