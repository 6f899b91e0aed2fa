"""The Hugging Face config parser for attention + state-space hybrids (kvjax.config.hf's, for the
HYBRID_TYPES): each family's config.json read as its transformers 5 config class reads it, with that
class's defaults, into a `ModelConfig` whose `layer_types` say which layers carry attention and which a
Mamba mixer (`kvjax.config.mamba.MambaConfig`). Plain Python, no JAX.

    family            layers (transformers' rule)                                  Mamba
    bamba             attention at attn_layer_indices, Mamba elsewhere             Mamba2, mamba_* fields
    granitemoehybrid  layer_types ("attention"/"full_attention", "mamba"/           Mamba2, mamba_* fields
                      "linear_attention"; absent: every layer Mamba)
    nemotron_h        hybrid_override_pattern (M Mamba, * attention, - MLP) or       Mamba2: mamba_num_heads ×
                      layers_block_type                                             mamba_head_dim, n_groups, ...
    falcon_h1         every layer attention and Mamba side by side                  Mamba2, mamba_d_ssm wide
    jamba             attention where i % attn_layer_period == attn_layer_offset    Mamba1, mamba_* fields

The SSM state's default dtype is vLLM's: Nemotron-H's config names it (mamba_ssm_cache_dtype, else
float32: `NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype`), the others follow the model dtype.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from kvjax.config import hf_fields as hf
from kvjax.config.mamba import MambaConfig
from kvjax.config.model import ModelConfig, ModelConfigError, MoEConfig

# transformers' defaults that differ between the families: (rms_norm_eps, tie_word_embeddings, max_position_embeddings)
_DEFAULTS = {"bamba": (1e-5, False, 262144), "granitemoehybrid": (1e-6, False, 2048),
             "nemotron_h": (1e-5, False, 4096), "falcon_h1": (1e-5, False, 8192), "jamba": (1e-6, False, 262144)}
_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


def parse(cfg: Mapping[str, Any], common: dict) -> ModelConfig:
    """The ModelConfig of a hybrid's config.json (module docstring); common: kvjax.config.hf's shared fields."""
    model_type = common["model_type"]
    eps, tie, max_pos = _DEFAULTS[model_type]
    eps_key = "layer_norm_epsilon" if model_type == "nemotron_h" else "rms_norm_eps"
    common = dict(common, rms_norm_eps=hf._number(cfg, eps_key, ModelConfigError, default=eps),
                  tie_word_embeddings=hf._bool(cfg, "tie_word_embeddings", tie),
                  max_position_embeddings=hf._int(cfg, "max_position_embeddings", max_pos))
    return {"bamba": _bamba, "granitemoehybrid": _granite, "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1,
            "jamba": _jamba}[model_type](cfg, common)


def _mamba2(cfg: Mapping[str, Any], inner: int, **kw) -> MambaConfig:
    """The mamba_* fields of Bamba, Granite-4.0-H and Falcon-H1 (mamba_d_head "auto": inner / heads)."""
    heads = hf._int(cfg, "mamba_n_heads", 128)
    head = cfg.get("mamba_d_head", "auto")
    head = inner // heads if head == "auto" else hf._int(cfg, "mamba_d_head")
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    return MambaConfig(2, inner, hf._int(cfg, "mamba_d_state", 256), hf._int(cfg, "mamba_d_conv", 4), num_heads=heads,
                       head_dim=head, n_groups=hf._int(cfg, "mamba_n_groups", 1),
                       chunk_size=hf._int(cfg, "mamba_chunk_size", 256),
                       conv_bias=hf._bool(cfg, "mamba_conv_bias", True), proj_bias=hf._bool(cfg, "mamba_proj_bias", False),
                       time_step_limit=_limit(limit), **kw)


def _limit(limit) -> tuple[float, float]:
    """time_step_limit as floats; transformers 5 writes infinity into config.json as {"__float__": "Infinity"}."""
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ModelConfigError(f"config field 'time_step_limit' must be two numbers, got {hf._show(limit)}")
    out = []
    for x in limit:
        x = x.get("__float__") if isinstance(x, dict) else x
        try:
            out.append(float(x))
        except (TypeError, ValueError):
            raise ModelConfigError(f"config field 'time_step_limit' must be two numbers, got {hf._show(limit)}") from None
    return out[0], out[1]


def _head_dim(cfg: Mapping[str, Any], common: dict) -> int:
    hidden, heads = common["hidden_size"], common["num_heads"]
    if cfg.get("head_dim") is not None:
        return hf._int(cfg, "head_dim")
    if hidden % heads:
        raise ModelConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    return hidden // heads


def _bamba(cfg, common) -> ModelConfig:
    layers = common["num_layers"]
    attn = set(hf._int_list(cfg, "attn_layer_indices"))
    types = tuple("attention" if i in attn else "mamba" for i in range(layers))
    rope = hf.rope_from_hf({**cfg, "partial_rotary_factor": 0.5})  # BambaConfig hard-codes half the dims rotating
    return ModelConfig(**common, head_dim=_head_dim(cfg, common), rope=rope, layer_types=types,
                       mlp_bias=hf._bool(cfg, "mlp_bias", False), qkv_bias=hf._bool(cfg, "attention_bias", False),
                       o_bias=hf._bool(cfg, "attention_bias", False),
                       mamba=_mamba2(cfg, hf._int(cfg, "mamba_expand", 2) * common["hidden_size"]))


def _granite(cfg, common) -> ModelConfig:
    layers = common["num_layers"]
    given = cfg.get("layer_types", cfg.get("layers_block_type"))
    given = ["mamba"] * layers if given is None else given
    if not isinstance(given, list) or len(given) != layers or not all(t in _LEGACY for t in given):
        raise ModelConfigError(f"config field 'layer_types' must give 'mamba' or 'attention' for each of the {layers} "
                               f"layers, got {hf._show(given)}")
    experts = hf._int(cfg, "num_local_experts", 8, lo=0)
    shared = hf._int(cfg, "shared_intermediate_size", 1024)
    moe = MoEConfig(experts, hf._int(cfg, "num_experts_per_tok", 2), hf._int(cfg, "intermediate_size", 11008),
                    scoring_func="topk_softmax", shared_intermediate_size=shared, f32_weights=False) if experts else None
    pos = cfg.get("position_embedding_type")
    bias = hf._bool(cfg, "attention_bias", False)
    return ModelConfig(**dict(common, intermediate_size=shared), head_dim=_head_dim(cfg, common),
                       rope=hf.rope_from_hf(cfg), use_rope=pos != "nope", qkv_bias=bias, o_bias=bias,
                       granite_multipliers=tuple(hf._number(cfg, k, ModelConfigError, default=1.0) for k in (
                           "embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")),
                       layer_types=tuple(_LEGACY[t] for t in given), moe_layers=tuple(range(layers)) if moe else (),
                       moe=moe, mamba=_mamba2(cfg, hf._int(cfg, "mamba_expand", 2) * common["hidden_size"]))


def _nemotron_h(cfg, common) -> ModelConfig:
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or set(pattern) - set(_NEMOTRON_PATTERN):
            raise ModelConfigError(f"config field 'hybrid_override_pattern' must be a string of M, *, - and E, "
                                   f"got {hf._show(pattern)}")
        types = [_NEMOTRON_PATTERN[c] for c in pattern]
    else:
        given = cfg.get("layers_block_type") or cfg.get("layer_types") or []
        names = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
        if not isinstance(given, list) or not given or not all(t in names for t in given):
            raise ModelConfigError(f"config field 'layers_block_type' must list linear_attention, full_attention, mlp "
                                   f"or moe per layer, got {hf._show(given)}")
        types = [names[t] for t in given]
    if "moe" in types:
        raise ModelConfigError("nemotron_h mixture-of-experts layers (E) are not supported")
    heads, head = hf._int(cfg, "mamba_num_heads", 128), hf._int(cfg, "mamba_head_dim", 64)
    ssm_dtype = cfg.get("mamba_ssm_cache_dtype") or "float32"  # vLLM's NemotronH default, transformers' too
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    mamba = MambaConfig(2, heads * head, hf._int(cfg, "ssm_state_size", 128), hf._int(cfg, "conv_kernel", 4),
                        num_heads=heads, head_dim=head, n_groups=hf._int(cfg, "n_groups", 8),
                        chunk_size=hf._int(cfg, "chunk_size", 128), conv_bias=hf._bool(cfg, "use_conv_bias", True),
                        proj_bias=hf._bool(cfg, "mamba_proj_bias", False), ssm_cache_dtype=ssm_dtype,
                        time_step_limit=_limit(limit))
    bias = hf._bool(cfg, "attention_bias", False)
    return ModelConfig(**dict(common, num_layers=len(types), intermediate_size=hf._int(cfg, "intermediate_size", 21504),
                              hidden_act=cfg.get("mlp_hidden_act", "relu2")),
                       head_dim=hf._int(cfg, "head_dim", 128), use_rope=False, qkv_bias=bias, o_bias=bias,
                       mlp_bias=hf._bool(cfg, "mlp_bias", False), layer_types=tuple(types), mamba=mamba)


def _falcon_h1(cfg, common) -> ModelConfig:
    inner = (hf._int(cfg, "mamba_d_ssm") if cfg.get("mamba_d_ssm") is not None
             else hf._int(cfg, "mamba_expand", 2) * common["hidden_size"])
    mamba = _mamba2(cfg, inner, gated_norm=hf._bool(cfg, "mamba_rms_norm", False),
                    norm_before_gate=hf._bool(cfg, "mamba_norm_before_gate", True))
    bias = hf._bool(cfg, "attention_bias", False)
    return ModelConfig(**common, head_dim=_head_dim(cfg, common), rope=hf.rope_from_hf(cfg), qkv_bias=bias, o_bias=bias,
                       mlp_bias=hf._bool(cfg, "mlp_bias", False),
                       layer_types=("attention_mamba",) * common["num_layers"], mamba=mamba)


def _jamba(cfg, common) -> ModelConfig:
    layers, hidden = common["num_layers"], common["hidden_size"]
    period, offset = hf._int(cfg, "attn_layer_period", 8), hf._int(cfg, "attn_layer_offset", 4, lo=0)
    e_period, e_offset = hf._int(cfg, "expert_layer_period", 2), hf._int(cfg, "expert_layer_offset", 1, lo=0)
    experts = hf._int(cfg, "num_experts", 16)
    rank = cfg.get("mamba_dt_rank", "auto")
    rank = math.ceil(hidden / 16) if rank == "auto" else hf._int(cfg, "mamba_dt_rank")
    mamba = MambaConfig(1, hf._int(cfg, "mamba_expand", 2) * hidden, hf._int(cfg, "mamba_d_state", 16),
                        hf._int(cfg, "mamba_d_conv", 4), dt_rank=rank, conv_bias=hf._bool(cfg, "mamba_conv_bias", True),
                        proj_bias=hf._bool(cfg, "mamba_proj_bias", False))
    # transformers: a layer with 1 expert is a dense MLP (layers_num_experts); the router softmaxes over every
    # expert and keeps the top k's probabilities as they are
    moe_layers = tuple(i for i in range(layers) if experts > 1 and i % e_period == e_offset)
    moe = MoEConfig(experts, hf._int(cfg, "num_experts_per_tok", 2), common["intermediate_size"] or 14336,
                    f32_weights=False) if moe_layers else None
    return ModelConfig(**dict(common, intermediate_size=hf._int(cfg, "intermediate_size", 14336)),
                       head_dim=_head_dim(cfg, common), use_rope=False, moe_layers=moe_layers, moe=moe, mamba=mamba,
                       layer_types=tuple("attention" if i % period == offset else "mamba" for i in range(layers)))
