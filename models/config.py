"""Decoder model configuration: a frozen dataclass, named presets, and Hugging Face config.json.

One `ModelConfig` describes both supported families:

- Llama family (Llama, Mistral, Qwen2, Qwen3): GQA attention with `num_kv_heads` from 1 (MQA)
  to `num_heads` (MHA), optional q/k/v/o biases (Qwen2: q/k/v only), optional per-head q/k
  RMSNorm (Qwen3), SwiGLU MLP.
- DeepSeek-V2/V3: multi-head latent attention (MLA, arXiv 2405.04434) with optional
  `q_lora_rank`, and dense SwiGLU MLPs. Layers whose MLP is a mixture of experts are listed
  in `moe_layers`; the models refuse them by index (see models.build_model).

Nothing here overwrites a value a caller gave: `head_dim` is whatever the config says
(Qwen3 has head_dim × heads ≠ hidden_size), and derived values are properties.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from kvjax.spec import KVSpec, load_hf_config
from models import rope as rope_lib
from models.rope import RopeConfig

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # model dtype → kv dtype name


class ModelConfigError(ValueError):
    """A model configuration kvjax cannot build; the message names the field and value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str  # one of LLAMA_TYPES + DEEPSEEK_TYPES
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K (MLA: as the checkpoint says; unused, MLA caches one latent)
    head_dim: int | None = None  # H for GQA; None for MLA (see qk_*_head_dim)
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # GQA: q/k/v projections; MLA: q_a_proj and kv_a_proj_with_mqa
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # MLA
    q_lora_rank: int | None = None  # None: a single q_proj
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # Features kvjax's models refuse, recorded so the refusal can name them.
    moe_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    dtype: str = "float32"  # params and activations
    name: str = ""

    def __post_init__(self):
        if self.model_type not in LLAMA_TYPES + DEEPSEEK_TYPES:
            raise ModelConfigError(f"unsupported model_type {self.model_type!r}; supported: "
                                   f"{', '.join(LLAMA_TYPES + DEEPSEEK_TYPES)}")
        ints = ["vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "max_position_embeddings"]
        ints += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"] if self.is_mla else ["head_dim"]
        for field in ints:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{field} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ModelConfigError(f"q_lora_rank must be a positive integer or None, got {self.q_lora_rank!r}")
        if not self.is_mla and self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.hidden_act != "silu":
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} is not supported (only silu / SwiGLU)")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def is_mla(self) -> bool:
        return self.model_type in DEEPSEEK_TYPES

    @property
    def qk_head_dim(self) -> int:
        """Query/key dim per head that the softmax scale uses."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def kv_spec(self, kv_dtype: str | None = None, skip_layers: tuple[int, ...] = ()) -> KVSpec:
        """The KV layout this model caches (kv_dtype defaults to the model dtype)."""
        model_dtype = DTYPES[self.dtype]
        kv_dtype = kv_dtype or model_dtype
        if self.is_mla:
            return KVSpec.mla(self.num_layers, self.num_heads, kv_lora_rank=self.kv_lora_rank,
                              qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                              v_head_dim=self.v_head_dim, kv_dtype=kv_dtype, skip_layers=tuple(skip_layers),
                              model_dtype=model_dtype, name=self.name)
        kind = ("mha" if self.num_kv_heads == self.num_heads else
                "mqa" if self.num_kv_heads == 1 else "gqa")
        return KVSpec(kind, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, kv_dtype=kv_dtype,
                      skip_layers=tuple(skip_layers), model_dtype=model_dtype, name=self.name)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any],
                       dtype: str | None = None) -> "ModelConfig":
        return from_hf_config(path_or_dict, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             max_position_embeddings=256)
_TINY_MLA = dict(_TINY, model_type="deepseek_v3", num_kv_heads=4, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope=RopeConfig(layout="interleaved"))

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("llama", num_kv_heads=2, head_dim=16, name="tiny", **_TINY),
    "tiny-mha": ModelConfig("llama", num_kv_heads=4, head_dim=16, name="tiny-mha", **_TINY),
    "tiny-mqa": ModelConfig("llama", num_kv_heads=1, head_dim=16, name="tiny-mqa", **_TINY),
    "tiny-mla": ModelConfig(name="tiny-mla", **_TINY_MLA),
    # Llama-3-8B's published shapes (for random-weight benchmarks; weights are not shipped).
    "llama-3-8b": ModelConfig(
        "llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, dtype="bfloat16",
        rope=RopeConfig("llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192), name="llama-3-8b"),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


# --------------------------------------------------------------------------------------------
# Hugging Face config.json
# --------------------------------------------------------------------------------------------
def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any], dtype: str | None = None) -> ModelConfig:
    """ModelConfig from a Hugging Face config (a folder, a config.json, or its dict).

    dtype overrides the checkpoint's `dtype` / `torch_dtype` (e.g. "float32" for tests).
    Defaults for absent fields are transformers' own for that model_type.
    """
    cfg = load_hf_config(path_or_dict)
    model_type = cfg.get("model_type")
    if model_type not in LLAMA_TYPES + DEEPSEEK_TYPES:
        raise ModelConfigError(f"unsupported model_type {model_type!r}; supported: "
                               f"{', '.join(LLAMA_TYPES + DEEPSEEK_TYPES)}")

    def need(key):
        if cfg.get(key) is None:
            raise ModelConfigError(f"config is missing the field {key!r} (model_type {model_type!r})")
        return cfg[key]

    heads = need("num_attention_heads")
    layers = need("num_hidden_layers")
    checkpoint_dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").replace("torch.", "")
    common = dict(
        model_type=model_type, vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"), num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096 if model_type == "deepseek_v3" else 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=cfg.get("hidden_act", "silu"), dtype=dtype or checkpoint_dtype,
        name=os.path.basename(os.path.normpath(os.fspath(path_or_dict))) if not isinstance(path_or_dict, Mapping)
        else model_type)
    try:
        if model_type in DEEPSEEK_TYPES:
            return _deepseek(cfg, common)
        return _llama(cfg, common)
    except rope_lib.RopeError as e:
        raise ModelConfigError(f"{model_type} config: {e}") from None


def _llama(cfg: dict, common: dict) -> ModelConfig:
    model_type, layers = common["model_type"], common["num_layers"]
    bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = (True, False) if model_type == "qwen2" else (bias, bias)
    window, sliding = None, ()
    if model_type == "mistral" and cfg.get("sliding_window") is not None:
        window, sliding = cfg["sliding_window"], tuple(range(layers))
    elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window", 4096)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28)
                                           else "full_attention" for i in range(layers)]
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return ModelConfig(
        **common, head_dim=cfg.get("head_dim") or common["hidden_size"] // common["num_heads"],
        rope=rope_lib.from_hf(cfg, layout="half"), qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3", sliding_window=window if sliding else None, sliding_layers=sliding)


def _deepseek(cfg: dict, common: dict) -> ModelConfig:
    model_type, layers = common["model_type"], common["num_layers"]
    if model_type == "deepseek_v2":
        layout = "complex"
    else:
        layout = "interleaved" if cfg.get("rope_interleave", True) else "half"
    # transformers builds a MoE block for every layer index >= first_k_dense_replace.
    first_dense = cfg.get("first_k_dense_replace", 3 if model_type == "deepseek_v3" else 0)
    bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False)) if model_type == "deepseek_v2" else False
    return ModelConfig(
        **common, rope=rope_lib.from_hf(cfg, layout=layout), qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias,
        q_lora_rank=cfg.get("q_lora_rank", 1536), kv_lora_rank=cfg.get("kv_lora_rank", 512),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim", 128), qk_rope_head_dim=cfg.get("qk_rope_head_dim", 64),
        v_head_dim=cfg.get("v_head_dim", 128), moe_layers=tuple(range(first_dense, layers)))
