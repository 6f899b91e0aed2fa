"""Decoder models over kvjax's paged KV cache, and their Hugging Face checkpoint loader.

    config = from_hf_config("path/to/hf-folder")          # or preset("tiny")
    model = build_model(config, attn_impl="reference")
    params = init_params(model, jax.random.key(0))         # or: config, params = load_checkpoint(path)
    cache = PagedCache.create(config.kv_spec(), num_blocks, block_size)
    step = make_step(model)                                # kvjax.worker.model_runner; donates the cache
    logits, cache = step(params, tokens, metadata, cache)  # tokens i32[T], metadata: BatchMetadata

An attention + Mamba hybrid (Bamba, Granite-4.0-H, Nemotron-H: models.hybrid) takes the cache of
kvjax.worker.mamba_state.create_hybrid_cache and metadata with its KV cache groups (build_metadata's windows and
layer_groups: the Mamba layers' state block is their group's table entry).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.attention import get_impl
from kvjax.attention.metadata import build_metadata
from kvjax.config.attention import default_impl
from kvjax.config.hf import from_hf_config
from kvjax.config.model import ModelConfig, ModelConfigError
from kvjax.config.presets import PRESETS, preset
from kvjax.models.deepseek import DeepseekForCausalLM
from kvjax.models.gemma import GemmaForCausalLM
from kvjax.core.kv_cache_groups import MAMBA
from kvjax.core.mamba_spec import hybrid_block_size
from kvjax.models.gpt_oss import GptOssForCausalLM
from kvjax.models.hybrid import HybridForCausalLM, check_hybrid
from kvjax.models.layers import GEMMA_TYPES, CausalLM, UnsupportedModelError, check_supported
from kvjax.models.llama import LlamaForCausalLM
from kvjax.worker.mamba_state import create_hybrid_cache
from kvjax.worker.paged_cache import PagedCache


def build_model(config: ModelConfig, attn_impl: str | None = None) -> CausalLM:
    """The Flax module for `config`; refuses unsupported layers and unknown attn_impl up front.
    attn_impl None: kvjax.config.attention.default_impl() ("pallas" on GPU, "reference" elsewhere)."""
    attn_impl = attn_impl or default_impl()
    if config.layer_types:  # an attention + Mamba hybrid (models.hybrid)
        check_hybrid(config)
        get_impl(attn_impl)
        return HybridForCausalLM(config, attn_impl)
    check_supported(config)
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


def random_params(model: CausalLM, rng: jax.Array):
    """Random parameters with init_params' distributions, made in seconds on a GPU for a model of
    billions of parameters (init_params compiles the whole model's init, which took 77 s for
    Llama-3-8B on an H200): each matrix drawn by one small jitted initializer per distinct
    (shape, dtype, rule), so 32 layers compile about ten programs. The vectors (norm weights,
    biases, sinks) come from Flax's own init, jitted with every matrix dropped from its outputs,
    which XLA then never computes (_RULES names the matrices). The values differ from init_params'; the distributions are
    Flax's defaults, leaf by leaf: nn.Embed's variance_scaling(1, fan_in, normal, out_axis=0),
    nn.Dense's lecun_normal, the MoE experts' variance_scaling(1, fan_in, truncated_normal,
    batch_axis=0). Refused, as init_params, when the weights cannot fit the device."""
    from kvjax.accounting import memory as mem

    shapes = param_shapes(model)
    mem.check_fits(f"the {model.config.dtype} weights of a {model.config.model_type} model "
                   f"({model.config.num_layers} layers, hidden {model.config.hidden_size})", mem.tree_bytes(shapes))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    rules = [_RULES.get((getattr(path[-1], "key", None), leaf.ndim)) for path, leaf in leaves]
    tokens, md, cache = _dummy_inputs(model.config)
    flat_init = jax.jit(lambda key: [None if rule else leaf for rule, leaf in
                                     zip(rules, jax.tree.leaves(model.init(key, tokens, md, cache)["params"]))])
    out = flat_init(rng)
    keys = jax.random.split(jax.random.fold_in(rng, 1), len(leaves))
    for i, (key, rule, (_, leaf)) in enumerate(zip(keys, rules, leaves)):
        if rule:
            out[i] = _random_leaf(key, leaf.shape, leaf.dtype, rule)
    return jax.tree_util.tree_unflatten(treedef, out)


# (leaf name, ndim) → the Flax initializer its module uses; every other leaf (norm weights, biases,
# sinks) comes from Flax's init itself.
_RULES = {("embedding", 2): "embed", ("kernel", 2): "dense", ("gate_up_proj", 3): "experts",
          ("down_proj", 3): "experts"}


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "rule"))
def _random_leaf(key, shape, dtype, rule):
    import flax.linen as nn

    init = {"embed": nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
            "dense": nn.initializers.lecun_normal(),
            "experts": nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                                        out_axis=-1, batch_axis=(0,))}[rule]
    return init(key, shape, dtype)


def param_shapes(model: CausalLM):
    """The parameter tree as jax.ShapeDtypeStruct leaves, without allocating anything."""
    tokens, md, cache = _dummy_inputs(model.config)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, md, cache)["params"])


def _dummy_inputs(config: ModelConfig):
    if config.layer_types:  # a hybrid: one attention group (0) and one Mamba group (1), sharing block 1
        groups = tuple(int(t == "mamba") for t in config.layer_types)
        spec, state = config.kv_spec(), config.mamba.state_spec(config.dtype)
        z = hybrid_block_size(spec.layer_bytes_per_token(0), state.page_bytes, 1)  # a page holds a state
        md = build_metadata([0], [1], [[[1], [1]]], block_size=z, max_tokens=1, max_seqs=1, max_blocks_per_seq=1,
                            windows=(None, MAMBA), layer_groups=groups)
        cache = create_hybrid_cache(spec, state, config.layer_types, 2, z)
        return jnp.zeros((1,), jnp.int32), md, cache
    md = build_metadata([0], [1], [[1]], block_size=1, max_tokens=1, max_seqs=1, max_blocks_per_seq=1)
    return jnp.zeros((1,), jnp.int32), md, PagedCache.create(config.kv_spec(), 2, 1)


__all__ = ["PRESETS", "CausalLM", "DeepseekForCausalLM", "GemmaForCausalLM", "GptOssForCausalLM", "HybridForCausalLM", "LlamaForCausalLM",
           "ModelConfig", "ModelConfigError", "UnsupportedModelError", "build_model", "from_hf_config", "init_params",
           "param_shapes", "preset", "random_params"]
