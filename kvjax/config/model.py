"""The decoder configuration: one frozen dataclass, its Hugging Face parser, the preset registry.

A `ModelConfig` is the one description of a model that everything else derives from: the KV
layout (`ModelConfig.kv_spec`, the only way from a config to a `kvjax.core.kv_cache_interface.KVSpec`), the
parameter count behind the weight estimates of `kvjax plan` / `kvjax tables`, and the Flax
decoder that `models.build_model` builds.

- `from_hf_config` reads a config.json the way transformers' config classes do (their
  defaults for absent fields) for every model type whose KV cache kvjax can size: the Llama
  family (llama, mistral, qwen2, qwen3, gemma, phi3 and the MoE variants qwen2_moe, qwen3_moe,
  mixtral; GQA from MQA to MHA) and the MLA family (deepseek_v2, deepseek_v3, kimi_k2;
  multi-head latent attention, arXiv 2405.04434).
- What the Flax decoder does not implement (MoE layers, sliding windows, gemma's norm, phi3's
  fused weights, other rope types) is parsed and recorded, never dropped: the KV arithmetic does
  not need it, and `models.layers.check_supported` refuses it by name when a model is built.
  What cannot even be described (a non-positive size, heads not divisible, an unknown dtype or
  model_type) raises `ModelConfigError` here.
- `PRESETS` holds tiny configs for tests and the published configs of SPEC Tables 1-2.
- `RopeConfig` is the rotary embedding's parameters; `models.rope` holds its math.

Nothing here overwrites a value a caller gave: `head_dim` is whatever the config says (Qwen3
has head_dim × heads ≠ hidden_size), and derived values are properties. Plain Python, no JAX,
so `kvjax plan` and `kvjax tables` start instantly.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping
from kvjax.errors import INT32_MAX, KvjaxError, read_json_object

from kvjax.core.kv_cache_interface import KVSpec, SpecError

GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma", "phi3")
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
MODEL_TYPES = GQA_TYPES + MLA_TYPES
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # model dtype → kv dtype name
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # the ones models.rope computes
LAYOUTS = ("half", "interleaved", "complex")


MAX_LAYERS = 2**16  # configs build per-layer tables (MoE, sliding layers); no model has a tenth of this


class ModelConfigError(SpecError):
    """A model configuration kvjax cannot describe; the message names the field and value.

    A SpecError because the KV layout derives from the config: callers that size caches catch one type."""


class RopeError(KvjaxError):
    """RoPE parameters outside what kvjax reproduces; the message names the value."""


# --------------------------------------------------------------------------------------------
# RoPE parameters
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters as transformers' `rope_parameters` name them.

    A rope_type outside ROPE_TYPES or a partial rotary dim is recorded (a checkpoint using it
    can still be sized) and refused where it would be computed: see `unsupported`.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    layout: str = "half"  # how rotated pairs are laid out in a head: see models.rope
    factor: float | None = None  # linear, llama3, yarn
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (default 32)
    beta_slow: float | None = None  # yarn (default 1)
    mscale: float | None = None  # yarn, DeepSeek
    mscale_all_dim: float | None = None  # yarn, DeepSeek
    attention_factor: float | None = None  # yarn: explicit cos/sin scale
    truncate: bool = True  # yarn correction range rounding
    partial_rotary_factor: float = 1.0  # fraction of each head's dims that rotate (Phi-4-mini: 0.75)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise RopeError(f"unknown rope layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        if self.rope_type == "llama3" and None in (self.factor, self.low_freq_factor, self.high_freq_factor,
                                                    self.original_max_position_embeddings):
            raise RopeError("llama3 rope needs factor, low_freq_factor, high_freq_factor and "
                            "original_max_position_embeddings")
        if self.rope_type == "linear" and not self.factor:
            raise RopeError("linear rope needs a factor")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            raise RopeError("yarn rope needs original_max_position_embeddings")

    @property
    def unsupported(self) -> str | None:
        """Why models.rope cannot compute this rotation, or None when it can."""
        if self.rope_type not in ROPE_TYPES:
            return f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        if self.partial_rotary_factor != 1:
            return f"partial_rotary_factor {self.partial_rotary_factor} is not supported (only full rotary dims)"
        return None


def rope_from_hf(cfg: Mapping[str, Any], layout: str = "half") -> RopeConfig:
    """RopeConfig from a config.json dict: `rope_parameters` (transformers 5) or the older
    `rope_scaling` + `rope_theta`. Every key that changes the rotation is kept; each is type-checked
    (RopeError naming the key)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise RopeError(f"rope_parameters / rope_scaling must be an object, got {_show(params)}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise RopeError(f"rope_type must be a string, got {_show(rope_type)}")
    num = lambda key, **kw: _number(params, key, RopeError, **kw)  # noqa: E731
    theta = _number(params, "rope_theta", RopeError, default=_number(cfg, "rope_theta", RopeError, default=10000.0))
    partial = num("partial_rotary_factor", default=_number(cfg, "partial_rotary_factor", RopeError, default=1.0))
    original = None
    if rope_type in ("llama3", "yarn"):
        original = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
        if original is not None and not _is_positive_int(original):
            raise RopeError(f"original_max_position_embeddings must be a positive integer, got {_show(original)}")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise RopeError(f"truncate must be true or false, got {_show(truncate)}")
    return RopeConfig(
        rope_type=rope_type, theta=theta, layout=layout, factor=num("factor"),
        original_max_position_embeddings=original, low_freq_factor=num("low_freq_factor"),
        high_freq_factor=num("high_freq_factor"), beta_fast=num("beta_fast", positive=False),
        beta_slow=num("beta_slow", positive=False), mscale=num("mscale", positive=False),
        mscale_all_dim=num("mscale_all_dim", positive=False), attention_factor=num("attention_factor"),
        truncate=truncate, partial_rotary_factor=partial)


def _number(cfg: Mapping[str, Any], key: str, error: type[Exception], default: Any = None,
            positive: bool = True) -> float | None:
    """A finite number field (> 0 unless positive=False); absent or null takes `default`."""
    value = cfg.get(key)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise error(f"{key} must be a finite{' positive' if positive else ''} number, got {_show(value)}")
    return float(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------------------------
# The config
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder's shapes and features. Frozen: derived values are properties."""

    model_type: str  # one of MODEL_TYPES
    vocab_size: int | None  # V; None: the config.json does not say (enough to size a KV cache, not to build)
    hidden_size: int  # D
    intermediate_size: int | None  # dense MLP width; None as for vocab_size
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
    name: str = ""  # a preset's key or the checkpoint folder's name
    title: str = ""  # how tables and `kvjax plan` print the model ("Llama-3-8B")
    # MoE parameter counts are not derived here (experts, shared experts, routers differ by
    # family): a preset of an MoE model carries its published count.
    published_params: int | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ModelConfigError(f"unsupported model_type {self.model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        ints = ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_position_embeddings"]
        ints += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"] if self.is_mla else ["head_dim"]
        for field in ints:
            value = getattr(self, field)
            if not _is_positive_int(value):
                raise ModelConfigError(f"{field} must be a positive integer, got {value!r}")
            limit = MAX_LAYERS if field == "num_layers" else INT32_MAX
            if value > limit:
                raise ModelConfigError(f"{field} {value:,} is beyond kvjax's limit {limit:,}")
        for field in ("vocab_size", "intermediate_size", "q_lora_rank", "sliding_window", "published_params"):
            value = getattr(self, field)
            if value is not None and not _is_positive_int(value):
                raise ModelConfigError(f"{field} must be a positive integer or None, got {value!r}")
        if not self.is_mla and self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def is_mla(self) -> bool:
        return self.model_type in MLA_TYPES

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
        """The KV layout this model caches (kv_dtype None or "auto": the model dtype, as vLLM's
        kv_cache_dtype="auto")."""
        model_dtype = DTYPES[self.dtype]
        kv_dtype = model_dtype if kv_dtype is None or str(kv_dtype).lower() == "auto" else kv_dtype
        if self.is_mla:
            return KVSpec.mla(self.num_layers, self.num_heads, kv_lora_rank=self.kv_lora_rank,
                              qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                              v_head_dim=self.v_head_dim, kv_dtype=kv_dtype, skip_layers=tuple(skip_layers),
                              model_dtype=model_dtype, name=self.name)
        kind = ("mha" if self.num_kv_heads == self.num_heads else
                "mqa" if self.num_kv_heads == 1 else "gqa")
        return KVSpec(kind, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, kv_dtype=kv_dtype,
                      skip_layers=tuple(skip_layers), model_dtype=model_dtype, name=self.name)

    @property
    def num_params(self) -> int:
        """Parameters of the whole model: `published_params` when set, else counted from the shapes
        of a dense decoder (embedding, attention incl. MLA projections and norms, SwiGLU MLP, the
        layer and final RMSNorms, lm_head unless tied), as transformers' `num_parameters()`."""
        if self.published_params is not None:
            return self.published_params
        who = self.name or self.model_type
        if self.moe_layers:
            raise ModelConfigError(f"{who}: MoE layers {list(self.moe_layers)} are not counted here; "
                                   "give published_params")
        missing = [f for f in ("vocab_size", "intermediate_size") if getattr(self, f) is None]
        if missing:
            raise ModelConfigError(f"{who}: counting parameters needs {' and '.join(missing)}")
        d, n, i = self.hidden_size, self.num_heads, self.intermediate_size
        if self.is_mla:
            qk, rank, rope = self.qk_head_dim, self.kv_lora_rank, self.qk_rope_head_dim
            q = self.q_lora_rank
            attn = (d * n * qk if q is None else  # q_proj, or q_a_proj + q_a_layernorm + q_b_proj
                    d * q + self.qkv_bias * q + q + q * n * qk)
            attn += d * (rank + rope) + self.qkv_bias * (rank + rope) + rank  # kv_a_proj_with_mqa, kv_a_layernorm
            attn += rank * n * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj
            attn += n * self.v_head_dim * d + self.o_bias * d  # o_proj
        else:
            h, qkv = self.head_dim, (n + 2 * self.num_kv_heads) * self.head_dim
            attn = d * qkv + self.qkv_bias * qkv  # q_proj, k_proj, v_proj
            attn += n * h * d + self.o_bias * d + self.qk_norm * 2 * h  # o_proj, q_norm and k_norm
        mlp = 3 * d * i + self.mlp_bias * (2 * i + d)
        layer = attn + mlp + 2 * d  # + input_layernorm, post_attention_layernorm
        embed = self.vocab_size * d
        return embed + self.num_layers * layer + d + (0 if self.tie_word_embeddings else embed)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any],
                       dtype: str | None = None) -> "ModelConfig":
        return from_hf_config(path_or_dict, dtype=dtype)


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             max_position_embeddings=256)
_TINY_MLA = dict(_TINY, model_type="deepseek_v3", num_kv_heads=4, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope=RopeConfig(layout="interleaved"))
# Llama 3.1's rope scaling and 128K context: Llama 3 has the same shapes and parameter counts at
# 8K, and SPEC group C plans Llama-3-70B at 128K.
_LLAMA31_ROPE = RopeConfig("llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

# The published configs are their config.json files' values (for random-weight benchmarks and the
# SPEC tables; weights are not shipped), all bfloat16 (Llama-2's checkpoint is float16: same width).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("llama", num_kv_heads=2, head_dim=16, name="tiny", **_TINY),
    "tiny-mha": ModelConfig("llama", num_kv_heads=4, head_dim=16, name="tiny-mha", **_TINY),
    "tiny-mqa": ModelConfig("llama", num_kv_heads=1, head_dim=16, name="tiny-mqa", **_TINY),
    "tiny-mla": ModelConfig(name="tiny-mla", **_TINY_MLA),
    "llama-2-7b": ModelConfig(
        "llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5, dtype="bfloat16",
        name="llama-2-7b", title="Llama-2-7B"),
    "llama-3-8b": ModelConfig(
        "llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, dtype="bfloat16",
        rope=_LLAMA31_ROPE, name="llama-3-8b", title="Llama-3-8B"),
    "llama-3-70b": ModelConfig(
        "llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, dtype="bfloat16",
        rope=_LLAMA31_ROPE, name="llama-3-70b", title="Llama-3-70B"),
    # SmolLM2-135M's shapes (the real weights: `--model smollm2-135m`, a GGUF file; models.hub).
    "smollm2-135m": ModelConfig(
        "llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope=RopeConfig(theta=100000.0), dtype="bfloat16", name="smollm2-135m", title="SmolLM2-135M"),
    # 671B parameters in the main model (the HF checkpoint adds a 14B multi-token-prediction module).
    "deepseek-v3": ModelConfig(
        "deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61, num_heads=128,
        num_kv_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6, dtype="bfloat16",
        rope=RopeConfig("yarn", theta=10000.0, layout="interleaved", factor=40.0,
                        original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                        mscale_all_dim=1.0),
        moe_layers=tuple(range(3, 61)), name="deepseek-v3", title="DeepSeek-V3", published_params=671_000_000_000),
}


def preset(name: str) -> ModelConfig:
    """A registered config by name (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[key]


# --------------------------------------------------------------------------------------------
# Hugging Face config.json
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


def _int(cfg: Mapping[str, Any], key: str, default: Any = ..., lo: int = 1, hi: int = INT32_MAX) -> Any:
    """An integer field in [lo, hi] by its config.json name; absent or null takes `default`."""
    value = cfg.get(key)
    if value is None:
        if default is ...:
            raise ModelConfigError(f"config is missing the field {key!r} (model_type {cfg.get('model_type')!r})")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        rule = "a positive integer" if lo == 1 else f"an integer ≥ {lo}"
        raise ModelConfigError(f"config field {key!r} must be {rule} (at most {hi:,}), got {_show(value)}")
    return value


def _int_list(cfg: Mapping[str, Any], key: str) -> list[int]:
    value = cfg.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ModelConfigError(f"config field {key!r} must be a list of integers, got {_show(value)}")
    return value


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any], dtype: str | None = None) -> ModelConfig:
    """ModelConfig from a Hugging Face config (a folder, a config.json, or its dict).

    dtype overrides the checkpoint's `dtype` / `torch_dtype` (e.g. "float32" for tests).
    Absent fields take transformers' defaults for that model_type; num_key_value_heads defaults
    to num_attention_heads, and an explicit head_dim wins over hidden_size // num_attention_heads.
    """
    cfg = load_hf_config(path_or_dict)
    model_type = cfg.get("model_type")
    if not model_type:
        raise ModelConfigError("config is missing the field 'model_type'")
    if model_type not in MODEL_TYPES:
        raise ModelConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    heads = _int(cfg, "num_attention_heads")
    name = model_type
    if not isinstance(path_or_dict, Mapping):  # the checkpoint folder's name
        path = os.path.abspath(os.fspath(path_or_dict))
        name = os.path.basename(path if os.path.isdir(path) else os.path.dirname(path))
    gemma = model_type == "gemma"
    if not isinstance(cfg.get("hidden_act", ""), str):
        raise ModelConfigError(f"config field 'hidden_act' must be a string, got {_show(cfg['hidden_act'])}")
    common = dict(
        model_type=model_type, vocab_size=_int(cfg, "vocab_size", None), hidden_size=_int(cfg, "hidden_size"),
        intermediate_size=_int(cfg, "intermediate_size", None),
        num_layers=_int(cfg, "num_hidden_layers", hi=MAX_LAYERS),  # per-layer tables are built from it
        num_heads=heads, num_kv_heads=_int(cfg, "num_key_value_heads", heads),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096 if model_type == "deepseek_v3" else 2048),
        rms_norm_eps=_number(cfg, "rms_norm_eps", ModelConfigError, default=1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),  # Gemma ties by default
        hidden_act=cfg.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu"),
        dtype=dtype or _dtype(cfg),
        name=name)
    try:
        if model_type in MLA_TYPES:
            return _mla(cfg, common)
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
    head_dim = _int(cfg, "head_dim", None)
    if head_dim is None:
        hidden, heads = common["hidden_size"], common["num_heads"]
        if hidden % heads:
            raise ModelConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                                   "the config needs an explicit head_dim")
        head_dim = hidden // heads
    bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = (True, False) if model_type in ("qwen2", "qwen2_moe") else (bias, bias)
    window, sliding = None, ()
    if model_type in ("mistral", "mixtral", "phi3") and cfg.get("sliding_window") is not None:
        window, sliding = _int(cfg, "sliding_window"), tuple(range(layers))
    elif model_type.startswith(("qwen2", "qwen3")) and cfg.get("use_sliding_window"):
        window = _int(cfg, "sliding_window", 4096)
        first_sliding = _int(cfg, "max_window_layers", 28, lo=0)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first_sliding
                                           else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ModelConfigError(f"config field 'layer_types' must be a list of strings, got {_show(types)}")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if model_type == "mixtral":
        moe = tuple(range(layers))
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        # transformers: a sparse block where the layer is not in mlp_only_layers and (i + 1) % step == 0.
        experts = _int(cfg, "num_experts", 60 if model_type == "qwen2_moe" else 128, lo=0)
        step, dense = _int(cfg, "decoder_sparse_step", 1), set(_int_list(cfg, "mlp_only_layers"))
        moe = tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0)
    else:
        moe = ()
    return ModelConfig(
        **common, head_dim=head_dim, rope=rope_from_hf(cfg, layout="half"), qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type in ("qwen3", "qwen3_moe"), moe_layers=moe,
        sliding_window=window if sliding else None, sliding_layers=sliding)


def _mla(cfg: Mapping[str, Any], common: dict) -> ModelConfig:
    model_type, layers = common["model_type"], common["num_layers"]
    if model_type == "deepseek_v2":
        layout = "complex"
    else:
        layout = "interleaved" if cfg.get("rope_interleave", True) else "half"
    # transformers builds a MoE block for every layer index >= first_k_dense_replace.
    first_dense = _int(cfg, "first_k_dense_replace", 0 if model_type == "deepseek_v2" else 3, lo=0)
    bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False)) if model_type == "deepseek_v2" else False
    return ModelConfig(
        **common, rope=rope_from_hf(cfg, layout=layout), qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias,
        q_lora_rank=_int(cfg, "q_lora_rank", None) if "q_lora_rank" in cfg else 1536,  # null: no q LoRA
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"), qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim"), moe_layers=tuple(range(first_dense, layers)))
