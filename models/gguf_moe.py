"""Mixture-of-experts GGUF files: Qwen2-MoE, Qwen3-MoE, llama files with experts (Mixtral), gpt-oss and
DeepSeek-V2/V3 (llama.cpp's `deepseek2`, multi-head latent attention).

llama.cpp stores a MoE layer's routed experts stacked, one tensor a projection, beside the router
and the shared experts; models.gguf reads them under the Hugging Face names models.loader takes, in
the layout transformers' checkpoints hold, as transformers' GGUF loader does where it reads the family
(`modeling_gguf_pytorch_utils.Qwen2MoeTensorProcessor`: gate and up side by side into
`mlp.experts.gate_up_proj`, gate first, vLLM's w13 order; the shared expert's gate vector made [1, D]).
Shapes in torch's order (ggml's dims reversed):

    blk.N.ffn_gate_inp.weight        [E, D]   the router                   → mlp.gate.weight
    blk.N.ffn_gate_exps.weight       [E, I, D] every expert's gate_proj  ┐ → mlp.experts.gate_up_proj [E, 2I, D]
    blk.N.ffn_up_exps.weight         [E, I, D] every expert's up_proj    ┘
    blk.N.ffn_down_exps.weight       [E, D, I] every expert's down_proj   → mlp.experts.down_proj
    blk.N.ffn_{gate,up,down}_shexp.weight      the shared expert(s)       → mlp.shared_expert.{gate,up,down}_proj
                                                                            (DeepSeek: mlp.shared_experts.*)
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

**gpt-oss** (llama.cpp's `GptOssModel` converter, which has no `permute`: NeoX rotary as transformers'):
transformers' fused experts are [E, in, out] with the gate and up columns interleaved (gate_0, up_0,
gate_1, ...); the converter transposes them to ggml's [E, out, in] and splits the interleaved rows
(`[:, ::2]` gate, `[:, 1::2]` up), the biases likewise. Reading interleaves them again, so the tensors
are transformers' (models.loader then takes the halves apart):

    blk.N.ffn_{gate,up}_exps.{weight,bias}  [E, I, D], [E, I] → mlp.experts.gate_up_proj{,_bias} [E, D, 2I], [E, 2I]
    blk.N.ffn_down_exps.{weight,bias}       [E, D, I], [E, D] → mlp.experts.down_proj{,_bias} [E, I, D], [E, D]
    blk.N.ffn_gate_inp.{weight,bias}        [E, D], [E]       → mlp.router.{weight,bias}
    blk.N.attn_sinks.weight                 [N]               → self_attn.sinks
    blk.N.post_attention_norm.weight        [D]               → post_attention_layernorm.weight

The experts may be F32, F16, BF16 or MXFP4 (ggml's block: one E8M0 scale byte, then 16 bytes of FP4 codes,
element j in the low nibble of byte j and element j + 16 in the high one; the converter repacks the released
checkpoints' `_blocks` / `_scales` into it), all read through `gguf.quants.dequantize`, which gives the same
float32 values as models.mxfp4. Metadata: expert_count, expert_used_count, attention.sliding_window (even
layers slide: llama.cpp's `set_swa_pattern(2)`, GptOssConfig's layer_types), key_length (head_dim; absent,
hidden / heads as llama.cpp), and the YaRN keys rope.scaling.{type, factor, original_context_length,
yarn_beta_fast, yarn_beta_slow}; `truncate` false as in GptOssConfig (the model's own rotary; llama.cpp's
ggml_rope_yarn_corr_dims rounds the correction range). alpha 1.702 and limit 7.0 of the clamped SwiGLU
are not in the file (llama.cpp hard-codes them too).

**deepseek2** (llama.cpp's `DeepseekV2Model` converter, also without `permute`: ggml's deepseek2 rotates
adjacent pairs, which is what transformers' interleaved DeepSeek rotary does to the stored weights):

    blk.N.attn_q.weight / attn_q_a, attn_q_a_norm, attn_q_b   → self_attn.q_proj / q_a_proj, q_a_layernorm, q_b_proj
    blk.N.attn_kv_a_mqa, attn_kv_a_norm                       → self_attn.kv_a_proj_with_mqa, kv_a_layernorm
    blk.N.attn_k_b.weight [N, R, nope] ┐ (current converter: kv_b_proj viewed [N, nope + v, R], split, k_b
    blk.N.attn_v_b.weight [N, v, R]    ┘  transposed) → self_attn.kv_b_proj.weight [N · (nope + v), R]
    blk.N.attn_kv_b.weight [N · (nope + v), R]  (files converted before the split) → the same
    blk.N.ffn_{gate,up,down}.weight           the leading dense layers    → mlp.{gate,up,down}_proj
    blk.N.exp_probs_b.bias           [E]      V3's e_score_correction_bias → mlp.gate.e_score_correction_bias

Its metadata, as config.json fields: attention.q_lora_rank (absent: q_proj, no LoRA), attention.kv_lora_rank
(R), rope.dimension_count (qk_rope_head_dim), attention.key_length_mla / value_length_mla (qk_nope + qk_rope,
v_head_dim; older files, without them, put those in key_length / value_length, where current ones hold
R + rope and R), leading_dense_block_count (first_k_dense_replace), expert_count, expert_used_count,
expert_shared_count, expert_feed_forward_length, expert_weights_scale (routed_scaling_factor, default 1),
expert_weights_norm (norm_topk_prob, default false), expert_gating_func (1 softmax, 2 sigmoid; absent,
softmax as llama.cpp reads old files), expert_group_count / expert_group_used_count (n_group, topk_group).
The model type follows the scores: sigmoid → deepseek_v3, softmax → deepseek_v2. topk_method is not in the
file: noaux_tc where the layers have exp_probs_b, group_limited_greedy (a group ranked by its best score, as
DeepSeek-V2 and vLLM rank it) where expert_group_count > 1, else greedy; llama.cpp's graph ranks groups by
their two best scores whatever the model. YaRN: GGUF keeps one of DeepSeek's two mscales,
rope.scaling.yarn_log_multiplier = 0.1 · mscale_all_dim; kvjax reads mscale = mscale_all_dim from it, which
every released config has (V2 and V2-Lite 0.707 and 0.707, V3 1.0 and 1.0); absent, yarn's cos/sin factor
is 1 and the softmax scale unscaled, as llama.cpp's deepseek2 graph then computes.

transformers reads qwen2moe and qwen3moe files, but not the experts' widths (its mapping leaves out
expert_feed_forward_length, so a file whose experts are not its config class's default width fails
its shape checks); it reads a llama file with experts as a dense Llama and drops them. transformers 5.24
does not read gpt-oss files: its reader of the rope.scaling keys takes each field's first part (the key's
length) for its value and fails, and without those keys it finds no tensor for the experts or the sinks
(its GptOssTensorProcessor is registered under "gpt_oss" and looks for `ffn_*_projs`). It has no deepseek2
mapping. kvjax reads all five.
"""
from __future__ import annotations

from typing import Any

import numpy as np

ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                 "deepseek2": "deepseek_v2"}  # GGUF's name → model_type (deepseek2: v2 or v3 by its scores)
CLASSES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "gpt-oss": "GptOssForCausalLM"}
YARN = ("gpt-oss", "deepseek2")  # architectures whose rope.scaling.type may be yarn, read here
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
_MLA = {"attn_q_a": "q_a_proj", "attn_q_a_norm": "q_a_layernorm", "attn_q_b": "q_b_proj",
        "attn_kv_a_mqa": "kv_a_proj_with_mqa", "attn_kv_a_norm": "kv_a_layernorm", "attn_kv_b": "kv_b_proj"}
ARCH_BLOCK_NAMES = {  # where an architecture names a tensor otherwise (or has more of them)
    "gpt-oss": {
        "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias", "ffn_up_exps.bias": "mlp.experts.gate_up_proj_bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias", "attn_sinks.weight": "self_attn.sinks",
        "post_attention_norm.weight": "post_attention_layernorm.weight"},
    "deepseek2": {
        **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
        **{f"{g}.{s}": f"self_attn.{h}.{s}" for g, h in _MLA.items() for s in ("weight", "bias")},
        "attn_k_b.weight": "self_attn.kv_b_proj.weight", "attn_v_b.weight": "self_attn.kv_b_proj.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
}
# A Hugging Face tensor made of several GGUF ones, in the order listed (how they join: torch_shape / join).
JOINED = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
          "mlp.experts.gate_up_proj_bias": ("ffn_gate_exps", "ffn_up_exps"),
          "self_attn.kv_b_proj.weight": ("attn_k_b", "attn_v_b")}
GATING = {1: "softmax", 2: "sigmoid"}  # gguf's ExpertGatingFuncType → scoring_func


def block_name(layer: str, rest: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of GGUF tensor `blk.{layer}.{rest}`, or None when it is not a MoE / Qwen /
    gpt-oss / MLA one."""
    name = ARCH_BLOCK_NAMES.get(architecture, {}).get(rest) or BLOCK_NAMES.get(rest)
    return None if name is None else f"model.layers.{layer}.{name}"


def group(tensors, architecture: str, hf_tensor_name) -> dict[str, list]:
    """GGUF tensors by their Hugging Face name (`hf_tensor_name(gguf name, architecture)`): one each, or a
    joined tensor's parts in JOINED's order (gate before up, k_b before v_b)."""
    def part(t) -> int:
        return next((i for parts in JOINED.values() for i, p in enumerate(parts) if f".{p}." in t.name), 0)

    out: dict[str, list] = {}
    for t in sorted(tensors, key=part):  # stable: whole tensors keep the file's order
        out.setdefault(hf_tensor_name(t.name, architecture), []).append(t)
    return out


def _gpt_oss_experts(architecture: str, hf_name: str) -> bool:
    return architecture == "gpt-oss" and ".mlp.experts." in hf_name


def torch_shape(architecture: str, hf_name: str, parts: list) -> tuple[int, ...] | None:
    """The shape of a Hugging Face tensor read from these GGUF tensors (gguf ReaderTensors, JOINED's order);
    None when they do not fit together."""
    shapes = [tuple(int(d) for d in t.shape[::-1]) for t in parts]  # torch's order: ggml's dims reversed
    if hf_name.endswith("shared_expert_gate.weight") and len(shapes[0]) == 1:
        return (1, *shapes[0])  # transformers' np.expand_dims: a Linear(D, 1) weight
    if hf_name.endswith("kv_b_proj.weight") and len(shapes) == 2:  # k_b [N, R, nope] + v_b [N, v, R]
        k, v = shapes
        fits = len(k) == len(v) == 3 and k[0] == v[0] and k[1] == v[2]
        return (k[0] * (k[2] + v[1]), k[1]) if fits else None
    if _gpt_oss_experts(architecture, hf_name):  # transformers' [E, in, out] (a bias [E, out]), gate/up interleaved
        first = shapes[0]
        if len(shapes) == 2 and (shapes[1] != first or len(first) not in (2, 3)):
            return None
        out = (first[0], first[1] * len(shapes), *first[2:])
        return (out[0], out[2], out[1]) if len(out) == 3 else out
    if len(shapes) == 1:
        return shapes[0]
    first = shapes[0]
    if any(len(s) != len(first) or s[:1] + s[2:] != first[:1] + first[2:] for s in shapes):
        return None
    return (first[0], sum(s[1] for s in shapes), *first[2:])


def join(architecture: str, hf_name: str, arrays: list[np.ndarray]) -> np.ndarray:
    """The Hugging Face tensor from its GGUF parts (read and dequantized), as torch_shape describes it."""
    if hf_name.endswith("shared_expert_gate.weight") and arrays[0].ndim == 1:
        return arrays[0][None]
    if hf_name.endswith("kv_b_proj.weight") and len(arrays) == 2:
        k_b, v_b = arrays  # [N, R, nope], [N, v, R]
        return np.concatenate([np.swapaxes(k_b, 1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])  # [N · (nope + v), R]
    if _gpt_oss_experts(architecture, hf_name):
        # gate and up rows back to alternating (gate_0, up_0, gate_1, ...), then [E, out, in] → [E, in, out]
        out = arrays[0] if len(arrays) == 1 else \
            np.stack(arrays, axis=2).reshape(arrays[0].shape[0], -1, *arrays[0].shape[2:])
        return np.swapaxes(out, 1, 2) if out.ndim == 3 else out
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)


def moe_config(gguf_file, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields of a MoE file's experts (and its model type, attention and rotary where
    they are the family's own), from `{arch}.*`; {} for a llama file without experts. `cfg` is the file's
    config so far (models.gguf.GGUFFile.hf_config); a deepseek2 file's head_dim, which is no MLA width,
    is taken out of it."""
    def m(key, default=..., lo=1):
        return gguf_file.meta_int(f"{arch}.{key}", default, lo)

    if arch == "llama":
        experts = m("expert_count", 0, lo=0)
        if not experts:
            return {}
        # Mixtral: the experts are feed_forward_length wide; num_experts_per_tok defaults to MixtralConfig's 2
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
                "num_experts_per_tok": m("expert_used_count", 2), "sliding_window": None}
    if arch == "gpt-oss":
        layers = cfg["num_hidden_layers"]
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])  # llama.cpp's n_embd_head_k
        return {"model_type": "gpt_oss", "architectures": [CLASSES[arch]], "num_local_experts": m("expert_count"),
                "num_experts_per_tok": m("expert_used_count"),
                "intermediate_size": m("expert_feed_forward_length", cfg["intermediate_size"]),
                "sliding_window": m("attention.sliding_window"),
                "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
                "rope_parameters": _yarn(gguf_file, arch, cfg["rope_parameters"], truncate=False)}
    if arch == "deepseek2":
        return _deepseek2(gguf_file, m, cfg)
    out = {"model_type": ARCHITECTURES[arch], "architectures": [CLASSES[arch]],
           "num_experts": m("expert_count"), "num_experts_per_tok": m("expert_used_count"),
           "moe_intermediate_size": m("expert_feed_forward_length"), "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "qwen2moe":
        out.update(shared_expert_intermediate_size=m("expert_shared_feed_forward_length"), norm_topk_prob=False,
                   qkv_bias=cfg["attention_bias"])
    else:
        out["norm_topk_prob"] = True
    return out


def _yarn(gguf_file, arch: str, rope: dict, **extra) -> dict:
    """`rope` (type default, θ) with the file's YaRN keys when rope.scaling.type is yarn."""
    if gguf_file.meta_str(f"{arch}.rope.scaling.type", "none") != "yarn":
        return rope
    x = lambda key, default=...: gguf_file.meta_number(f"{arch}.rope.scaling.{key}", default, lo=0)  # noqa: E731
    return {**rope, "rope_type": "yarn", "factor": gguf_file.meta_number(f"{arch}.rope.scaling.factor", lo=1),
            "original_max_position_embeddings": gguf_file.meta_int(f"{arch}.rope.scaling.original_context_length"),
            "beta_fast": x("yarn_beta_fast", 32.0), "beta_slow": x("yarn_beta_slow", 1.0), **extra}


def _deepseek2(gguf_file, m, cfg: dict[str, Any]) -> dict[str, Any]:
    """A deepseek2 file's MLA and routing fields (module docstring)."""
    arch, layers, heads = "deepseek2", cfg["num_hidden_layers"], cfg["num_attention_heads"]
    cfg.pop("head_dim", None)
    cfg.pop("partial_rotary_factor", None)
    rope_dim = m("rope.dimension_count")
    mla = m("attention.key_length_mla", None) is not None
    key, value = (m("attention.key_length_mla"), m("attention.value_length_mla")) if mla else \
        (m("attention.key_length"), m("attention.value_length"))
    if key <= rope_dim:
        which = "key_length_mla" if mla else "key_length"
        raise gguf_file._bad(f"{arch}.attention.{which}", f"more than rope.dimension_count ({rope_dim}): qk_nope + "
                             "qk_rope head dims", key)
    first_dense = m("leading_dense_block_count", 0, lo=0)
    scoring = GATING[gguf_file.meta_int(f"{arch}.expert_gating_func", 1, lo=1, hi=2)]
    v3 = scoring == "sigmoid"
    names = gguf_file.names()
    out = {"model_type": "deepseek_v3" if v3 else "deepseek_v2",
           "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
           "num_key_value_heads": heads,  # current files say 1 (MLA as MQA over the latent); transformers: N
           "q_lora_rank": m("attention.q_lora_rank", None), "kv_lora_rank": m("attention.kv_lora_rank"),
           "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": key - rope_dim, "v_head_dim": value,
           "first_k_dense_replace": first_dense, "rope_interleave": True,
           "attention_bias": "model.layers.0.self_attn.kv_a_proj_with_mqa.bias" in names,
           "rope_parameters": _yarn(gguf_file, arch, cfg["rope_parameters"], **_mscale(gguf_file, arch))}
    if first_dense >= layers:  # every layer dense: no experts to read
        return out
    groups = m("expert_group_count", 1)
    biased = any(name.endswith("mlp.gate.e_score_correction_bias") for name in names)
    out.update(n_routed_experts=m("expert_count"), num_experts_per_tok=m("expert_used_count"),
               moe_intermediate_size=m("expert_feed_forward_length"),
               n_shared_experts=m("expert_shared_count", 0, lo=0),
               routed_scaling_factor=gguf_file.meta_number(f"{arch}.expert_weights_scale", 1.0, lo=0, open_lo=True),
               norm_topk_prob=gguf_file.meta_bool(f"{arch}.expert_weights_norm", False), scoring_func=scoring,
               n_group=groups, topk_group=m("expert_group_used_count", 1),
               topk_method="noaux_tc" if biased else "group_limited_greedy" if groups > 1 else "greedy")
    return out


def _mscale(gguf_file, arch: str) -> dict[str, float]:
    """DeepSeek's yarn mscale and mscale_all_dim from rope.scaling.yarn_log_multiplier (0.1 · mscale_all_dim)."""
    log_mul = gguf_file.meta_number(f"{arch}.rope.scaling.yarn_log_multiplier", None, lo=0)
    if not log_mul:  # absent or 0: llama.cpp scales neither cos/sin nor the softmax
        return {"attention_factor": 1.0}
    return {"mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}
