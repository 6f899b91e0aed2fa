"""The decoder configuration: `ModelConfig`, one frozen dataclass, and `RopeConfig`, its rotary parameters.

A `ModelConfig` is the one description of a model that everything else derives from: the KV
layout (`ModelConfig.kv_spec`, the only way from a config to a `kvjax.core.kv_cache_interface.KVSpec`), the
parameter count behind the weight estimates of `kvjax plan` / `kvjax tables`, and the Flax
decoder that `models.build_model` builds. It is built from a Hugging Face config.json by
kvjax.config.hf, or taken by name from kvjax.config.presets.

- What the Flax decoder does not implement (Gemma 1, phi3's fused weights, other rope types)
  is recorded, never dropped: the KV arithmetic does not need it, and
  `models.layers.check_supported` refuses it by name when a model is built. What cannot
  even be described (a non-positive size, heads not divisible, an unknown dtype or model_type)
  raises `ModelConfigError` here.
- `RopeConfig` is the rotary embedding's parameters; `models.rope` holds its math.
- `MoEConfig` is the routing and expert shapes of the mixture-of-experts layers (`moe_layers`);
  `models.moe` holds their math.
- MODEL_TYPES (the GQA and MLA families), DTYPES, ROPE_TYPES, LAYOUTS, SCORING_FUNCS, TOPK_METHODS
  and EXPERT_ACTIVATIONS are the values these dataclasses accept.

Nothing here overwrites a value a caller gave: `head_dim` is whatever the config says (Qwen3
has head_dim × heads ≠ hidden_size), and derived values are properties. Plain Python, no JAX,
so `kvjax plan` and `kvjax tables` start instantly.
"""
from __future__ import annotations

import dataclasses
import math

from kvjax.config.mamba import MambaConfig, check_layer_types, hybrid_num_params
from kvjax.core.kv_cache_interface import KVSpec, SpecError, attention_kind
from kvjax.errors import KvjaxError
from kvjax.utils.checks import INT32_MAX, check_int, is_int

GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma", "phi3", "gemma2",
             "gemma3_text", "gpt_oss")
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
# Attention + state-space hybrids (kvjax.config.mamba): GQA attention layers beside Mamba layers
HYBRID_TYPES = ("bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "jamba")
MODEL_TYPES = GQA_TYPES + MLA_TYPES + HYBRID_TYPES
DTYPES = ("float32", "bfloat16", "float16")  # model dtypes; each is also a kv dtype alias (kvjax.quant.kv_formats)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # the ones models.rope computes
LAYOUTS = ("half", "interleaved", "complex")
# How router logits become the scores top-k chooses from (MoEConfig.scoring_func): softmax over all
# experts (Mixtral, Qwen-MoE, DeepSeek-V2), an independent sigmoid per expert (DeepSeek-V3), or
# top-k of the raw logits then a softmax over those k (gpt-oss).
SCORING_FUNCS = ("softmax", "sigmoid", "topk_softmax")
# How the k experts are chosen (DeepSeek's `topk_method`): plain top-k; top-k within the topk_group
# groups of highest max score (DeepSeek-V2); the same with groups ranked by the sum of their top-2
# scores after adding e_score_correction_bias, which steers the choice but not the weights (DeepSeek-V3).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# An expert's gated activation: silu(gate) · up, or gpt-oss's clamped (up + 1) · gate · σ(α·gate)
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


MAX_LAYERS = 2**16  # configs build per-layer tables (MoE, sliding layers); no model has a tenth of this
# The smallest positive normal float32: a smaller rms_norm_eps is 0 (or flushed to 0) where the norm
# runs, and an all-zero hidden state then divides 0 by 0.
MIN_EPS = 2.0**-126
F32_MAX = (2 - 2.0**-23) * 2.0**127  # the largest finite float32


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
        if not isinstance(self.rope_type, str):
            raise RopeError(f"rope_type must be a string, got {self.rope_type!r}")
        self._check_domains()
        if self.rope_type == "llama3" and None in (self.factor, self.low_freq_factor, self.high_freq_factor,
                                                    self.original_max_position_embeddings):
            raise RopeError("llama3 rope needs factor, low_freq_factor, high_freq_factor and "
                            "original_max_position_embeddings")
        if self.rope_type == "linear" and not self.factor:
            raise RopeError("linear rope needs a factor")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            raise RopeError("yarn rope needs original_max_position_embeddings")

    def _check_domains(self) -> None:
        """Each parameter within the domain where models.rope's formulas are defined and finite in
        float32, named as config.json names it (RopeError otherwise)."""
        def number(name, value, ok, rule, why, optional=True):
            if value is None and optional:
                return
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and ok(value)):
                raise RopeError(f"{name} must be {rule}, got {value!r}: {why}")

        number("rope_theta", self.theta, lambda v: v > 1, "a finite number > 1", "the rotary frequencies θ^(-2i/d) "
               "must fall from 1 as i grows (a tiny θ overflows them to inf in float32, and attention to NaN; yarn "
               "divides by log θ)", optional=False)
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            number(name, getattr(self, name), lambda v: v >= MIN_EPS, "a finite number >= 2^-126",
                   "frequencies and wavelengths are divided by it, past float32 below that")
        number("attention_factor", self.attention_factor, lambda v: MIN_EPS <= v <= F32_MAX,
               "a finite float32 number > 0", "it scales cos and sin")
        if self.rope_type == "llama3" and None not in (self.low_freq_factor, self.high_freq_factor) and \
                self.high_freq_factor <= self.low_freq_factor:
            raise RopeError(f"high_freq_factor ({self.high_freq_factor}) must be greater than low_freq_factor "
                            f"({self.low_freq_factor}): llama3 rope divides by their difference")
        for name in ("beta_fast", "beta_slow"):  # transformers: `beta_fast or 32`, so 0 is the default
            number(name, getattr(self, name), lambda v: v >= 0, "a finite number >= 0",
                   "yarn takes the log of original_max_position_embeddings / (2π·beta); 0 or null is the default")
        for name in ("mscale", "mscale_all_dim"):
            number(name, getattr(self, name), lambda v: v >= 0, "a finite number >= 0",
                   "yarn divides by 0.1·mscale·ln(factor) + 1")
        number("partial_rotary_factor", self.partial_rotary_factor, lambda v: 0 < v <= 1, "in (0, 1]",
               "it is the fraction of each head's dims that rotate", optional=False)
        original = self.original_max_position_embeddings
        if original is not None:
            check_int(original, "original_max_position_embeddings", 1, INT32_MAX, RopeError)
        if not isinstance(self.truncate, bool):
            raise RopeError(f"truncate must be true or false, got {self.truncate!r}")

    @property
    def unsupported(self) -> str | None:
        """Why models.rope cannot compute this rotation, or None when it can."""
        if self.rope_type not in ROPE_TYPES:
            return f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        if self.partial_rotary_factor != 1:
            return f"partial_rotary_factor {self.partial_rotary_factor} is not supported (only full rotary dims)"
        return None


# --------------------------------------------------------------------------------------------
# Mixture-of-experts layers
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The routing and the experts of a model's MoE layers, as config.json names them.

    Every token's router logits (one per routed expert) become scores (`scoring_func`); `top_k`
    experts are chosen (`topk_method`, over `n_group` groups of which `topk_group` may be used); the
    chosen scores are renormalised to sum to 1 (`norm_topk_prob`) and multiplied by
    `routed_scaling_factor`; the layer returns Σ weight · expert(x) over the k, plus the shared
    experts every token passes through. kvjax.config.hf fills it per family with transformers'
    defaults:

        family        scores        choice                          weights                  shared
        Mixtral       softmax       greedy                          renormalised             -
        Qwen2-MoE     softmax       greedy                          norm_topk_prob           1 × σ(gate(x))
        Qwen3-MoE     softmax       greedy                          norm_topk_prob           -
        DeepSeek-V2   softmax       greedy / group_limited_greedy   × routed_scaling_factor  n_shared_experts
        DeepSeek-V3   sigmoid       noaux_tc (groups, bias)         norm, × scaling factor   n_shared_experts
        gpt-oss       topk_softmax  greedy on the logits            softmax over the k       -

    The two dtype flags say where transformers runs the router in float32 when the model is bf16:
    `router_f32` keeps the router weight in float32 and takes the logits from float32 inputs
    (DeepSeek: `_keep_in_fp32_modules_strict`); `f32_weights` multiplies the expert outputs by
    float32 weights (Mixtral, DeepSeek) instead of weights cast back to the model dtype (Qwen, gpt-oss).
    """

    num_experts: int  # E, routed experts
    top_k: int  # k, experts per token
    intermediate_size: int  # I, each routed expert's MLP width
    scoring_func: str = "softmax"  # one of SCORING_FUNCS
    topk_method: str = "greedy"  # one of TOPK_METHODS
    n_group: int = 1  # expert groups (E / n_group experts each)
    topk_group: int = 1  # groups a token may choose from
    norm_topk_prob: bool = False  # renormalise the k chosen scores to sum to 1
    routed_scaling_factor: float = 1.0  # the k weights × this (after renormalising)
    shared_intermediate_size: int = 0  # the shared expert MLP's width (0: none); DeepSeek: n_shared_experts × I
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared output × sigmoid(shared_expert_gate(x))
    router_bias: bool = False  # gpt-oss
    expert_bias: bool = False  # gpt-oss: biases on each expert's gate/up and down projections
    activation: str = "swiglu"  # one of EXPERT_ACTIVATIONS
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate · sigmoid(alpha · gate)
    swiglu_limit: float = 7.0  # clamped_swiglu: gate ≤ limit, |up| ≤ limit
    router_f32: bool = False
    f32_weights: bool = True
    # How experts/gate_up_proj's 2I columns are laid out, not what the model computes: that many blocks
    # [gate_b | up_b] of 2I / gate_up_blocks columns. 1 is transformers' (all gate columns, then all up);
    # tensor parallelism runs with one block per rank (kvjax.worker.sharding.tp_model_config), so that
    # each rank's contiguous slice of the columns holds its share of both halves.
    gate_up_blocks: int = 1

    def __post_init__(self):
        for name, lo in (("num_experts", 1), ("top_k", 1), ("intermediate_size", 1), ("n_group", 1),
                         ("topk_group", 1), ("shared_intermediate_size", 0), ("gate_up_blocks", 1)):
            check_int(getattr(self, name), f"MoE {name}", lo, INT32_MAX, ModelConfigError)
        for name, allowed in (("scoring_func", SCORING_FUNCS), ("topk_method", TOPK_METHODS),
                              ("activation", EXPERT_ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ModelConfigError(f"MoE {name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("norm_topk_prob", "shared_expert_gate", "router_bias", "expert_bias", "router_f32",
                     "f32_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ModelConfigError(f"MoE {name} must be true or false, got {getattr(self, name)!r}")
        for name in ("routed_scaling_factor", "swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and MIN_EPS <= value <= F32_MAX):
                raise ModelConfigError(f"MoE {name} must be a finite float32 number > 0, got {value!r}")
        e, k, groups = self.num_experts, self.top_k, self.n_group
        if k > e:
            raise ModelConfigError(f"MoE top_k {k} (num_experts_per_tok) exceeds the {e} routed experts")
        if e % groups:
            raise ModelConfigError(f"MoE n_group {groups} does not divide the {e} routed experts")
        if self.topk_group > groups:
            raise ModelConfigError(f"MoE topk_group {self.topk_group} exceeds n_group {groups}")
        if self.topk_method != "greedy" and k > self.topk_group * (e // groups):
            raise ModelConfigError(f"MoE top_k {k} exceeds the {self.topk_group * (e // groups)} experts in "
                                   f"topk_group {self.topk_group} of {groups} groups of {e // groups}")
        if self.topk_method == "noaux_tc" and e // groups < 2:
            raise ModelConfigError(f"MoE noaux_tc ranks groups by their top-2 scores: groups of {e // groups} "
                                   f"expert ({e} experts, n_group {groups}) cannot be ranked")
        if self.intermediate_size % self.gate_up_blocks:
            raise ModelConfigError(f"MoE gate_up_blocks {self.gate_up_blocks} does not divide the experts' "
                                   f"intermediate_size {self.intermediate_size}")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ModelConfigError("MoE shared_expert_gate needs a shared expert (shared_intermediate_size > 0)")
        if self.scoring_func == "topk_softmax" and self.topk_method != "greedy":
            raise ModelConfigError(f"MoE topk_softmax scoring chooses greedily from the logits, not by "
                                   f"{self.topk_method!r}")

    @property
    def grouped(self) -> bool:
        """Whether the choice is limited to topk_group of n_group groups (else plain top-k)."""
        return self.topk_method != "greedy" and self.topk_group < self.n_group

    def layer_params(self, hidden_size: int, mlp_bias: bool = False) -> int:
        """Parameters of one MoE layer as transformers counts them: router (+ bias), every expert's
        gate/up/down (+ biases), the shared expert (its Linears take the model's mlp_bias) and its gate.
        DeepSeek-V3's e_score_correction_bias is a buffer, not a parameter."""
        d, e, i, s = hidden_size, self.num_experts, self.intermediate_size, self.shared_intermediate_size
        router = e * d + self.router_bias * e
        experts = e * 3 * d * i + self.expert_bias * e * (2 * i + d)
        shared = (3 * d * s + mlp_bias * (2 * s + d)) if s else 0
        return router + experts + shared + self.shared_expert_gate * d


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
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before RoPE
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # Gemma 2 / 3 (None: the Llama behaviour)
    query_pre_attn_scalar: float | None = None  # softmax scale query_pre_attn_scalar^-0.5 (None: head_dim^-0.5)
    attn_logit_softcap: float | None = None  # scaled scores → c·tanh(scores / c) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # logits → c·tanh(logits / c)
    rope_local: RopeConfig | None = None  # the sliding layers' rotary parameters (Gemma 3); None: `rope`
    # MLA
    q_lora_rank: int | None = None  # None: a single q_proj
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is a mixture of experts (models.moe); others dense
    moe: MoEConfig | None = None  # their routing and experts: set exactly when moe_layers is
    sliding_window: int | None = None  # W of the sliding layers: a query at q sees keys q - W < k <= q
    sliding_layers: tuple[int, ...] = ()
    dtype: str = "float32"  # params and activations
    name: str = ""  # a preset's key or the checkpoint folder's name
    title: str = ""  # how tables and `kvjax plan` print the model ("Llama-3-8B")
    published_params: int | None = None  # a model card's round count, preferred to the counted one (num_params)
    # Hybrids (kvjax.config.mamba): each layer's mixers, empty for attention only; the Mamba mixers' shapes
    layer_types: tuple[str, ...] = ()
    mamba: MambaConfig | None = None
    use_rope: bool = True  # False: attention without positions (NoPE: Granite-4.0-H, Nemotron-H)
    # Granite-4.0-H's scalings (embedding, attention: the softmax scale, residual, logits divisor); () none
    granite_multipliers: tuple[float, ...] = ()

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ModelConfigError(f"unsupported model_type {self.model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        ints = ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_position_embeddings"]
        ints += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"] if self.is_mla else ["head_dim"]
        for field in ints:
            value = getattr(self, field)
            check_int(value, field, 1, None, ModelConfigError)
            limit = MAX_LAYERS if field == "num_layers" else INT32_MAX
            if value > limit:
                raise ModelConfigError(f"{field} {value:,} is beyond kvjax's limit {limit:,}")
        for field in ("vocab_size", "intermediate_size", "q_lora_rank", "sliding_window", "published_params"):
            value = getattr(self, field)
            if value is not None and not (is_int(value) and value > 0):
                raise ModelConfigError(f"{field} must be a positive integer or None, got {value!r}")
        for field in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_word_embeddings"):
            if not isinstance(getattr(self, field), bool):
                raise ModelConfigError(f"{field} must be true or false, got {getattr(self, field)!r}")
        eps = self.rms_norm_eps
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and MIN_EPS <= eps <= 1):
            raise ModelConfigError(f"rms_norm_eps must be a number in [2^-126, 1] (below float32's smallest normal "
                                   f"number it is 0 where the norm runs, and a zero hidden state is 0 / 0), "
                                   f"got {eps!r}")
        for field in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ModelConfigError(f"{field} must be a finite positive number or None, got {value!r}")
        if not self.is_mla and self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        self._check_moe()
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        if self.layer_types:
            check_layer_types(self.layer_types, self.num_layers)
        if (self.mamba is not None) != any(t.endswith("mamba") for t in self.layer_types):
            raise ModelConfigError("a MambaConfig (mamba) goes with Mamba layers in layer_types, and only with them")
        if self.mamba is not None and not isinstance(self.mamba, MambaConfig):
            raise ModelConfigError(f"mamba must be a MambaConfig or None, got {type(self.mamba).__name__}")
        if self.layer_types and not self.attention_layers:
            raise ModelConfigError("a hybrid without attention layers is attention-free, which kvjax does not size")

    def _check_moe(self) -> None:
        layers = self.moe_layers
        if not isinstance(layers, tuple) or not all(is_int(i) and 0 <= i < self.num_layers for i in layers) \
                or list(layers) != sorted(set(layers)):
            raise ModelConfigError(f"moe_layers must be increasing layer indices in [0, {self.num_layers}), "
                                   f"got {layers!r}")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ModelConfigError(f"moe must be a MoEConfig or None, got {type(self.moe).__name__}")
        if layers and self.moe is None:
            raise ModelConfigError(f"moe_layers {list(layers)} need a MoEConfig (moe) describing their experts")
        if self.moe is not None and not layers:
            raise ModelConfigError("a MoEConfig (moe) needs moe_layers, the layers it describes")

    @property
    def is_mla(self) -> bool:
        return self.model_type in MLA_TYPES

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with attention (every layer but a hybrid's Mamba and MLP-only ones)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t.startswith("attention"))

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """The layers with a Mamba mixer (kvjax.config.mamba)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t.endswith("mamba"))

    @property
    def qk_head_dim(self) -> int:
        """Query/key dim per head that the softmax scale uses."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), as kvjax.core.kv_cache_groups groups them."""
        sliding = set(self.sliding_layers)
        return tuple(self.sliding_window if i in sliding else None for i in range(self.num_layers))

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotary parameters of one layer: `rope_local` on a sliding layer when the model has one
        (Gemma 3's rope_local_base_freq), else `rope`."""
        if self.rope_local is not None and layer in self.sliding_layers:
            return self.rope_local
        return self.rope

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 2 / 3: RMSNorms after attention and around the MLP besides the two pre-norms."""
        return self.model_type in ("gemma2", "gemma3_text")

    def kv_spec(self, kv_dtype: str | None = None, skip_layers: tuple[int, ...] = ()) -> KVSpec:
        """The KV layout this model caches in kv_dtype (a format's name; None: the model dtype).
        vLLM's kv_cache_dtype "auto" is resolved before, once (kvjax.config.engine.resolve_kv_dtype)."""
        model_dtype = self.dtype  # KVSpec stores it as its kv dtype name (float32 → fp32)
        kv_dtype = model_dtype if kv_dtype is None else kv_dtype
        if self.is_mla:
            return KVSpec.mla(self.num_layers, self.num_heads, kv_lora_rank=self.kv_lora_rank,
                              qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                              v_head_dim=self.v_head_dim, kv_dtype=kv_dtype, skip_layers=tuple(skip_layers),
                              model_dtype=model_dtype, name=self.name)
        if self.mamba is not None and skip_layers:  # vLLM pads every page to one size: a bf16 skip layer has none
            raise ModelConfigError(f"{self.name}: kv_cache_dtype_skip_layers beside Mamba layers is not supported")
        # A hybrid's KV is its attention layers' (its Mamba layers keep a state instead: state_spec)
        return KVSpec(attention_kind(self.num_heads, self.num_kv_heads), len(self.attention_layers), self.num_heads,
                      self.num_kv_heads, self.head_dim, kv_dtype=kv_dtype, skip_layers=tuple(skip_layers),
                      model_dtype=model_dtype, name=self.name)

    @property
    def num_params(self) -> int:
        """Parameters of the whole model, as transformers' `num_parameters()` counts them:
        `published_params` when set, else counted from the shapes: embedding, attention (MLA
        projections and norms; gpt-oss's per-head sinks), the gated MLP of a dense layer or the MoE
        block of a MoE layer (MoEConfig.layer_params: every expert resident), the layer RMSNorms
        (four a layer in Gemma 2 / 3) and the final one, lm_head unless tied."""
        if self.published_params is not None:
            return self.published_params
        who = self.name or self.model_type
        dense_layers = self.num_layers - len(self.moe_layers)
        missing = [f for f in ("vocab_size", "intermediate_size") if getattr(self, f) is None
                   and (f == "vocab_size" or dense_layers)]
        if missing:
            raise ModelConfigError(f"{who}: counting parameters needs {' and '.join(missing)}")
        if self.mamba is not None:
            return hybrid_num_params(self)
        d, n = self.hidden_size, self.num_heads
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
            attn += n if self.model_type == "gpt_oss" else 0  # one attention sink logit per head
        norms = (4 if self.sandwich_norms else 2) * d  # input_layernorm, post_attention_layernorm (+ Gemma's two)
        total = self.num_layers * (attn + norms)
        if dense_layers:
            i = self.intermediate_size
            total += dense_layers * (3 * d * i + self.mlp_bias * (2 * i + d))
        if self.moe is not None:
            total += len(self.moe_layers) * self.moe.layer_params(d, self.mlp_bias)
        embed = self.vocab_size * d
        return embed + total + d + (0 if self.tie_word_embeddings else embed)
