"""Decoder models over kvjax's paged KV cache, and their Hugging Face checkpoint loader.

    config = from_hf_config("path/to/hf-folder")          # or preset("tiny")
    model = build_model(config, attn_impl="reference")
    params = init_params(model, jax.random.key(0))         # or: config, params = load_checkpoint(path)
    cache = PagedCache.create(config.kv_spec(), num_blocks, block_size)
    step = make_step(model)                                # kvjax.worker.model_runner; donates the cache
    logits, cache = step(params, tokens, metadata, cache)  # tokens i32[T], metadata: BatchMetadata
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.attention import default_impl, get_impl
from kvjax.attention.metadata import build_metadata
from kvjax.config.hf import from_hf_config
from kvjax.config.model import ModelConfig, ModelConfigError
from kvjax.config.presets import PRESETS, preset
from kvjax.models.deepseek import DeepseekForCausalLM
from kvjax.models.gemma import GemmaForCausalLM
from kvjax.models.gpt_oss import GptOssForCausalLM
from kvjax.models.layers import GEMMA_TYPES, CausalLM, UnsupportedModelError, check_supported
from kvjax.models.llama import LlamaForCausalLM
from kvjax.worker.paged_cache import PagedCache


def build_model(config: ModelConfig, attn_impl: str | None = None) -> CausalLM:
    """The Flax module for `config`; refuses unsupported layers and unknown attn_impl up front.
    attn_impl None: kvjax.attention.default_impl() ("pallas" on GPU, "reference" elsewhere)."""
    check_supported(config)
    attn_impl = attn_impl or default_impl()
    get_impl(attn_impl)
    if config.is_mla:
        return DeepseekForCausalLM(config, attn_impl)
    if config.model_type in GEMMA_TYPES:
        return GemmaForCausalLM(config, attn_impl)
    if config.model_type == "gpt_oss":
        return GptOssForCausalLM(config, attn_impl)
    return LlamaForCausalLM(config, attn_impl)


def init_params(model: CausalLM, rng: jax.Array):
    """Random parameters (Flax default initializers) for `model`, traced on a one-token batch;
    refused (kvjax.accounting.memory.check_fits) before any is made when they cannot fit the device."""
    from kvjax.accounting import memory as mem

    tokens, md, cache = _dummy_inputs(model.config)
    make = jax.jit(lambda key: model.init(key, tokens, md, cache)["params"])
    mem.check_fits(f"the {model.config.dtype} weights of a {model.config.model_type} model "
                   f"({model.config.num_layers} layers, hidden {model.config.hidden_size})",
                   mem.tree_bytes(make.eval_shape(rng)))
    return make(rng)


def param_shapes(model: CausalLM):
    """The parameter tree as jax.ShapeDtypeStruct leaves, without allocating anything."""
    tokens, md, cache = _dummy_inputs(model.config)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, md, cache)["params"])


def _dummy_inputs(config: ModelConfig):
    md = build_metadata([0], [1], [[1]], block_size=1, max_tokens=1, max_seqs=1, max_blocks_per_seq=1)
    return jnp.zeros((1,), jnp.int32), md, PagedCache.create(config.kv_spec(), 2, 1)


__all__ = ["PRESETS", "CausalLM", "DeepseekForCausalLM", "GemmaForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM",
           "ModelConfig", "ModelConfigError", "UnsupportedModelError", "build_model", "from_hf_config", "init_params",
           "param_shapes", "preset"]
