"""Mixture-of-experts GGUF files: Qwen2-MoE, Qwen3-MoE, and llama files with experts (Mixtral).

llama.cpp stores a MoE layer's routed experts stacked, one tensor a projection, beside the router
and (Qwen2-MoE) a shared expert; models.gguf reads them under the Hugging Face names models.loader
takes, as transformers' GGUF loader does (`modeling_gguf_pytorch_utils.Qwen2MoeTensorProcessor`:
gate and up side by side into `mlp.experts.gate_up_proj`, gate first, vLLM's w13 order; the shared
expert's gate vector made [1, D]). Shapes in torch's order (ggml's dims reversed):

    blk.N.ffn_gate_inp.weight        [E, D]   the router                   → mlp.gate.weight
    blk.N.ffn_gate_exps.weight       [E, I, D] every expert's gate_proj  ┐ → mlp.experts.gate_up_proj [E, 2I, D]
    blk.N.ffn_up_exps.weight         [E, I, D] every expert's up_proj    ┘
    blk.N.ffn_down_exps.weight       [E, D, I] every expert's down_proj   → mlp.experts.down_proj
    blk.N.ffn_{gate,up,down}_shexp.weight      the shared expert          → mlp.shared_expert.{gate,up,down}_proj
    blk.N.ffn_gate_inp_shexp.weight  [D]      its sigmoid gate            → mlp.shared_expert_gate.weight [1, D]
    blk.N.attn_{q,k}_norm.weight     [H]      Qwen3's q/k norms           → self_attn.{q,k}_norm.weight

Metadata (`{arch}.*`, gguf's Keys.LLM): expert_count (E), expert_used_count (k),
expert_feed_forward_length (I; Mixtral's experts are feed_forward_length wide) and
expert_shared_feed_forward_length (Qwen2-MoE's shared expert). The routing is each family's, as
transformers' GGUF loader sets it (integrations/ggml.py GGUF_CONFIG_MAPPING and
GGUF_CONFIG_DEFAULTS_MAPPING): Qwen3-MoE renormalises the top k (norm_topk_prob true, what llama.cpp's
qwen3moe graph does), Qwen2-MoE does not, Mixtral always does (kvjax.config.hf). llama.cpp writes
Qwen's attention unpermuted (its Qwen2Model converter has no `permute`), Mixtral's permuted as every
llama's; every layer of these files is a MoE layer, as llama.cpp builds them.

transformers reads qwen2moe and qwen3moe files, but not the experts' widths (its mapping leaves out
expert_feed_forward_length, so a file whose experts are not its config class's default width fails
its shape checks); it reads a llama file with experts as a dense Llama and drops them. kvjax reads
all three. Not read: deepseek2 files (MLA with kv_b_proj split into attn_k_b / attn_v_b, and routing
keys of its own), which transformers has no mapping for either.
"""
from __future__ import annotations

from typing import Any

import numpy as np

ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # GGUF's name → model_type
CLASSES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# Block tensor names of MoE and Qwen layers → Hugging Face names below model.layers.N (suffix included:
# the fused expert tensors have none).
BLOCK_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj", "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# A Hugging Face tensor made of several GGUF ones, side by side on torch's axis 1, in the order listed.
JOINED = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps")}


def block_name(layer: str, rest: str) -> str | None:
    """The Hugging Face name of GGUF tensor `blk.{layer}.{rest}`, or None when it is not a MoE / Qwen one."""
    name = BLOCK_NAMES.get(rest)
    return None if name is None else f"model.layers.{layer}.{name}"


def group(tensors, architecture: str, hf_tensor_name) -> dict[str, list]:
    """GGUF tensors by their Hugging Face name (`hf_tensor_name(gguf name, architecture)`): one each, or a
    joined tensor's parts in JOINED's order (gate before up)."""
    def part(t) -> int:
        return next((i for parts in JOINED.values() for i, p in enumerate(parts) if f".{p}." in t.name), 0)

    out: dict[str, list] = {}
    for t in sorted(tensors, key=part):  # stable: whole tensors keep the file's order
        out.setdefault(hf_tensor_name(t.name, architecture), []).append(t)
    return out


def torch_shape(hf_name: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape of a Hugging Face tensor read from GGUF tensors of these (torch-order) shapes; None when
    the parts do not fit together (different shapes apart from axis 1)."""
    if hf_name.endswith("shared_expert_gate.weight") and len(shapes[0]) == 1:
        return (1, *shapes[0])  # transformers' np.expand_dims: a Linear(D, 1) weight
    if len(shapes) == 1:
        return shapes[0]
    first = shapes[0]
    if any(len(s) != len(first) or s[:1] + s[2:] != first[:1] + first[2:] for s in shapes):
        return None
    return (first[0], sum(s[1] for s in shapes), *first[2:])


def join(hf_name: str, arrays: list[np.ndarray]) -> np.ndarray:
    """The Hugging Face tensor from its GGUF parts (read and dequantized), as torch_shape describes it."""
    if hf_name.endswith("shared_expert_gate.weight") and arrays[0].ndim == 1:
        return arrays[0][None]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)


def moe_config(gguf_file, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields of a MoE file's experts (and, for Qwen, its model type), from `{arch}.*`;
    {} for a llama file without experts. `cfg` is the file's config so far (models.gguf.GGUFFile.hf_config)."""
    def m(key, default=..., lo=1):
        return gguf_file.meta_int(f"{arch}.{key}", default, lo)

    if arch == "llama":
        experts = m("expert_count", 0, lo=0)
        if not experts:
            return {}
        # Mixtral: the experts are feed_forward_length wide; num_experts_per_tok defaults to MixtralConfig's 2
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
                "num_experts_per_tok": m("expert_used_count", 2), "sliding_window": None}
    out = {"model_type": ARCHITECTURES[arch], "architectures": [CLASSES[arch]],
           "num_experts": m("expert_count"), "num_experts_per_tok": m("expert_used_count"),
           "moe_intermediate_size": m("expert_feed_forward_length"), "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "qwen2moe":
        out.update(shared_expert_intermediate_size=m("expert_shared_feed_forward_length"), norm_topk_prob=False,
                   qkv_bias=cfg["attention_bias"])
    else:
        out["norm_topk_prob"] = True
    return out
