"""State-space layers of a hybrid model: `MambaConfig` (one Mamba mixer's shapes, as config.json names
them) and the layer types of attention + Mamba hybrids (`LAYER_TYPES`). Plain Python, no JAX.

A hybrid decoder's layers each carry one or two mixers, which decide what a request caches there
(`ModelConfig.layer_types`, one entry a layer; empty for an attention-only model):

    attention        attention only: K/V per token (Bamba, Granite-4.0-H and Jamba's attention layers)
    mamba            a Mamba mixer only: one fixed-size state per request
    mlp              neither (Nemotron-H's "-" layers, an MLP block between mixers): nothing cached
    attention_mamba  both, side by side (Falcon-H1's parallel layers): attention first, then the state

The state a Mamba layer keeps, its shapes per tensor-parallel rank and its dtypes, is
kvjax.core.mamba_spec's arithmetic (vLLM's `MambaSpec`); `MambaConfig.state_spec` applies it to
this config. `version` 2 is Mamba2 (multi-head SSD, arXiv:2405.21060; Bamba, Granite-4.0-H,
Nemotron-H, Falcon-H1), 1 is Mamba1 (selective scan, arXiv:2312.00752; Jamba).

`hybrid_num_params` counts a hybrid model's parameters as transformers' `num_parameters()` does,
family by family (tests/config/test_mamba_config.py checks it against tiny transformers models).
"""
from __future__ import annotations

import dataclasses

from kvjax.core.kv_cache_groups import MAMBA
from kvjax.core.mamba_spec import (MAMBA_DTYPES, VERSIONS, MambaSpec, mamba1_state_shapes, mamba2_state_shapes,
                                   state_dtypes)
from kvjax.quant.kv_formats import SpecError
from kvjax.utils.checks import INT32_MAX, check_int

LAYER_TYPES = ("attention", "mamba", "mlp", "attention_mamba")


class MambaConfigError(SpecError):
    """A Mamba mixer kvjax cannot describe; the message names the field and value."""


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """One Mamba mixer's shapes (every Mamba layer of a model has the same)."""

    version: int  # 1 (Mamba1, Jamba) or 2 (Mamba2)
    intermediate_size: int  # d_inner: the mixer's width (Mamba2: num_heads × head_dim)
    state_size: int  # N: d_state
    conv_kernel: int  # the causal convolution's width; its state keeps conv_kernel − 1 inputs
    num_heads: int = 1  # Mamba2: H SSM heads
    head_dim: int = 1  # Mamba2: P channels a head
    n_groups: int = 1  # Mamba2: G groups of B and C, shared by H / G heads each
    chunk_size: int = 256  # Mamba2: the SSD scan's chunk
    dt_rank: int = 1  # Mamba1: the rank of the step-size projection
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj and out_proj biases
    gated_norm: bool = True  # Mamba2: the gated RMSNorm before out_proj (Falcon-H1: mamba_rms_norm)
    norm_before_gate: bool = False  # Falcon-H1: y is normalised, then gated (others gate, then normalise)
    time_step_limit: tuple[float, float] = (0.0, float("inf"))  # Mamba2: dt clamped into this range
    ssm_cache_dtype: str = "auto"  # the SSM state's default dtype (vLLM's mamba_ssm_cache_dtype; Nemotron-H: float32)

    def __post_init__(self):
        if self.version not in VERSIONS:
            raise MambaConfigError(f"Mamba version {self.version!r} is not one of {VERSIONS}")
        for name in ("intermediate_size", "state_size", "conv_kernel", "num_heads", "head_dim", "n_groups",
                     "chunk_size", "dt_rank"):
            check_int(getattr(self, name), f"Mamba {name}", 1, INT32_MAX, MambaConfigError)
        if self.conv_kernel < 2:
            raise MambaConfigError(f"Mamba conv_kernel must be at least 2 (its state keeps conv_kernel − 1 inputs), "
                                   f"got {self.conv_kernel}")
        if self.version == 2:
            if self.num_heads * self.head_dim != self.intermediate_size:
                raise MambaConfigError(f"Mamba2 heads × head_dim ({self.num_heads} × {self.head_dim}) must be the "
                                       f"intermediate size {self.intermediate_size}")
            if self.num_heads % self.n_groups:
                raise MambaConfigError(f"Mamba2 n_groups {self.n_groups} does not divide the {self.num_heads} heads")
        for name in ("conv_bias", "proj_bias", "gated_norm", "norm_before_gate"):
            if not isinstance(getattr(self, name), bool):
                raise MambaConfigError(f"Mamba {name} must be true or false, got {getattr(self, name)!r}")
        if self.ssm_cache_dtype not in MAMBA_DTYPES:
            raise MambaConfigError(f"mamba_ssm_cache_dtype {self.ssm_cache_dtype!r} is not one of "
                                   f"{', '.join(MAMBA_DTYPES)}")

    @property
    def conv_dim(self) -> int:
        """Channels the causal convolution runs over: x, B and C (Mamba2), or x (Mamba1)."""
        return self.intermediate_size + (2 * self.n_groups * self.state_size if self.version == 2 else 0)

    def state_spec(self, model_dtype: str, tp: int = 1, mamba_cache_dtype: str = "auto",
                   mamba_ssm_cache_dtype: str = "auto") -> MambaSpec:
        """One layer's state on one of tp ranks (kvjax.core.mamba_spec), its SSM state in
        mamba_ssm_cache_dtype, whose "auto" is this model's default (`ssm_cache_dtype`)."""
        check_int(tp, "tensor_parallel_size", 1, None, MambaConfigError)
        if self.version == 2:
            shapes = mamba2_state_shapes(tp, self.intermediate_size, self.n_groups, self.num_heads, self.head_dim,
                                         self.state_size, self.conv_kernel)
        else:
            shapes = mamba1_state_shapes(tp, self.intermediate_size, self.state_size, self.conv_kernel)
        ssm = self.ssm_cache_dtype if mamba_ssm_cache_dtype == "auto" else mamba_ssm_cache_dtype
        return MambaSpec(shapes, state_dtypes(model_dtype, mamba_cache_dtype, ssm))

    def mixer_params(self, hidden_size: int) -> int:
        """One mixer's parameters as transformers counts them."""
        d, inner, n = hidden_size, self.intermediate_size, self.state_size
        conv = self.conv_dim * self.conv_kernel + self.conv_bias * self.conv_dim
        out = inner * d + self.proj_bias * d
        if self.version == 2:
            h = self.num_heads
            proj = inner + self.conv_dim + h  # gate z, then x/B/C, then dt
            return d * proj + self.proj_bias * proj + conv + 3 * h + self.gated_norm * inner + out  # dt_bias, A, D
        # Mamba1 (Jamba): in_proj to x and z, x_proj to dt/B/C, dt_proj (with its bias), A, D, and Jamba's
        # RMSNorms over dt, B and C
        r = self.dt_rank
        return (d * 2 * inner + self.proj_bias * 2 * inner + conv + inner * (r + 2 * n) + r * inner + inner
                + inner * n + inner + out + r + 2 * n)


def check_layer_types(types, num_layers: int) -> tuple[str, ...]:
    """A hybrid's layer types: one of LAYER_TYPES a layer (MambaConfigError otherwise)."""
    types = tuple(types)
    if len(types) != num_layers or not all(t in LAYER_TYPES for t in types):
        raise MambaConfigError(f"layer_types must give one of {', '.join(LAYER_TYPES)} for each of the {num_layers} "
                               f"layers, got {types[:8]!r}{'...' if len(types) > 8 else ''}")
    return types


def hybrid_num_params(c) -> int:
    """A hybrid ModelConfig's parameters, as transformers' `num_parameters()` counts them: the embedding,
    each layer's mixers (attention: q/k/v/o; Mamba: `MambaConfig.mixer_params`), its MLP, MoE or
    neither, its norms, the final norm and an untied lm_head. The families differ in their blocks:

        bamba, falcon_h1   every layer a gated MLP of intermediate_size and two norms
        granitemoehybrid   every layer a MoE whose shared expert is the shared MLP (without experts: that MLP
                           alone), two norms
        jamba              every layer an MLP, or a MoE on the expert layers, and two norms
        nemotron_h         one norm and one mixer a layer: Mamba, attention, or a non-gated MLP ("mlp" layers)
    """
    d, heads, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    attn = d * (heads + 2 * kv) * hd + c.qkv_bias * (heads + 2 * kv) * hd + heads * hd * d + c.o_bias * d
    mamba = c.mamba.mixer_params(d)
    total = 0
    for i, t in enumerate(c.layer_types):
        total += attn * (t in ("attention", "attention_mamba")) + mamba * (t in ("mamba", "attention_mamba"))
        if c.model_type == "nemotron_h":
            total += d + (t == "mlp") * (2 * d * c.intermediate_size + c.mlp_bias * (c.intermediate_size + d))
            continue
        total += 2 * d  # the two layer norms
        if i in c.moe_layers:  # Granite's shared MLP is the MoE's shared expert (MoEConfig.shared_intermediate_size)
            total += c.moe.layer_params(d, c.mlp_bias)
        else:
            i_ = c.intermediate_size
            total += 3 * d * i_ + c.mlp_bias * (2 * i_ + d)
    embed = c.vocab_size * d
    return embed + total + d + (0 if c.tie_word_embeddings else embed)


def cache_layers(c) -> tuple[tuple, tuple[int, ...]]:
    """A ModelConfig's cached layers in vLLM's order (its layers' construction order): (each one's
    window, kvjax.core.kv_cache_groups's MAMBA for a Mamba layer; each one's decoder layer). A
    Falcon-H1 layer is two: its attention, then its Mamba mixer; an MLP-only layer is none."""
    windows, ids = [], []
    attention_windows = c.layer_windows
    for i, t in enumerate(c.layer_types or ("attention",) * c.num_layers):
        if t.startswith("attention"):
            windows.append(attention_windows[i])
            ids.append(i)
        if t.endswith("mamba"):
            windows.append(MAMBA)
            ids.append(i)
    return tuple(windows), tuple(ids)
