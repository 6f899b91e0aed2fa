"""kvjax.config: the Hugging Face parser (hf), the preset registry (presets), parameter counts (model).

Expected numbers are the models' published parameter counts, transformers' own
`num_parameters()`, or the KV formula f × L × Hkv × D × b written out by hand; none is taken
from the code under test.
"""
import json
import subprocess
import sys

import pytest

from kvjax.config.hf import from_hf_config
from kvjax.config.model import ModelConfig, ModelConfigError, RopeConfig, RopeError
from kvjax.config.presets import PRESETS, preset
from kvjax.core.kv_cache_interface import SpecError

KiB = 1024


# ---- presets ---------------------------------------------------------------------------------
# Published counts (transformers' num_parameters() of the released checkpoints; DeepSeek-V3: its
# model card's 671B, which tests/config/test_moe_presets.py checks at the card's rounding).
PUBLISHED_PARAMS = {"llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_num_params_matches_published_counts(name):
    assert preset(name).num_params == PUBLISHED_PARAMS[name]


def test_presets_are_counted_not_looked_up():
    assert [n for n, p in PRESETS.items() if p.published_params is not None] == []


def test_preset_registry():
    assert list(PRESETS) == ["tiny", "tiny-mha", "tiny-mqa", "tiny-mla", "tiny-moe", "tiny-moe-mla", "tiny-long",
                             "llama-2-7b", "llama-3-8b", "llama-3-70b", "smollm2-135m", "deepseek-v3", "gemma-3-27b",
                             "gemma-3-270m", "gemma-2-9b", "gpt-oss-20b", "gpt-oss-120b", "mistral-7b-v0.1",
                             "deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b", "tiny-gpt-oss", "granite-4.0-h-tiny",
                             "granite-4.0-h-small", "nemotron-h-8b", "bamba-9b", "falcon-h1-0.5b", "jamba-v0.1",
                             "tiny-bamba"]
    assert preset("Llama-3-8B") is preset("llama-3-8b")
    assert [preset(n).title for n in (*PUBLISHED_PARAMS, "deepseek-v3")] == ["Llama-2-7B", "Llama-3-8B", "Llama-3-70B",
                                                                            "DeepSeek-V3"]
    with pytest.raises(ModelConfigError, match="unknown model preset 'llama-9'; choose one of tiny, "):
        preset("llama-9")


# The released config.json values (Llama 3.1's for the Llama 3 presets: same shapes, 128K context).
LLAMA2_7B_JSON = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                  "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16"}
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA31_8B_JSON = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                   "rope_scaling": LLAMA31_ROPE, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA31_70B_JSON = {**LLAMA31_8B_JSON, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64}
DEEPSEEK_V3_JSON = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "n_routed_experts": 256}


@pytest.mark.parametrize("name, published", [("llama-2-7b", LLAMA2_7B_JSON), ("llama-3-8b", LLAMA31_8B_JSON),
                                             ("llama-3-70b", LLAMA31_70B_JSON), ("deepseek-v3", DEEPSEEK_V3_JSON)])
def test_presets_are_their_published_configs(name, published):
    p = preset(name)
    parsed = from_hf_config(published, dtype="bfloat16")
    assert parsed.replace(name=p.name, title=p.title, published_params=p.published_params) == p


def test_deepseek_v3_preset_rope_and_moe():
    ds = preset("deepseek-v3")
    assert (ds.rope.rope_type, ds.rope.factor, ds.rope.original_max_position_embeddings) == ("yarn", 40, 4096)
    assert (ds.rope.mscale, ds.rope.mscale_all_dim, ds.rope.layout) == (1, 1, "interleaved")
    assert ds.moe_layers == tuple(range(3, 61)) and ds.dtype == "bfloat16"


# ---- KV layout through the one parser (ModelConfig → kv_spec) ---------------------------------
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16"}
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}
QWEN3_ODD = {"model_type": "qwen3", "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 256}  # explicit head_dim ≠ hidden / heads = 128
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536}
MISTRAL_NO_KV = {"model_type": "mistral", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16}


def _write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def _kv(path_or_dict, kv_dtype=None):
    return from_hf_config(path_or_dict).kv_spec(kv_dtype)


def test_hf_llama(tmp_path):
    spec = _kv(_write(tmp_path, LLAMA3_8B))
    assert (spec.kind, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == ("gqa", 32, 32, 8, 128)
    assert spec.bytes_per_token == 128 * KiB
    assert spec.name == tmp_path.name  # the folder holding config.json


def test_hf_qwen3_explicit_head_dim(tmp_path):
    assert _kv(_write(tmp_path, QWEN3_8B)).bytes_per_token == 2 * 36 * 8 * 128 * 2
    spec = _kv(_write(tmp_path, QWEN3_ODD))
    assert spec.head_dim == 256  # never overwritten by 2048 / 16
    assert spec.bytes_per_token == 2 * 4 * 8 * 256 * 2


def test_hf_deepseek_v3(tmp_path):
    spec = _kv(_write(tmp_path, DEEPSEEK_V3))
    assert (spec.kind, spec.num_kv_heads, spec.head_dim) == ("mla", 1, 576)
    assert spec.bytes_per_token == 61 * 576 * 2
    assert _kv(tmp_path).bytes_per_token == spec.bytes_per_token  # a folder works too
    assert _kv(tmp_path, "fp8").bytes_per_token == 61 * 576


def test_hf_kv_heads_default_to_heads(tmp_path):
    spec = _kv(_write(tmp_path, MISTRAL_NO_KV))
    assert (spec.kind, spec.num_kv_heads, spec.head_dim) == ("mha", 16, 64)


@pytest.mark.parametrize("cfg, message", [
    ({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}, "missing the field 'num_attention_heads'"),
    ({"model_type": "gpt2", "num_hidden_layers": 2, "num_attention_heads": 2}, "unsupported model_type 'gpt2'"),
    ({"num_hidden_layers": 2}, "missing the field 'model_type'"),
    ({**LLAMA3_8B, "num_key_value_heads": "eight"}, "'num_key_value_heads' must be a positive integer"),
    ({**LLAMA3_8B, "num_key_value_heads": 5}, "num_kv_heads 5 does not divide num_heads 32"),
    ({**LLAMA3_8B, "hidden_size": 4100}, "hidden_size 4100 is not a multiple of num_attention_heads 32"),
    ({**LLAMA3_8B, "torch_dtype": "int4"}, "dtype 'int4' is not one of"),
    ({**DEEPSEEK_V3, "kv_lora_rank": None}, "missing the field 'kv_lora_rank'"),
    ({**LLAMA3_8B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope needs factor"),
])
def test_hf_bad_fields(tmp_path, cfg, message):
    with pytest.raises(ModelConfigError, match=message) as e:
        from_hf_config(_write(tmp_path, cfg))
    assert isinstance(e.value, SpecError)  # callers sizing a cache catch one error type


def test_hf_bad_files(tmp_path):
    with pytest.raises(ModelConfigError, match="does not exist"):
        from_hf_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        from_hf_config(bad)


def test_num_params_needs_what_it_counts():
    with pytest.raises(ModelConfigError, match="counting parameters needs vocab_size and intermediate_size"):
        from_hf_config(QWEN3_ODD).num_params


def test_moe_models_are_counted_with_every_expert():
    # DeepSeek-V3: every routed expert of the 58 MoE layers resident, the model card's 671B (tests/config/
    # test_moe_config.py checks the count against transformers' num_parameters() of tiny models)
    assert abs(preset("deepseek-v3").num_params - 671e9) < 1e-4 * 671e9


# ---- every model type kvjax sizes: parsed, features recorded, refused only when built ---------
MIXTRAL = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "sliding_window": None, "rope_theta": 1e6}
QWEN2_MOE = {"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
             "decoder_sparse_step": 2, "mlp_only_layers": [3]}
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
             "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
GEMMA_7B = {"model_type": "gemma", "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
            "hidden_act": "gelu"}
PHI3_128K = {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "sliding_window": 262144,
             "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}}
KIMI_K2 = {**DEEPSEEK_V3_JSON, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
           "first_k_dense_replace": 1, "vocab_size": 163840}


def test_every_sized_model_type_parses_and_records_its_features():
    mixtral = from_hf_config(MIXTRAL)
    assert mixtral.moe_layers == tuple(range(32)) and mixtral.kv_spec().bytes_per_token == 128 * KiB
    qwen2_moe = from_hf_config(QWEN2_MOE)  # sparse where (i + 1) % 2 == 0, except mlp_only layer 3
    assert qwen2_moe.moe_layers == (1, 5) and (qwen2_moe.qkv_bias, qwen2_moe.o_bias) == (True, False)
    qwen3_moe = from_hf_config(QWEN3_MOE)
    assert qwen3_moe.moe_layers == (0, 1, 2, 3) and qwen3_moe.qk_norm
    assert qwen3_moe.kv_spec().bytes_per_token == 2 * 4 * 4 * 128 * 2
    gemma = from_hf_config(GEMMA_7B)
    assert (gemma.hidden_act, gemma.tie_word_embeddings, gemma.head_dim) == ("gelu", True, 256)
    phi3 = from_hf_config(PHI3_128K)
    assert phi3.rope.rope_type == "longrope" and phi3.sliding_layers == tuple(range(32))
    assert phi3.kv_spec().bytes_per_token == 2 * 32 * 32 * 96 * 2
    kimi = from_hf_config(KIMI_K2)
    assert kimi.is_mla and kimi.moe_layers == tuple(range(1, 61)) and kimi.rope.layout == "interleaved"
    assert kimi.kv_spec().bytes_per_token == 61 * 576 * 2
    partial = from_hf_config({**LLAMA3_8B, "model_type": "phi3", "partial_rotary_factor": 0.75})
    assert partial.rope.partial_rotary_factor == 0.75


GPT_OSS = {"model_type": "gpt_oss", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}


@pytest.mark.parametrize("cfg, feature", [
    (GEMMA_7B, r"model_type 'gemma' is not implemented \(Gemma's RMSNorm"),
    ({**PHI3_128K, "sliding_window": None}, r"model_type 'phi3' is not implemented \(Phi-3 .* fused qkv_proj"),
    ({**LLAMA3_8B, "hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(only silu / SwiGLU\)"),
    ({**LLAMA3_8B, "rope_scaling": {"type": "longrope"}}, r"unsupported rope_type 'longrope'; supported: default"),
    ({**LLAMA3_8B, "partial_rotary_factor": 0.5}, r"partial_rotary_factor 0.5 is not supported"),
    (QWEN3_ODD, r"the config gives no vocab_size and intermediate_size"),
])
def test_unbuildable_features_are_refused_by_name_when_building(cfg, feature):
    from kvjax.models.layers import UnsupportedModelError, check_supported  # imports JAX: only here
    config = from_hf_config(cfg)  # parsing accepts it: a KV cache can be sized
    config.kv_spec()
    with pytest.raises(UnsupportedModelError, match=feature):
        check_supported(config)


def test_moe_models_are_not_refused():
    from kvjax.models.layers import check_supported  # imports JAX: only here
    for cfg in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, KIMI_K2, DEEPSEEK_V3_JSON, GPT_OSS):
        check_supported(from_hf_config(cfg))


def test_inv_freq_refuses_a_rope_it_cannot_compute():
    from kvjax.models.rope import inv_freq
    with pytest.raises(RopeError, match="unsupported rope_type 'dynamic'"):
        inv_freq(RopeConfig("dynamic", factor=2.0), 16, 128)


def test_validation_in_the_dataclass():
    base = preset("tiny")
    with pytest.raises(ModelConfigError, match="head_dim must be a positive integer, got 0"):
        base.replace(head_dim=0)
    with pytest.raises(ModelConfigError, match="vocab_size must be a positive integer or None, got -1"):
        base.replace(vocab_size=-1)
    with pytest.raises(ModelConfigError, match="unsupported model_type 'gpt2'"):
        base.replace(model_type="gpt2")
    with pytest.raises(RopeError, match="unknown rope layout 'spiral'"):
        RopeConfig(layout="spiral")
    assert base.replace(hidden_act="gelu").hidden_act == "gelu"  # recorded; refused when built


# ---- parameter counts against the models themselves ---------------------------------------------
@pytest.mark.parametrize("case", ["llama-mqa", "qwen2", "qwen3", "deepseek-v3", "deepseek-v2"])
def test_num_params_matches_transformers(case):
    from hf_fixtures import make_hf_model
    model = make_hf_model(case)
    assert from_hf_config(model.config.to_dict()).num_params == model.num_parameters()


@pytest.mark.parametrize("name", ["tiny", "tiny-mqa", "tiny-mla"])
def test_num_params_matches_the_flax_parameter_tree(name):
    import math

    import jax

    from kvjax.models import build_model, param_shapes
    config = preset(name).replace(qk_norm=name == "tiny", qkv_bias=name == "tiny-mla", o_bias=name == "tiny-mla")
    leaves = jax.tree_util.tree_leaves(param_shapes(build_model(config)))
    assert config.num_params == sum(math.prod(x.shape) for x in leaves)


def test_models_reexports_the_one_registry():
    from kvjax import models
    assert models.PRESETS is PRESETS and models.preset is preset and models.ModelConfig is ModelConfig
    assert models.from_hf_config is from_hf_config and models.ModelConfigError is ModelConfigError


def test_plan_and_tables_do_not_import_jax():
    code = ("import sys, kvjax.commands.main, kvjax.commands.plan, kvjax.commands.tables, kvjax.config.model, "
            "kvjax.config.presets, kvjax.config.hf, kvjax.accounting.spec_tables; "
            "print(sorted(m for m in ('jax', 'flax', 'numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Sliding layers as transformers' own config classes mark them (layer_types), for the model types whose
# pattern is a rule: Gemma 2 and gpt-oss alternate, Gemma 3 slides 5 layers in every 6.
SLIDING_CONFIGS = [
    ("Gemma2Config", {"model_type": "gemma2", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                      "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2}),
    ("Gemma3TextConfig", {"model_type": "gemma3_text", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                          "num_hidden_layers": 14, "num_attention_heads": 4, "num_key_value_heads": 1,
                          "head_dim": 128, "sliding_window": 512}),
    ("Gemma3TextConfig", {"model_type": "gemma3_text", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                          "num_hidden_layers": 9, "num_attention_heads": 4, "num_key_value_heads": 1,
                          "sliding_window_pattern": 3}),
    ("Gemma3TextConfig", {"model_type": "gemma3_text", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
                          "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]}),
    ("GptOssConfig", {"model_type": "gpt_oss", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 256,
                      "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 2}),
]


@pytest.mark.parametrize("cls, cfg", SLIDING_CONFIGS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(SLIDING_CONFIGS)])
def test_sliding_layers_match_transformers_layer_types(cls, cfg):
    import transformers

    ref = getattr(transformers, cls)(**cfg)
    got = from_hf_config(cfg)
    assert got.sliding_layers == tuple(i for i, t in enumerate(ref.layer_types) if t == "sliding_attention")
    assert got.sliding_window == ref.sliding_window and got.head_dim == ref.head_dim
    assert got.num_kv_heads == ref.num_key_value_heads
    assert got.layer_windows == tuple(ref.sliding_window if t == "sliding_attention" else None
                                      for t in ref.layer_types)


def test_sliding_configs_parse_and_what_does_not_build():
    from kvjax.models import UnsupportedModelError, build_model

    gemma3 = from_hf_config({**SLIDING_CONFIGS[1][1], "sliding_window": None})  # no window: every layer full
    assert gemma3.sliding_layers == () and gemma3.layer_windows == (None,) * 14
    with pytest.raises(UnsupportedModelError, match="sliding_window null"):  # transformers' own mask refuses it
        build_model(gemma3)
    with pytest.raises(ModelConfigError, match="use_bidirectional_attention makes it an encoder"):
        from_hf_config({**SLIDING_CONFIGS[1][1], "use_bidirectional_attention": True})
    with pytest.raises(ModelConfigError, match="'layer_types' must list 'sliding_attention' or 'full_attention' for "
                                               "each of the 4 layers"):
        from_hf_config({**SLIDING_CONFIGS[3][1], "layer_types": ["full_attention", "chunked_attention"] * 2})
    gpt_oss = build_model(from_hf_config(SLIDING_CONFIGS[4][1]))  # sinks, MoE, alternating windows of 128
    assert type(gpt_oss).__name__ == "GptOssForCausalLM" and gpt_oss.config.layer_windows == (128, None) * 2 + (128,)
