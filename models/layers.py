"""The decoder both model families share: RMSNorm, SwiGLU MLP, pre-norm block, causal LM head.

Structure and parameter names follow transformers' `LlamaForCausalLM` / `DeepseekV3ForCausalLM`
(`model.layers.{i}.self_attn…`, `input_layernorm`, `post_attention_layernorm`, `mlp.{gate,up,
down}_proj`, `model.norm`, `lm_head`), so the loader maps names one to one: Flax `layers_{i}`
is HF `model.layers.{i}`, a Dense `kernel` is the transposed HF `weight`.

The paged cache is an argument and a result of every call, never module state: a decoder
step is `(tokens, metadata, cache) -> (logits, cache)`, a pure function that jit can donate
the cache to. The attention module is the only part that differs between the families; a
subclass of `CausalLM` names it in `attention_cls`.
"""
from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention.metadata import BatchMetadata
from kvjax.config.model import ModelConfig, ModelConfigError
from kvjax.worker.paged_cache import ContiguousCache, LayerPages, LayerRows, PagedCache

# Model types whose config kvjax parses (to size their KV cache) but whose decoder differs
# from the Llama / DeepSeek one built here, with what differs.
_OTHER_DECODERS = {
    "gemma": "Gemma's RMSNorm scales by (1 + weight) and its embeddings by sqrt(hidden_size)",
    "phi3": "Phi-3 checkpoints store fused qkv_proj and gate_up_proj weights",
    "gemma2": "Gemma 2's soft-capped attention and logits, (1 + weight) RMSNorms and extra norms",
    "gemma3_text": "Gemma 3's q/k norms, local and global RoPE bases, (1 + weight) RMSNorms and extra norms",
    "gpt_oss": "gpt-oss's attention sinks and mixture-of-experts MLPs",
}


class UnsupportedModelError(ModelConfigError):
    """A checkpoint feature kvjax's models do not implement (MoE layers, sliding windows, ...)."""


def check_supported(config: ModelConfig) -> None:
    """Refuse, by name, what the decoder would otherwise compute wrongly or cannot build.

    kvjax.config.hf parses these features (kvjax.config.model records them), so a config that uses
    them can still size a KV cache; only building a model refuses them.
    """
    who = config.name or config.model_type
    if config.moe_layers:
        raise UnsupportedModelError(
            f"{who}: layer {config.moe_layers[0]} is a mixture-of-experts layer "
            f"(MoE layers {list(config.moe_layers)}); kvjax's decoder implements dense MLPs only")
    if config.sliding_layers:
        raise UnsupportedModelError(
            f"{who}: sliding-window attention (window {config.sliding_window}) on "
            f"layer {config.sliding_layers[0]} is not implemented; kvjax attends to the full context")
    if config.model_type in _OTHER_DECODERS:
        raise UnsupportedModelError(f"{who}: model_type {config.model_type!r} is not implemented "
                                    f"({_OTHER_DECODERS[config.model_type]})")
    if config.hidden_act != "silu":
        raise UnsupportedModelError(f"{who}: hidden_act {config.hidden_act!r} is not supported (only silu / SwiGLU)")
    if config.rope.unsupported:
        raise UnsupportedModelError(f"{who}: {config.rope.unsupported}")
    missing = [f for f in ("vocab_size", "intermediate_size") if getattr(config, f) is None]
    if missing:
        raise UnsupportedModelError(f"{who}: the config gives no {' and '.join(missing)}, which building "
                                    "the model needs")


def dense(config: ModelConfig, features: int, use_bias: bool, name: str) -> nn.Dense:
    dtype = jnp.dtype(config.dtype)
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


class Attention(nn.Module):
    """An attention layer: (x [T, D], the step's metadata, the layer's cache) → (output [T, D], the
    layer's cache with this step's K/V written). `layouts` are the cache layer kinds (paged,
    contiguous) a subclass's `attend` (its compact method) reads and writes."""

    config: ModelConfig
    attn_impl: str = "reference"
    layouts: ClassVar[tuple[type, ...]] = ()

    def __call__(self, x: jax.Array, md: BatchMetadata, pages: LayerPages | LayerRows
                 ) -> tuple[jax.Array, LayerPages | LayerRows]:
        if not isinstance(pages, self.layouts):
            raise TypeError(f"{type(self).__name__} needs {' or '.join(t.__name__ for t in self.layouts)}, "
                            f"got {type(pages).__name__}")
        return self.attend(x, md, pages)


class RMSNorm(nn.Module):
    """x / rms(x) × weight, normalized in f32 and cast back before the weight (as transformers)."""

    eps: float
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] → [..., D]
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.dtype(self.dtype))
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return weight * normed.astype(x.dtype)


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] → [T, D]
        c = self.config
        gate = dense(c, c.intermediate_size, c.mlp_bias, "gate_proj")(x)
        up = dense(c, c.intermediate_size, c.mlp_bias, "up_proj")(x)
        return dense(c, c.hidden_size, c.mlp_bias, "down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: ModelConfig
    attention_cls: type
    attn_impl: str

    @nn.compact
    def __call__(self, x: jax.Array, md: BatchMetadata, pages: LayerPages | LayerRows
                 ) -> tuple[jax.Array, LayerPages | LayerRows]:
        c = self.config
        h = RMSNorm(c.rms_norm_eps, c.dtype, name="input_layernorm")(x)  # [T, D]
        h, pages = self.attention_cls(c, self.attn_impl, name="self_attn")(h, md, pages)
        x = x + h
        h = RMSNorm(c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x)
        return x + MLP(c, name="mlp")(h), pages


class CausalLM(nn.Module):
    """tokens i32[T], metadata, cache → (logits f32[T, V] or f32[B, V] at logits_indices i32[B], cache)."""

    config: ModelConfig
    attn_impl: str = "reference"
    attention_cls: ClassVar[type]

    @nn.compact
    def __call__(self, tokens: jax.Array, md: BatchMetadata, cache: PagedCache | ContiguousCache,
                 logits_indices: jax.Array | None = None) -> tuple[jax.Array, PagedCache | ContiguousCache]:
        c = self.config
        check_supported(c)
        if len(cache.layers) != c.num_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {c.num_layers}")
        if tokens.shape != md.positions.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and metadata positions "
                             f"{tuple(md.positions.shape)} must both be [T]")
        dtype = jnp.dtype(c.dtype)
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, name="embed_tokens")
        x = embed(tokens)  # [T, D]
        layers = []
        for i in range(c.num_layers):
            x, pages = DecoderLayer(c, self.attention_cls, self.attn_impl, name=f"layers_{i}")(x, md, cache.layers[i])
            layers.append(pages)
        x = RMSNorm(c.rms_norm_eps, c.dtype, name="norm")(x)
        if logits_indices is not None:
            x = x[logits_indices]  # [B, D]
        if c.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = dense(c, c.vocab_size, False, "lm_head")(x)
        return logits.astype(jnp.float32), cache.replace(layers=tuple(layers))
