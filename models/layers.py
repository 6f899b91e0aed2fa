"""The decoder the model families share: RMSNorm, pre-norm block, causal LM head (the gated MLP: models.mlp).

Structure and parameter names follow transformers' `LlamaForCausalLM` / `DeepseekV3ForCausalLM`
(`model.layers.{i}.self_attn…`, `input_layernorm`, `post_attention_layernorm`, `mlp.{gate,up,
down}_proj`, `model.norm`, `lm_head`), so the loader maps names one to one: Flax `layers_{i}`
is HF `model.layers.{i}`, a Dense `kernel` is the transposed HF `weight`.

The paged cache is an argument and a result of every call, never module state: a decoder
step is `(tokens, metadata, cache) -> (logits, cache)`, a pure function that jit can donate
the cache to. What differs between the families is named by class attributes of `CausalLM`:
the attention module (`attention_cls`), the block (`layer_cls`), the norm (`norm_cls`) and
whether embeddings are scaled by sqrt(hidden_size) (`scale_embeddings`, Gemma). Each layer's
attention knows its index, so it reads its own sliding window and RoPE from the config; a layer in
`config.moe_layers` has a mixture-of-experts block (models.moe.MoE) where the others have the MLP.
"""
from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention.metadata import BatchMetadata
from kvjax.config.model import ModelConfig, ModelConfigError
from kvjax.models.mlp import MLP, dense  # the families' modules import dense from here too
from kvjax.models.moe import MoE
from kvjax.worker.paged_cache import ContiguousCache, LayerPages, LayerRows, PagedCache

# Model types whose config kvjax parses (to size their KV cache) but whose decoder differs
# from the ones built here, with what differs.
_OTHER_DECODERS = {
    "gemma": "Gemma's RMSNorm scales by (1 + weight) and its embeddings by sqrt(hidden_size)",
    "phi3": "Phi-3 checkpoints store fused qkv_proj and gate_up_proj weights",
}
GEMMA_TYPES = ("gemma2", "gemma3_text")  # built by models.gemma (gpt_oss by models.gpt_oss)

_FAMILY_ACT = {"silu": "silu / SwiGLU", "gelu_pytorch_tanh": "gelu_pytorch_tanh / GeGLU"}


class UnsupportedModelError(ModelConfigError):
    """A checkpoint feature kvjax's models do not implement (fused weights, rope types, ...)."""


def check_supported(config: ModelConfig) -> None:
    """Refuse, by name, what the decoder would otherwise compute wrongly or cannot build.

    kvjax.config.hf parses these features (kvjax.config.model records them), so a config that uses
    them can still size a KV cache; only building a model refuses them.
    """
    who = config.name or config.model_type
    if config.model_type in _OTHER_DECODERS:
        raise UnsupportedModelError(f"{who}: model_type {config.model_type!r} is not implemented "
                                    f"({_OTHER_DECODERS[config.model_type]})")
    if config.model_type in GEMMA_TYPES and config.sliding_window is None:
        # transformers' layer_types still marks sliding layers (Gemma 3: with the local RoPE base),
        # and its mask builder raises without a window: there is no model to match.
        raise UnsupportedModelError(f"{who}: a {config.model_type} config with sliding_window null; its sliding "
                                    "layers need a window (transformers refuses it too)")
    if config.model_type == "gemma3_text" and config.attn_logit_softcap is not None:
        raise UnsupportedModelError(
            f"{who}: attn_logit_softcapping {config.attn_logit_softcap} on a gemma3_text model: transformers' "
            "Gemma3Attention and vLLM's both ignore it, so kvjax refuses rather than pick a meaning")
    wanted = "gelu_pytorch_tanh" if config.model_type in GEMMA_TYPES else "silu"
    if config.hidden_act != wanted:
        raise UnsupportedModelError(f"{who}: hidden_act {config.hidden_act!r} is not supported "
                                    f"(only {_FAMILY_ACT[wanted]})")
    for rope in (config.rope, config.rope_local):
        if rope is not None and rope.unsupported:
            raise UnsupportedModelError(f"{who}: {rope.unsupported}")
    dense_layers = len(config.moe_layers) < config.num_layers  # a model of MoE layers only needs no intermediate_size
    missing = [f for f in ("vocab_size", "intermediate_size") if getattr(config, f) is None
               and (f == "vocab_size" or dense_layers)]
    if missing:
        raise UnsupportedModelError(f"{who}: the config gives no {' and '.join(missing)}, which building "
                                    "the model needs")


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """Gemma's tanh soft-capping: cap · tanh(x / cap), smooth and within (-cap, cap)."""
    return cap * jnp.tanh(x / cap)


class Attention(nn.Module):
    """An attention layer: (x [T, D], the step's metadata, the layer's cache) → (output [T, D], the
    layer's cache with this step's K/V written). `layouts` are the cache layer kinds (paged,
    contiguous) a subclass's `attend` (its compact method) reads and writes."""

    config: ModelConfig
    attn_impl: str = "reference"
    layer: int = 0  # this layer's index: its sliding window and RoPE (ModelConfig.layer_windows, layer_rope)
    layouts: ClassVar[tuple[type, ...]] = ()

    def __call__(self, x: jax.Array, md: BatchMetadata, pages: LayerPages | LayerRows
                 ) -> tuple[jax.Array, LayerPages | LayerRows]:
        if not isinstance(pages, self.layouts):
            raise TypeError(f"{type(self).__name__} needs {' or '.join(t.__name__ for t in self.layouts)}, "
                            f"got {type(pages).__name__}")
        return self.attend(x, md, pages)


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in f32 (both norms' shared step). [..., D] → f32[..., D]."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """x / rms(x) × weight, normalized in f32 and cast back before the weight (transformers'
    LlamaRMSNorm); with unit_offset, x / rms(x) × (1 + weight) all in f32, cast back at the end,
    its weight starting at 0 (transformers' Gemma2RMSNorm / Gemma3RMSNorm)."""

    eps: float
    dtype: str = "float32"
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] → [..., D]
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), jnp.dtype(self.dtype))
        if self.unit_offset:
            return (rms_normalized(x, self.eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        return weight * rms_normalized(x, self.eps).astype(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); with the config's sandwich norms
    (Gemma 2 / 3) every sublayer's output is normalized too, before it joins the residual."""

    config: ModelConfig
    attention_cls: type
    attn_impl: str
    layer: int
    norm_cls: ClassVar[type] = RMSNorm

    @nn.compact
    def __call__(self, x: jax.Array, md: BatchMetadata, pages: LayerPages | LayerRows
                 ) -> tuple[jax.Array, LayerPages | LayerRows]:
        c = self.config

        def norm(name):
            return self.norm_cls(c.rms_norm_eps, c.dtype, name=name)

        h = norm("input_layernorm")(x)  # [T, D]
        h, pages = self.attention_cls(c, self.attn_impl, self.layer, name="self_attn")(h, md, pages)
        mlp = MoE(c, name="mlp") if self.layer in c.moe_layers else MLP(c, name="mlp")
        if c.sandwich_norms:
            x = x + norm("post_attention_layernorm")(h)
            h = mlp(norm("pre_feedforward_layernorm")(x))
            return x + norm("post_feedforward_layernorm")(h), pages
        x = x + h
        return x + mlp(norm("post_attention_layernorm")(x)), pages


class CausalLM(nn.Module):
    """tokens i32[T], metadata, cache → (logits f32[T, V] or f32[B, V] at logits_indices i32[B], cache)."""

    config: ModelConfig
    attn_impl: str = "reference"
    attention_cls: ClassVar[type]
    layer_cls: ClassVar[type] = DecoderLayer
    norm_cls: ClassVar[type] = RMSNorm  # the final norm
    scale_embeddings: ClassVar[bool] = False  # Gemma: embeddings × sqrt(hidden_size)

    @nn.compact
    def __call__(self, tokens: jax.Array, md: BatchMetadata, cache: PagedCache | ContiguousCache,
                 logits_indices: jax.Array | None = None) -> tuple[jax.Array, PagedCache | ContiguousCache]:
        c = self.config
        check_supported(c)
        if cache.num_layers != c.num_layers:
            raise ValueError(f"cache has {cache.num_layers} layers, the model {c.num_layers}")
        if tokens.shape != md.positions.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and metadata positions "
                             f"{tuple(md.positions.shape)} must both be [T]")
        dtype = jnp.dtype(c.dtype)
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, name="embed_tokens")
        x = embed(tokens)  # [T, D]
        if self.scale_embeddings:
            # transformers rounds the normalizer to the embedding dtype first (bf16: sqrt(3072) = 55.5)
            x = x * jnp.asarray(c.hidden_size ** 0.5, dtype)
        layers = list(cache.layers)
        for i in range(c.num_layers):  # with KV cache groups: its group's block tables, the tensor it shares
            j = cache.slot_of(i)
            x, layers[j] = self.layer_cls(c, self.attention_cls, self.attn_impl, i, name=f"layers_{i}")(
                x, md.for_layer(i), layers[j])
        x = self.norm_cls(c.rms_norm_eps, c.dtype, name="norm")(x)
        if logits_indices is not None:
            x = x[logits_indices]  # [B, D]
        if c.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = dense(c, c.vocab_size, False, "lm_head")(x)
        if c.final_logit_softcap is not None:
            logits = softcap(logits, c.final_logit_softcap)  # in the model dtype, as transformers
        return logits.astype(jnp.float32), cache.replace(layers=tuple(layers))
