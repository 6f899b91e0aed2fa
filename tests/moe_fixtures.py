"""Tiny random-init transformers MoE models (float32, eager attention) for kvjax's MoE tests.

One case per routing variant, each built offline from transformers' own config class with 8 routed
experts, top-2, and real MoE layers beside dense ones where the family has both:

    mixtral            softmax, renormalised top-2, experts intermediate_size wide, every layer MoE
    qwen2-moe          softmax top-2 (norm_topk_prob false), a shared expert × sigmoid(shared_expert_gate);
                       3 layers, the middle one dense (mlp_only_layers)
    qwen3-moe          softmax top-2, norm_topk_prob true, q/k norms, no shared expert
    deepseek-v2        softmax, greedy, routed_scaling_factor 1.5, 2 shared experts; layer 0 dense
    deepseek-v2-group  group_limited_greedy: 2 groups of 4 experts, both chosen from the best group; 3 layers
    deepseek-v3        sigmoid, noaux_tc with a nonzero e_score_correction_bias, 4 groups / best 2,
                       norm_topk_prob, routed_scaling_factor 2.5, a shared expert; 3 layers

and gpt-oss (`make_gpt_oss_model`): top-k of the biased router logits then softmax over the k, expert biases,
the clamped SwiGLU, on every layer, beside attention with per-head sinks, q/k/v/o biases, YaRN RoPE and
sliding layers alternating with full ones (window GPT_OSS_WINDOW, 4 layers: 0 and 2 slide).

Weights as tests/hf_fixtures.py draws them (initializer_range 0.15; norm weights and biases
perturbed), and DeepSeek-V3's e_score_correction_bias (a buffer transformers initialises to 0) drawn
with std 0.2, about the spread of the sigmoid scores, so that it changes which experts win.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers as tf  # noqa: E402
from hf_fixtures import BASE, random_model  # noqa: E402

ROUTED = dict(num_experts_per_tok=2)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
           n_routed_experts=8, moe_intermediate_size=32, first_k_dense_replace=1, **ROUTED)
THREE = {**BASE, "num_hidden_layers": 3}

MOE_CASES = ("mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v2", "deepseek-v2-group", "deepseek-v3")


def moe_config(name: str):
    """(transformers config, model class) of one MoE case."""
    if name == "mixtral":
        return (tf.MixtralConfig(**{**BASE, "intermediate_size": 32}, num_key_value_heads=2, num_local_experts=8,
                                 **ROUTED), tf.MixtralForCausalLM)
    if name == "qwen2-moe":
        return (tf.Qwen2MoeConfig(**THREE, num_key_value_heads=2, num_experts=8, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48, mlp_only_layers=[1], **ROUTED),
                tf.Qwen2MoeForCausalLM)
    if name == "qwen3-moe":
        return (tf.Qwen3MoeConfig(**BASE, num_key_value_heads=2, head_dim=16, num_experts=8, moe_intermediate_size=32,
                                  norm_topk_prob=True, **ROUTED), tf.Qwen3MoeForCausalLM)
    if name == "deepseek-v2":
        return (tf.DeepseekV2Config(**BASE, **MLA, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5),
                tf.DeepseekV2ForCausalLM)
    if name == "deepseek-v2-group":
        return (tf.DeepseekV2Config(**THREE, **MLA, q_lora_rank=32, n_shared_experts=1, routed_scaling_factor=1.5,
                                    topk_method="group_limited_greedy", n_group=2, topk_group=1),
                tf.DeepseekV2ForCausalLM)
    if name == "deepseek-v3":
        return (tf.DeepseekV3Config(**THREE, **MLA, q_lora_rank=32, n_shared_experts=1, n_group=4, topk_group=2,
                                    max_position_embeddings=128), tf.DeepseekV3ForCausalLM)
    raise KeyError(name)


def make_moe_model(name: str, seed: int = 0):
    """A random-init transformers MoE model for case `name` (eval mode, eager attention, fp32)."""
    return random_model(*moe_config(name), seed)


def moe_blocks(model) -> dict[int, torch.nn.Module]:
    """The MoE blocks of a transformers model by layer index (Mixtral's is `mlp` in transformers 5 too)."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}


GPT_OSS_WINDOW = 5  # tokens a sliding layer sees: a few blocks of 4, so the tests' sequences outrun it


def gpt_oss_config(**changes):
    """A tiny GptOssConfig: 4 layers alternating sliding (window GPT_OSS_WINDOW) and full, 4 query heads over 2
    kv heads of 16 dims, 8 experts of width 32, top-2, transformers' default YaRN RoPE (factor 32 over 4096
    positions, θ 150000, truncate false); float32."""
    return tf.GptOssConfig(**{**BASE, "num_hidden_layers": 4, "intermediate_size": 32, "num_key_value_heads": 2,
                              "head_dim": 16, "num_local_experts": 8, "sliding_window": GPT_OSS_WINDOW,
                              "dtype": "float32", **ROUTED, **changes})


def make_gpt_oss_model(seed: int = 0, **changes):
    """A random-init transformers GptOssForCausalLM (eval mode, eager attention, fp32) with norm weights, every
    bias and the attention sinks perturbed: the sinks drawn with std 1, the spread of the attention scores, so
    that they take a visible share of each softmax."""
    config = gpt_oss_config(**changes)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
            elif pname.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    return model
