"""kvjax.config: MoEConfig, its parsing from each MoE family's config.json, and MoE parameter counts.

Expected values come from transformers' own config classes (their defaults and their attributes)
and from `num_parameters()` of tiny transformers models; none is taken from the code under test.
"""
import dataclasses

import pytest
import transformers as tf

from kvjax.config.hf import from_hf_config
from kvjax.config.model import ModelConfigError, MoEConfig
from kvjax.config.presets import preset

# The attention fields each family needs (the rest: transformers' defaults)
_GQA = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
_MLA = {**_GQA, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "first_k_dense_replace": 1}
FAMILIES = {"mixtral": (tf.MixtralConfig, _GQA), "qwen2_moe": (tf.Qwen2MoeConfig, _GQA),
            "qwen3_moe": (tf.Qwen3MoeConfig, _GQA), "deepseek_v2": (tf.DeepseekV2Config, _MLA),
            "deepseek_v3": (tf.DeepseekV3Config, _MLA), "gpt_oss": (tf.GptOssConfig, {**_GQA, "head_dim": 16})}


def _expected(ref) -> dict:
    """MoEConfig's fields as transformers' config object `ref` holds them."""
    t = ref.model_type
    if t in ("mixtral", "gpt_oss"):
        got = dict(num_experts=ref.num_local_experts, top_k=ref.num_experts_per_tok,
                   intermediate_size=ref.intermediate_size)
        if t == "gpt_oss":
            got.update(swiglu_alpha=ref.swiglu_alpha, swiglu_limit=ref.swiglu_limit)
        return got
    got = dict(num_experts=ref.num_experts if t.startswith("qwen") else ref.n_routed_experts,
               top_k=ref.num_experts_per_tok, intermediate_size=ref.moe_intermediate_size,
               norm_topk_prob=ref.norm_topk_prob)
    if t == "qwen2_moe":
        got.update(shared_intermediate_size=ref.shared_expert_intermediate_size)
    if t.startswith("deepseek"):
        got.update(routed_scaling_factor=ref.routed_scaling_factor,
                   shared_intermediate_size=ref.n_shared_experts * ref.moe_intermediate_size,
                   n_group=ref.n_group or 1, topk_group=ref.topk_group or 1)
    return got


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_absent_fields_take_transformers_defaults(model_type):
    cls, attention = FAMILIES[model_type]
    extra = {"num_experts_per_tok": 6} if model_type == "deepseek_v2" else {}  # its class default is None
    ref = cls(**attention, **extra)
    parsed = from_hf_config({"model_type": model_type, **attention, **extra}).moe
    assert {f: getattr(parsed, f) for f in _expected(ref)} == _expected(ref)
    assert parsed == from_hf_config(ref.to_dict()).moe  # what save_pretrained writes reads the same


@pytest.mark.parametrize("model_type, kinds", [
    ("mixtral", dict(scoring_func="softmax", topk_method="greedy", norm_topk_prob=True, f32_weights=True)),
    ("qwen2_moe", dict(scoring_func="softmax", shared_expert_gate=True, f32_weights=False, router_f32=False)),
    ("qwen3_moe", dict(scoring_func="softmax", shared_intermediate_size=0, f32_weights=False)),
    ("deepseek_v2", dict(scoring_func="softmax", topk_method="greedy", router_f32=True, f32_weights=True)),
    ("deepseek_v3", dict(scoring_func="sigmoid", topk_method="noaux_tc", router_f32=True)),
    ("gpt_oss", dict(scoring_func="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
                     f32_weights=False)),
])
def test_each_family_routes_as_its_modeling_code(model_type, kinds):
    _, attention = FAMILIES[model_type]
    moe = from_hf_config({"model_type": model_type, **attention, "num_experts_per_tok": 2}).moe
    assert {f: getattr(moe, f) for f in kinds} == kinds


def test_deepseek_fields_transformers_hard_codes_are_read():
    """Real DeepSeek configs name scoring_func and topk_method (vLLM reads them); V2-236B's values."""
    v2 = from_hf_config({"model_type": "deepseek_v2", **_MLA, "n_routed_experts": 160, "num_experts_per_tok": 6,
                         "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
                         "routed_scaling_factor": 16.0, "scoring_func": "softmax"}).moe
    assert (v2.topk_method, v2.n_group, v2.topk_group, v2.routed_scaling_factor, v2.grouped) == (
        "group_limited_greedy", 8, 3, 16.0, True)
    v3 = preset("deepseek-v3").moe  # DeepSeek-V3's published config: 256 experts, 8 groups, the best 4
    assert (v3.num_experts, v3.top_k, v3.n_group, v3.topk_group, v3.routed_scaling_factor) == (256, 8, 8, 4, 2.5)
    with pytest.raises(ModelConfigError, match="'topk_method' must be one of greedy, group_limited_greedy, noaux_tc"):
        from_hf_config({"model_type": "deepseek_v3", **_MLA, "topk_method": "random"})


def test_expert_count_aliases():
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts (its attribute_map), older files num_experts
    assert from_hf_config({"model_type": "qwen3_moe", **_GQA, "num_local_experts": 16}).moe.num_experts == 16
    assert from_hf_config({"model_type": "qwen3_moe", **_GQA, "num_experts": 16}).moe.num_experts == 16
    with pytest.raises(ModelConfigError, match=r"'num_experts' \(16\) and 'num_local_experts' \(32\) both name"):
        from_hf_config({"model_type": "qwen3_moe", **_GQA, "num_experts": 16, "num_local_experts": 32})


def test_moe_layers_per_family():
    qwen = from_hf_config({"model_type": "qwen2_moe", **_GQA, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                           "mlp_only_layers": [3]})
    assert qwen.moe_layers == (1, 5)
    assert from_hf_config({"model_type": "qwen2_moe", **_GQA, "num_experts": 0}).moe is None  # all dense
    dense_v3 = from_hf_config({"model_type": "deepseek_v3", **_MLA, "first_k_dense_replace": 2})
    assert dense_v3.moe_layers == () and dense_v3.moe is None
    # a V2 config with MoE layers must say how many experts a token takes (transformers' default: None)
    with pytest.raises(ModelConfigError, match="missing the field 'num_experts_per_tok'"):
        from_hf_config({"model_type": "deepseek_v2", **_MLA})


@pytest.mark.parametrize("changes, says", [
    (dict(top_k=9), r"MoE top_k 9 \(num_experts_per_tok\) exceeds the 8 routed experts"),
    (dict(n_group=3), "MoE n_group 3 does not divide the 8 routed experts"),
    (dict(n_group=2, topk_group=3), "MoE topk_group 3 exceeds n_group 2"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, top_k=3),
     "MoE top_k 3 exceeds the 2 experts in topk_group 1 of 4 groups of 2"),
    (dict(topk_method="noaux_tc", n_group=8, topk_group=8),
     "noaux_tc ranks groups by their top-2 scores: groups of 1 expert"),
    (dict(scoring_func="relu"), "MoE scoring_func 'relu' is not one of softmax, sigmoid, topk_softmax"),
    (dict(routed_scaling_factor=0.0), "MoE routed_scaling_factor must be a finite float32 number > 0, got 0.0"),
    (dict(shared_expert_gate=True), "shared_expert_gate needs a shared expert"),
    (dict(norm_topk_prob="yes"), "MoE norm_topk_prob must be true or false, got 'yes'"),
    (dict(intermediate_size=0), "MoE intermediate_size must be an integer in"),
])
def test_moe_config_refuses_what_cannot_route(changes, says):
    with pytest.raises(ModelConfigError, match=says):
        dataclasses.replace(MoEConfig(8, 2, 16), **changes)


def test_model_config_keeps_moe_and_moe_layers_together():
    mixtral = from_hf_config({"model_type": "mixtral", **_GQA})
    with pytest.raises(ModelConfigError, match=r"moe_layers \[0, 1\] need a MoEConfig"):
        mixtral.replace(moe=None)
    with pytest.raises(ModelConfigError, match="a MoEConfig \\(moe\\) needs moe_layers"):
        mixtral.replace(moe_layers=())
    with pytest.raises(ModelConfigError, match=r"moe_layers must be increasing layer indices in \[0, 2\)"):
        mixtral.replace(moe_layers=(0, 2))


# ---- parameter counts against transformers' own -----------------------------------------------------
COUNTED = {
    "mixtral": lambda: tf.MixtralConfig(**_GQA, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**{**_GQA, "num_hidden_layers": 3}, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                           mlp_only_layers=[1]),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_GQA, head_dim=24, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=16),
    "deepseek_v2": lambda: tf.DeepseekV2Config(**_MLA, n_routed_experts=8, num_experts_per_tok=2, mlp_bias=True,
                                               moe_intermediate_size=16, n_shared_experts=2),
    "deepseek_v3": lambda: tf.DeepseekV3Config(**{**_MLA, "q_lora_rank": 32}, n_routed_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=16, n_group=2, topk_group=1),
    "gpt_oss": lambda: tf.GptOssConfig(**_GQA, head_dim=16, num_local_experts=8, num_experts_per_tok=2),
}
MODELS = {"mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
          "deepseek_v2": tf.DeepseekV2ForCausalLM, "deepseek_v3": tf.DeepseekV3ForCausalLM,
          "gpt_oss": tf.GptOssForCausalLM}


@pytest.mark.parametrize("model_type", list(COUNTED))
def test_num_params_matches_transformers(model_type):
    ref = COUNTED[model_type]()
    model = MODELS[model_type](ref)
    config = from_hf_config(ref.to_dict())
    assert config.moe_layers and config.num_params == model.num_parameters()
