"""The Hugging Face config parser: `from_hf_config`, a config.json to a `kvjax.config.model.ModelConfig`.

`from_hf_config` reads a config.json the way transformers' config classes do (their defaults
for absent fields) for every model type whose KV cache kvjax can size: the Llama family (llama,
mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3 and the MoE variants qwen2_moe, qwen3_moe,
mixtral, gpt_oss; GQA from MQA to MHA), the MLA family (deepseek_v2, deepseek_v3, kimi_k2;
multi-head latent attention, arXiv 2405.04434) and the attention + Mamba hybrids (bamba, granitemoehybrid,
nemotron_h, falcon_h1, jamba: kvjax.config.hf_mamba). `rope_from_hf` reads the rotary parameters into a `RopeConfig`;
the MoE families' routing fields become a `MoEConfig` (`ModelConfig.moe`) beside the MoE layer indices.

What the Flax decoder does not implement is parsed and recorded, never dropped; a field that
cannot be read raises `ModelConfigError` naming it, its value and the file, at load rather than
mid-run: every field read is checked against its type and range — sizes positive int32 integers,
booleans JSON booleans (the string "false" is not false), enums from their known set, eos_token_id
a token id below vocab_size, and the RoPE and norm parameters within the domain where their
formulas are finite (kvjax.config.model: rope_theta > 1, yarn's betas ≥ 0, ...). Plain Python, no JAX.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from kvjax.config.model import (HYBRID_TYPES, MAX_LAYERS, MLA_TYPES, MODEL_TYPES, SCORING_FUNCS, TOPK_METHODS, ModelConfig,
                                ModelConfigError, MoEConfig, RopeConfig, RopeError)
from kvjax.config.hf_fields import _bool, _int, _int_list, _number, _show, rope_from_hf
from kvjax.errors import KvjaxError
from kvjax.utils.checks import INT32_MAX, is_int
from kvjax.utils.strict_json import read_json_object


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
def load_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """Read a config.json (a file, or a folder holding one) or pass a dict through."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        return read_json_object(path, "config file")
    except KvjaxError as e:  # one error type for every config problem
        raise ModelConfigError(str(e)) from None


def _check_eos(cfg: Mapping[str, Any], vocab: int | None) -> None:
    """eos_token_id (an id or a list of them; null: none) within the vocabulary: generation stops
    at it, and the engine keeps token ids as int32."""
    value = cfg.get("eos_token_id")
    hi = INT32_MAX if vocab is None else vocab - 1
    for v in [] if value is None else value if isinstance(value, list) else [value]:
        if not is_int(v) or not 0 <= v <= hi:
            raise ModelConfigError(f"config field 'eos_token_id' must be a token id in [0, {hi:,}]"
                                   f"{'' if vocab is None else ' (below vocab_size)'} or a list of them, "
                                   f"got {_show(value)}")


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any], dtype: str | None = None, *,
                   source: str | None = None) -> ModelConfig:
    """ModelConfig from a Hugging Face config (a folder, a config.json, or its dict).

    dtype overrides the checkpoint's `dtype` / `torch_dtype` (e.g. "float32" for tests).
    Absent fields take transformers' defaults for that model_type; num_key_value_heads defaults
    to num_attention_heads, and an explicit head_dim wins over hidden_size // num_attention_heads.
    A field that breaks a rule is a ModelConfigError that starts with `source` (default: the
    config.json's path; a dict has none unless given), as kvjax.errors.InputFileError does.
    """
    cfg = load_hf_config(path_or_dict)
    name = None
    if not isinstance(path_or_dict, Mapping):  # the checkpoint folder's name
        path = os.fspath(path_or_dict)
        is_dir = os.path.isdir(path)
        name = os.path.basename(os.path.abspath(path if is_dir else os.path.dirname(path) or "."))
        source = source or (os.path.join(path, "config.json") if is_dir else path)
    try:
        return _parse(cfg, dtype, name)
    except (ModelConfigError, RopeError) as e:
        raise ModelConfigError(f"{source}: {e}" if source else str(e)) from None


def _parse(cfg: Mapping[str, Any], dtype: str | None, name: str | None) -> ModelConfig:
    model_type = cfg.get("model_type")
    if not model_type:
        raise ModelConfigError("config is missing the field 'model_type'")
    if model_type not in MODEL_TYPES:
        raise ModelConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    heads = _int(cfg, "num_attention_heads")
    gemma = model_type in ("gemma", "gemma2", "gemma3_text")
    act_key = "hidden_activation" if "hidden_activation" in cfg else "hidden_act"  # Gemma 2/3 name it so
    if not isinstance(cfg.get(act_key, ""), str):
        raise ModelConfigError(f"config field {act_key!r} must be a string, got {_show(cfg[act_key])}")
    vocab = _int(cfg, "vocab_size", None)
    _check_eos(cfg, vocab)
    common = dict(
        model_type=model_type, vocab_size=vocab, hidden_size=_int(cfg, "hidden_size"),
        intermediate_size=_int(cfg, "intermediate_size", None),
        # per-layer tables are built from it; Nemotron-H's is its layer pattern's length (kvjax.config.hf_mamba)
        num_layers=_int(cfg, "num_hidden_layers", None if model_type == "nemotron_h" else ..., hi=MAX_LAYERS),
        num_heads=heads, num_kv_heads=_int(cfg, "num_key_value_heads", heads),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096 if model_type == "deepseek_v3" else 2048),
        rms_norm_eps=_number(cfg, "rms_norm_eps", ModelConfigError, default=1e-6),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", gemma),  # Gemma ties by default
        hidden_act=cfg.get(act_key, "gelu_pytorch_tanh" if gemma else "silu"),
        dtype=dtype or _dtype(cfg),
        name=name or model_type)
    try:
        if model_type in MLA_TYPES:
            return _mla(cfg, common)
        if model_type in HYBRID_TYPES:  # attention + state-space hybrids: their own parser
            from kvjax.config import hf_mamba

            return hf_mamba.parse(cfg, common)
        return _gqa(cfg, common)
    except RopeError as e:
        raise ModelConfigError(f"{model_type} config: {e}") from None


def _dtype(cfg: Mapping[str, Any]) -> str:
    value = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    if not isinstance(value, str):
        raise ModelConfigError(f"config field 'dtype' must be a string, got {_show(value)}")
    return value.replace("torch.", "")


def _gqa(cfg: Mapping[str, Any], common: dict) -> ModelConfig:
    model_type, layers = common["model_type"], common["num_layers"]
    head_dim = _int(cfg, "head_dim", _HEAD_DIM.get(model_type))
    if head_dim is None:
        hidden, heads = common["hidden_size"], common["num_heads"]
        if hidden % heads:
            raise ModelConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                                   "the config needs an explicit head_dim")
        head_dim = hidden // heads
    bias = _bool(cfg, "attention_bias", model_type == "gpt_oss")
    qkv_bias, o_bias = (bias, bias)
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif model_type == "qwen2_moe":  # Qwen2MoeConfig.qkv_bias (default true); o_proj never has one
        qkv_bias, o_bias = _bool(cfg, "qkv_bias", True), False
    window, sliding = None, ()
    if model_type in ("mistral", "mixtral", "phi3") and cfg.get("sliding_window") is not None:
        window, sliding = _int(cfg, "sliding_window"), tuple(range(layers))
    elif model_type.startswith(("qwen2", "qwen3")) and _bool(cfg, "use_sliding_window", False):
        window = _int(cfg, "sliding_window", 4096)
        first_sliding = _int(cfg, "max_window_layers", 28, lo=0)
        sliding = _sliding_layers(cfg, layers, lambda i: i >= first_sliding)
    elif model_type in _LAYER_PATTERNS and (cfg.get("sliding_window", 0) is not None):
        if _bool(cfg, "use_bidirectional_attention", False):
            raise ModelConfigError(f"{model_type} config: use_bidirectional_attention makes it an encoder "
                                   "(transformers halves its window), not a causal decoder")
        default_window, period_key, default_period = _LAYER_PATTERNS[model_type]
        window = _int(cfg, "sliding_window", default_window)
        period = _int(cfg, period_key, default_period) if period_key else default_period
        sliding = _sliding_layers(cfg, layers, lambda i: bool((i + 1) % period))
    if model_type in ("mixtral", "gpt_oss"):
        moe = tuple(range(layers))
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        # transformers: a sparse block where the layer is not in mlp_only_layers and (i + 1) % step == 0.
        experts = _num_experts(cfg, model_type, lo=0)
        step, dense = _int(cfg, "decoder_sparse_step", 1), set(_int_list(cfg, "mlp_only_layers"))
        moe = tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0)
    else:
        moe = ()
    extra = {}
    if model_type == "gemma3_text":
        rope, extra["rope_local"] = _gemma3_ropes(cfg)
    elif model_type == "gpt_oss":  # GptOssConfig's defaults: YaRN ×32 over 4096 positions, θ 150000
        rope = rope_from_hf(cfg, layout="half", default_theta=150000.0, default=_GPT_OSS_ROPE)
    else:
        rope = rope_from_hf(cfg, layout="half")
    if model_type in _GEMMA_SCALARS:
        attn_cap, final_cap = _GEMMA_SCALARS[model_type]
        extra.update(query_pre_attn_scalar=_number(cfg, "query_pre_attn_scalar", ModelConfigError, default=256.0),
                     attn_logit_softcap=_nullable(cfg, "attn_logit_softcapping", attn_cap),
                     final_logit_softcap=_nullable(cfg, "final_logit_softcapping", final_cap))
    return ModelConfig(
        **common, head_dim=head_dim, rope=rope, qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=_bool(cfg, "mlp_bias", False) if model_type == "llama" else False,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"), moe_layers=moe,
        moe=_moe(cfg, model_type) if moe else None,
        sliding_window=window if sliding else None, sliding_layers=sliding, **extra)


# transformers' defaults of Gemma's soft-caps where a config does not name them: (attention, final logits);
# an explicit null turns a cap off.
_GEMMA_SCALARS = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}


def _nullable(cfg: Mapping[str, Any], key: str, default: float | None) -> float | None:
    """A positive number field where null means off: absent takes `default`, null gives None."""
    return _number(cfg, key, ModelConfigError) if key in cfg else default


def _gemma3_ropes(cfg: Mapping[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(full layers' rope, sliding layers' rope) as transformers 5's Gemma3TextConfig reads them
    (`convert_rope_params_to_dict`): rope_parameters keyed by layer type, else, in older configs,
    rope_theta (default 1e6) and rope_scaling for the full layers and rope_local_base_freq (default
    1e4, always unscaled) for the sliding ones."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or set(params) - {"full_attention", "sliding_attention"}:
        raise RopeError("gemma3_text rope_parameters must be keyed by layer type ('full_attention', "
                        f"'sliding_attention'), got {_show(params)}")
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise RopeError(f"rope_scaling must be an object, got {_show(scaling)}")
    ropes = []
    for kind, theta_key, default_theta in (("full_attention", "rope_theta", 1e6),
                                           ("sliding_attention", "rope_local_base_freq", 1e4)):
        layer = params.get(kind)
        if layer is not None and not isinstance(layer, Mapping):
            raise RopeError(f"rope_parameters[{kind!r}] must be an object, got {_show(layer)}")
        layer = dict(layer or {"rope_type": "default"})
        if kind == "full_attention" and scaling:
            layer.update(scaling)
        if layer.get("rope_theta") is None:
            layer["rope_theta"] = _number(cfg, theta_key, RopeError, default=default_theta)
        ropes.append(rope_from_hf({"rope_parameters": layer, "partial_rotary_factor": cfg.get("partial_rotary_factor"),
                                   "max_position_embeddings": cfg.get("max_position_embeddings")}))
    return ropes[0], ropes[1]


# transformers' layer_types defaults where a config gives none: layer i slides when (i + 1) % period;
# (default window, the config key of the period, its default)
_LAYER_PATTERNS = {"gemma2": (4096, None, 2), "gemma3_text": (4096, "sliding_window_pattern", 6),
                   "gpt_oss": (128, None, 2)}
_HEAD_DIM = {"gemma2": 256, "gemma3_text": 256, "gpt_oss": 64}  # transformers' defaults (not hidden / heads)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _sliding_layers(cfg: Mapping[str, Any], layers: int, slides) -> tuple[int, ...]:
    """The sliding layers: config's layer_types ("sliding_attention" / "full_attention" per layer), else
    the model type's rule slides(i)."""
    types = cfg.get("layer_types")
    if types is None:
        return tuple(i for i in range(layers) if slides(i))
    if not isinstance(types, list) or len(types) != layers or \
            not all(t in ("sliding_attention", "full_attention") for t in types):
        raise ModelConfigError(f"config field 'layer_types' must list 'sliding_attention' or 'full_attention' for "
                               f"each of the {layers} layers, got {_show(types)}")
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _mla(cfg: Mapping[str, Any], common: dict) -> ModelConfig:
    model_type, layers = common["model_type"], common["num_layers"]
    if model_type == "deepseek_v2":
        layout = "complex"
    else:
        layout = "interleaved" if _bool(cfg, "rope_interleave", True) else "half"
    # transformers builds a MoE block for every layer index >= first_k_dense_replace.
    first_dense = _int(cfg, "first_k_dense_replace", 0 if model_type == "deepseek_v2" else 3, lo=0)
    bias = _bool(cfg, "attention_bias", False)
    mlp_bias = _bool(cfg, "mlp_bias", False) if model_type == "deepseek_v2" else False
    return ModelConfig(
        **common, rope=rope_from_hf(cfg, layout=layout), qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias,
        q_lora_rank=_int(cfg, "q_lora_rank", None) if "q_lora_rank" in cfg else 1536,  # null: no q LoRA
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"), qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim"), moe_layers=tuple(range(first_dense, layers)),
        moe=_moe(cfg, model_type) if first_dense < layers else None)


# --------------------------------------------------------------------------------------------
# Mixture-of-experts layers
# --------------------------------------------------------------------------------------------
# Each family's name for its routed expert count (transformers' attribute_map accepts the others), with
# its config class's default.
_EXPERTS = {"mixtral": (("num_local_experts", "num_experts"), 8),
            "gpt_oss": (("num_local_experts", "num_experts"), 128),
            "qwen2_moe": (("num_experts",), 60), "qwen3_moe": (("num_experts", "num_local_experts"), 128),
            "deepseek_v2": (("n_routed_experts", "num_experts"), 64),
            "deepseek_v3": (("n_routed_experts", "num_local_experts"), 256),
            "kimi_k2": (("n_routed_experts", "num_local_experts"), 256)}


def _num_experts(cfg: Mapping[str, Any], model_type: str, lo: int = 1) -> int:
    """The routed expert count under whichever of the family's names the file uses; two that disagree are refused."""
    names, default = _EXPERTS[model_type]
    given = {name: _int(cfg, name, lo=lo) for name in names if cfg.get(name) is not None}
    if len(set(given.values())) > 1:
        raise ModelConfigError(f"config fields {' and '.join(f'{k!r} ({v})' for k, v in given.items())} both name "
                               "the routed expert count and disagree")
    return next(iter(given.values()), default)


def _moe(cfg: Mapping[str, Any], model_type: str) -> MoEConfig:
    """The MoEConfig of a config.json: each field as the family's transformers config class reads it,
    absent ones with its defaults. DeepSeek's scoring_func and topk_method, which real configs name and
    transformers 5's DeepSeek models hard-code (V2: softmax; V3: sigmoid and noaux_tc), and V2's
    norm_topk_prob, which its transformers model ignores, are read as vLLM reads them; absent, they take
    what transformers hard-codes."""
    experts = _num_experts(cfg, model_type)
    if model_type == "mixtral":  # always renormalised; the experts are intermediate_size wide
        return MoEConfig(experts, _int(cfg, "num_experts_per_tok", 2), _int(cfg, "intermediate_size", 14336),
                         norm_topk_prob=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        qwen2 = model_type == "qwen2_moe"
        shared = _int(cfg, "shared_expert_intermediate_size", 5632) if qwen2 else 0
        return MoEConfig(experts, _int(cfg, "num_experts_per_tok", 4 if qwen2 else 8),
                         _int(cfg, "moe_intermediate_size", 1408 if qwen2 else 768),
                         norm_topk_prob=_bool(cfg, "norm_topk_prob", False), shared_intermediate_size=shared,
                         shared_expert_gate=qwen2, f32_weights=False)
    if model_type == "gpt_oss":
        return MoEConfig(experts, _int(cfg, "num_experts_per_tok", 4), _int(cfg, "intermediate_size", 2880),
                         scoring_func="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
                         swiglu_alpha=_number(cfg, "swiglu_alpha", ModelConfigError, default=1.702),
                         swiglu_limit=_number(cfg, "swiglu_limit", ModelConfigError, default=7.0), f32_weights=False)
    v2 = model_type == "deepseek_v2"
    method = cfg.get("topk_method") or ("greedy" if v2 else "noaux_tc")
    scoring = cfg.get("scoring_func") or ("softmax" if v2 else "sigmoid")
    for key, value, allowed in (("topk_method", method, TOPK_METHODS), ("scoring_func", scoring, SCORING_FUNCS[:2])):
        if value not in allowed:
            raise ModelConfigError(f"config field {key!r} must be one of {', '.join(allowed)}, got {_show(value)}")
    inter = _int(cfg, "moe_intermediate_size", 1407 if v2 else 2048)
    return MoEConfig(
        experts, _int(cfg, "num_experts_per_tok", ... if v2 else 8), inter, scoring_func=scoring, topk_method=method,
        n_group=_int(cfg, "n_group", 1 if v2 else 8), topk_group=_int(cfg, "topk_group", 1 if v2 else 4),
        norm_topk_prob=_bool(cfg, "norm_topk_prob", not v2),
        routed_scaling_factor=_number(cfg, "routed_scaling_factor", ModelConfigError, default=1.0 if v2 else 2.5),
        shared_intermediate_size=_int(cfg, "n_shared_experts", 2 if v2 else 1, lo=0) * inter, router_f32=True)
