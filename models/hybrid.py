"""Attention + Mamba2 hybrid decoders: Bamba (transformers' `BambaForCausalLM`), Granite-4.0-H with or without
experts (`GraniteMoeHybridForCausalLM`: tiny and small route, Micro is dense) and Nemotron-H (`NemotronHForCausalLM`),
over the paged KV cache, each Mamba layer's state inside its slot's pages (kvjax.worker.mamba_state).

Each decoder layer carries the mixer its `ModelConfig.layer_types` entry names (kvjax.config.mamba): "attention"
(GQA over its group's pages), "mamba" (models.mamba2.Mamba2Mixer over its state in its slot's pages, the state
block being entry 0 of its Mamba group's block table) or, in Nemotron-H, "mlp" (a plain MLP, nothing cached). The step's
metadata must carry the KV cache groups (`BatchMetadata.layer_groups`), since a Mamba layer finds its state
block only in its own group's table.

    family      block                                                        names (transformers')
    bamba       x += mixer(input_layernorm(x)); x += MLP(pre_ff_layernorm(x))  mamba / self_attn, feed_forward,
                attention rotates half of each head (partial_rotary_factor     final_layernorm
                0.5, BambaConfig's), SwiGLU MLP
    granite     as Bamba, each sublayer's output × residual_multiplier;      mamba / self_attn, shared_mlp
    moehybrid   embeddings × embedding_multiplier, softmax scale               (input_linear, output_linear),
                attention_multiplier, logits / logits_scaling, NoPE or RoPE    post_attention_layernorm, norm
    nemotron_h  x += mixer(norm(x)), the mixer Mamba2, attention without       embeddings, mixer, norm, norm_f
                positions (NoPE) or a non-gated relu² MLP

The Mamba mixer's parameters keep transformers' names (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
`out_proj`); models.loader maps them (`MIXER_LEAVES`).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention import paged_attention
from kvjax.attention.metadata import BatchMetadata
from kvjax.config.model import ModelConfig
from kvjax.models.layers import RMSNorm, UnsupportedModelError
from kvjax.models.llama import GQAAttention
from kvjax.models.mamba2 import Mamba2Mixer
from kvjax.models.mlp import ACTIVATIONS, MLP, dense
from kvjax.models.moe import Experts, Router, combine, default_impl
from kvjax.models.rope import apply_rope, inv_freq
from kvjax.worker.paged_cache import KVPages, PagedCache, write_step

HYBRID_DECODERS = ("bamba", "granitemoehybrid", "nemotron_h")  # the hybrids built here; the others' configs size a cache only
_RELU2 = {"relu2": lambda x: jnp.square(jax.nn.relu(x))}


def check_hybrid(config: ModelConfig) -> None:
    """Refuse, by name, a hybrid this module does not build (kvjax.config.hf_mamba parses more families)."""
    who = config.name or config.model_type
    if config.model_type not in HYBRID_DECODERS:
        raise UnsupportedModelError(f"{who}: the {config.model_type} decoder is not implemented (kvjax builds "
                                    f"{', '.join(HYBRID_DECODERS)}; the config still sizes its KV cache and states)")
    m = config.mamba
    if m is None or m.version != 2 or not m.gated_norm or m.norm_before_gate:
        raise UnsupportedModelError(f"{who}: only Mamba2 mixers with transformers' gated RMSNorm are implemented")
    if config.moe_layers and config.model_type != "granitemoehybrid":  # Granite-4.0-H tiny / small have experts
        raise UnsupportedModelError(f"{who}: mixture-of-experts layers in a {config.model_type} are not implemented")
    acts = {"bamba": ("silu",), "granitemoehybrid": ("silu",), "nemotron_h": ("relu2",)}[config.model_type]
    if config.hidden_act not in acts:
        raise UnsupportedModelError(f"{who}: hidden_act {config.hidden_act!r} is not supported (only {acts[0]})")
    if config.use_rope and config.rope is not None and config.rope.rope_type != "default":
        raise UnsupportedModelError(f"{who}: rope_type {config.rope.rope_type!r} in a hybrid is not implemented")


class HybridAttention(GQAAttention):
    """GQA attention with a partial rotary width (Bamba) or none at all (NoPE: Nemotron-H)."""

    layouts = (KVPages,)

    @nn.compact
    def attend(self, x: jax.Array, md: BatchMetadata, pages: KVPages) -> tuple[jax.Array, KVPages]:
        c = self.config
        tokens, (n, k, h) = x.shape[0], (c.num_heads, c.num_kv_heads, c.head_dim)
        q = dense(c, n * h, c.qkv_bias, "q_proj")(x).reshape(tokens, n, h)  # [T, N, H]
        key = dense(c, k * h, c.qkv_bias, "k_proj")(x).reshape(tokens, k, h)  # [T, K, H]
        value = dense(c, k * h, c.qkv_bias, "v_proj")(x).reshape(tokens, k, h)  # [T, K, H]
        if c.use_rope:
            rope = c.rope
            rot = int(h * rope.partial_rotary_factor)  # the leading dims rotate, the rest pass (transformers' rule)
            freq, factor = inv_freq(dataclasses.replace(rope, partial_rotary_factor=1.0), rot,
                                    c.max_position_embeddings)

            def rotate(t):
                return jnp.concatenate([apply_rope(t[..., :rot], md.positions, freq, factor, rope.layout),
                                        t[..., rot:]], axis=-1)
            q, key = rotate(q), rotate(key)
        pages = write_step(pages, md, key, value)
        scale = c.granite_multipliers[1] if c.granite_multipliers else h ** -0.5  # Granite: attention_multiplier
        out = paged_attention(q, pages, md, scale=scale, impl=self.attn_impl, window=c.layer_windows[self.layer])
        return dense(c, c.hidden_size, c.o_bias, "o_proj")(out.reshape(tokens, n * h)), pages


class BambaLayer(nn.Module):
    config: ModelConfig
    attn_impl: str
    layer: int

    @nn.compact
    def __call__(self, x, md, pages):
        c = self.config
        h = RMSNorm(c.rms_norm_eps, c.dtype, name="input_layernorm")(x)
        if c.layer_types[self.layer] == "attention":
            h, pages = HybridAttention(c, self.attn_impl, self.layer, name="self_attn")(h, md, pages)
        else:
            h, pages = Mamba2Mixer(c, name="mamba")(h, md, pages)
        x = x + h
        return x + MLP(c, name="feed_forward")(RMSNorm(c.rms_norm_eps, c.dtype, name="pre_ff_layernorm")(x)), pages


class GraniteLayer(nn.Module):
    """Granite-4.0-H's block: as Bamba's, each sublayer's output × residual_multiplier, the MLP `shared_mlp` (gate
    and up fused in `input_linear`) plus, with experts, the routed `block_sparse_moe`."""

    config: ModelConfig
    attn_impl: str
    layer: int

    @nn.compact
    def __call__(self, x, md, pages):
        c = self.config
        residual = c.granite_multipliers[2]
        h = RMSNorm(c.rms_norm_eps, c.dtype, name="input_layernorm")(x)
        if c.layer_types[self.layer] == "attention":
            h, pages = HybridAttention(c, self.attn_impl, self.layer, name="self_attn")(h, md, pages)
        else:
            h, pages = Mamba2Mixer(c, name="mamba")(h, md, pages)
        x = x + h * residual
        h = RMSNorm(c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x)
        out = FusedMLP(c, name="shared_mlp")(h)
        if self.layer in c.moe_layers:  # the routed experts beside the shared MLP
            out = GraniteMoE(c, name="block_sparse_moe")(h) + out
        return x + out * residual, pages


class GraniteMoE(nn.Module):
    """Granite's routed experts: top-k of the router's logits, softmax over those k, SwiGLU experts (models.moe's
    Router and Experts; the checkpoint's `router.layer`, `input_linear` and `output_linear`, models.loader)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] → [T, D]
        weights, ids = Router(self.config, name="router")(x)  # f32[T, k], i32[T, k]
        return combine(Experts(self.config, default_impl(), name="experts")(x, ids), weights, self.config.moe)


class FusedMLP(nn.Module):
    """Granite's gated MLP: input_linear gives [gate | up], output_linear(silu(gate) · up)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] → [T, D]
        c = self.config
        gate, up = jnp.split(dense(c, 2 * c.intermediate_size, False, "input_linear")(x), 2, axis=-1)
        return dense(c, c.hidden_size, False, "output_linear")(ACTIVATIONS[c.hidden_act](gate) * up)


class NemotronHLayer(nn.Module):
    config: ModelConfig
    attn_impl: str
    layer: int

    @nn.compact
    def __call__(self, x, md, pages):
        c = self.config
        h = RMSNorm(c.rms_norm_eps, c.dtype, name="norm")(x)
        kind = c.layer_types[self.layer]
        if kind == "attention":
            h, pages = HybridAttention(c, self.attn_impl, self.layer, name="mixer")(h, md, pages)
        elif kind == "mamba":
            h, pages = Mamba2Mixer(c, name="mixer")(h, md, pages)
        else:  # caches nothing: its slot's pages pass through
            h = PlainMLP(c, name="mixer")(h)
        return x + h, pages


class PlainMLP(nn.Module):
    """Nemotron-H's MLP layer: down(act(up(x))), not gated (relu²)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] → [T, D]
        c = self.config
        act = _RELU2.get(c.hidden_act) or ACTIVATIONS[c.hidden_act]
        return dense(c, c.hidden_size, c.mlp_bias, "down_proj")(act(dense(c, c.intermediate_size, c.mlp_bias,
                                                                          "up_proj")(x)))


_LAYERS = {"bamba": (BambaLayer, "embed_tokens", "final_layernorm"),
           "granitemoehybrid": (GraniteLayer, "embed_tokens", "norm"),
           "nemotron_h": (NemotronHLayer, "embeddings", "norm_f")}


class HybridForCausalLM(nn.Module):
    """tokens i32[T], metadata (with KV cache groups), hybrid cache (kvjax.worker.mamba_state.create_hybrid_cache)
    → (logits f32[T, V] or f32[B, V] at logits_indices i32[B], cache)."""

    config: ModelConfig
    attn_impl: str = "reference"

    @nn.compact
    def __call__(self, tokens: jax.Array, md: BatchMetadata, cache: PagedCache,
                 logits_indices: jax.Array | None = None) -> tuple[jax.Array, PagedCache]:
        c = self.config
        check_hybrid(c)
        if cache.num_layers != c.num_layers:
            raise ValueError(f"cache has {cache.num_layers} layers, the model {c.num_layers}")
        if not md.layer_groups:
            raise ValueError("a hybrid model's step needs its KV cache groups in the metadata (layer_groups): a Mamba "
                             "layer's state block is entry 0 of its group's block table")
        layer_cls, embed_name, norm_name = _LAYERS[c.model_type]
        dtype = jnp.dtype(c.dtype)
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, name=embed_name)
        x = embed(tokens)  # [T, D]
        scales = c.granite_multipliers or (1.0, 1.0, 1.0, 1.0)  # Granite: embedding, attention, residual, logits
        if scales[0] != 1.0:
            x = x * jnp.asarray(scales[0], dtype)
        layers = list(cache.layers)
        for i in range(c.num_layers):
            j = cache.slot_of(i)
            x, layers[j] = layer_cls(c, self.attn_impl, i, name=f"layers_{i}")(x, md.for_layer(i), layers[j])
        x = RMSNorm(c.rms_norm_eps, c.dtype, name=norm_name)(x)
        if logits_indices is not None:
            x = x[logits_indices]  # [B, D]
        logits = embed.attend(x) if c.tie_word_embeddings else dense(c, c.vocab_size, False, "lm_head")(x)
        if scales[3] != 1.0:
            logits = logits / scales[3]
        return logits.astype(jnp.float32), cache.replace(layers=tuple(layers))
