"""The presets with sliding-window layers (kvjax.config.presets): Gemma-3-27B, Gemma-3-270M, Gemma-2-9B,
gpt-oss-20b / -120b and Mistral-7B-v0.1.

The expected values are hand-copied from the published config.json files (huggingface.co/<repo>/blob/main/
config.json; Gemma-3-27B: its text_config), with transformers' config-class defaults where a file omits a
field, and gpt-oss's parameter counts of arXiv:2508.10925; none is taken from the preset code. The
same dicts built into transformers' own config classes (Gemma3TextConfig, Gemma2Config, GptOssConfig,
MistralConfig) give the same layer types, window and head_dim.
"""
import json
import subprocess
import sys

import pytest

from kvjax.config.hf import from_hf_config
from kvjax.config.presets import HF_CONFIGS, OMITTED_DEFAULTS, PRESETS, preset

NEW = ["gemma-3-27b", "gemma-3-270m", "gemma-2-9b", "gpt-oss-20b", "gpt-oss-120b", "mistral-7b-v0.1"]

_GEMMA = dict(rms_norm_eps=1e-6, dtype="bfloat16", tie_word_embeddings=True, qkv_bias=False, o_bias=False,
              moe_layers=(), published_params=None)
_GPT_OSS = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_heads=64,
                num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=128,
                dtype="bfloat16", tie_word_embeddings=False, qkv_bias=True, o_bias=True, hidden_act="silu")
EXPECTED = {
    # google/gemma-3-27b-it text_config: vocab_size, max_position_embeddings and rms_norm_eps are
    # Gemma3TextConfig's defaults (the file omits them); torch_dtype is the file's top-level one
    "gemma-3-27b": dict(_GEMMA, model_type="gemma3_text", title="Gemma-3-27B", vocab_size=262208, hidden_size=5376,
                        intermediate_size=21504, num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128,
                        max_position_embeddings=131072, sliding_window=1024, hidden_act="gelu_pytorch_tanh"),
    "gemma-3-270m": dict(_GEMMA, model_type="gemma3_text", title="Gemma-3-270M", vocab_size=262144, hidden_size=640,
                         intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
                         max_position_embeddings=32768, sliding_window=512, hidden_act="gelu_pytorch_tanh"),
    "gemma-2-9b": dict(_GEMMA, model_type="gemma2", title="Gemma-2-9B", vocab_size=256000, hidden_size=3584,
                       intermediate_size=14336, num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                       max_position_embeddings=8192, sliding_window=4096, hidden_act="gelu_pytorch_tanh"),
    "gpt-oss-20b": dict(_GPT_OSS, title="gpt-oss-20b", num_layers=24, moe_layers=tuple(range(24)),
                        published_params=None),  # counted: "21B parameters with 3.6B active"
    "gpt-oss-120b": dict(_GPT_OSS, title="gpt-oss-120b", num_layers=36, moe_layers=tuple(range(36)),
                         published_params=None),  # counted: "117B parameters with 5.1B active"
    "mistral-7b-v0.1": dict(model_type="mistral", title="Mistral-7B-v0.1", vocab_size=32000, hidden_size=4096,
                            intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                            max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=4096, dtype="bfloat16",
                            tie_word_embeddings=False, qkv_bias=False, o_bias=False, hidden_act="silu", moe_layers=(),
                            published_params=None),
}
# (rope_type, theta, factor) of the full-attention layers; gpt-oss's YaRN: original 4096, beta 32 / 1, no truncation
ROPE = {"gemma-3-27b": ("linear", 1e6, 8.0), "gemma-3-270m": ("default", 1e6, None),
        "gemma-2-9b": ("default", 1e4, None), "gpt-oss-20b": ("yarn", 150000.0, 32.0),
        "gpt-oss-120b": ("yarn", 150000.0, 32.0), "mistral-7b-v0.1": ("default", 1e4, None)}
# Fields of the config.json files that the KV layout does not use, as published (Gemma-3-27B's caps: defaults)
CONFIG_FIELDS = {
    "gemma-3-27b": dict(query_pre_attn_scalar=168, attn_logit_softcapping=None, final_logit_softcapping=None),
    "gemma-3-270m": dict(query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None,
                         rope_local_base_freq=10000.0),
    "gemma-2-9b": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gpt-oss-20b": dict(num_local_experts=32, experts_per_token=4, num_experts_per_tok=4, attention_bias=True),
    "gpt-oss-120b": dict(num_local_experts=128, experts_per_token=4, num_experts_per_tok=4, attention_bias=True),
    "mistral-7b-v0.1": dict(rope_theta=10000.0),
}


def _full_every_6th(layers):
    return tuple(i for i in range(layers) if (i + 1) % 6)


SLIDING = {"gemma-3-27b": _full_every_6th(62), "gemma-3-270m": _full_every_6th(18),
           "gemma-2-9b": tuple(range(0, 42, 2)), "gpt-oss-20b": tuple(range(0, 24, 2)),
           "gpt-oss-120b": tuple(range(0, 36, 2)), "mistral-7b-v0.1": tuple(range(32))}


def test_registry_holds_the_new_presets_by_name():
    names = list(PRESETS)
    assert names[names.index(NEW[0]):][:len(NEW)] == NEW and list(HF_CONFIGS) == NEW
    assert [preset(n).name for n in NEW] == NEW and preset("Gemma-3-27B") is PRESETS["gemma-3-27b"]


@pytest.mark.parametrize("name", NEW)
def test_fields_are_the_published_configs(name):
    p = preset(name)
    assert {f: getattr(p, f) for f in EXPECTED[name]} == EXPECTED[name]
    rope_type, theta, factor = ROPE[name]
    assert (p.rope.rope_type, p.rope.theta, p.rope.factor) == (rope_type, theta, factor)
    if rope_type == "yarn":
        r = p.rope
        assert (r.original_max_position_embeddings, r.beta_fast, r.beta_slow, r.truncate) == (4096, 32.0, 1.0, False)
    cfg = HF_CONFIGS[name]
    assert {k: cfg[k] for k in CONFIG_FIELDS[name]} == CONFIG_FIELDS[name]
    # the preset is the parser's reading of its dict: nothing added on the side but its name and title
    assert from_hf_config(cfg).replace(name=name, title=p.title, published_params=p.published_params) == p


@pytest.mark.parametrize("name", NEW)
def test_sliding_layers(name):
    p = preset(name)
    assert p.sliding_layers == SLIDING[name]
    assert p.layer_windows == tuple(p.sliding_window if i in SLIDING[name] else None for i in range(p.num_layers))
    full = [i for i in range(p.num_layers) if i not in SLIDING[name]]
    assert full == {"gemma-3-27b": list(range(5, 62, 6)), "gemma-3-270m": [5, 11, 17],
                    "gemma-2-9b": list(range(1, 42, 2)), "gpt-oss-20b": list(range(1, 24, 2)),
                    "gpt-oss-120b": list(range(1, 36, 2)), "mistral-7b-v0.1": []}[name]


CLASSES = {"gemma-3-27b": "Gemma3TextConfig", "gemma-3-270m": "Gemma3TextConfig", "gemma-2-9b": "Gemma2Config",
           "gpt-oss-20b": "GptOssConfig", "gpt-oss-120b": "GptOssConfig", "mistral-7b-v0.1": "MistralConfig"}


@pytest.mark.parametrize("name", NEW)
def test_transformers_config_classes_read_the_same_dicts_the_same(name):
    import transformers

    ref = getattr(transformers, CLASSES[name])(**HF_CONFIGS[name])
    p = preset(name)
    # MistralConfig has no layer_types: a window applies to every layer
    types = getattr(ref, "layer_types", None) or ["sliding_attention"] * ref.num_hidden_layers
    assert p.sliding_layers == tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert (p.sliding_window, p.head_dim, p.num_kv_heads, p.num_heads, p.num_layers) == \
        (ref.sliding_window, ref.head_dim, ref.num_key_value_heads, ref.num_attention_heads, ref.num_hidden_layers)
    assert (p.vocab_size, p.max_position_embeddings, p.tie_word_embeddings, p.rms_norm_eps) == \
        (ref.vocab_size, ref.max_position_embeddings, ref.tie_word_embeddings, ref.rms_norm_eps)
    rope = ref.rope_parameters.get("full_attention", ref.rope_parameters)
    assert (p.rope.rope_type, p.rope.theta, p.rope.factor) == \
        (rope["rope_type"], float(rope["rope_theta"]), rope.get("factor"))
    if "gemma" in name:
        assert ref.query_pre_attn_scalar == CONFIG_FIELDS[name]["query_pre_attn_scalar"]
        assert (ref.attn_logit_softcapping, ref.final_logit_softcapping) == \
            (CONFIG_FIELDS[name]["attn_logit_softcapping"], CONFIG_FIELDS[name]["final_logit_softcapping"])
    if "gpt-oss" in name:
        assert (ref.num_local_experts, ref.num_experts_per_tok, ref.attention_bias) == \
            (CONFIG_FIELDS[name]["num_local_experts"], 4, True)


@pytest.mark.parametrize("name", NEW)
def test_omitted_fields_are_transformers_defaults(name):
    """What the presets fill in for a field the file leaves out is what transformers' class sets."""
    import transformers

    published = {k: v for k, v in HF_CONFIGS[name].items() if k not in OMITTED_DEFAULTS[name]}
    ref = getattr(transformers, CLASSES[name])(**published)
    renamed = {"rope_theta": lambda r: r.rope_parameters["full_attention"]["rope_theta"],
               "rope_local_base_freq": lambda r: r.rope_parameters["sliding_attention"]["rope_theta"],
               "sliding_window_pattern": lambda r: r._sliding_window_pattern}
    for key, value in OMITTED_DEFAULTS[name].items():
        assert renamed.get(key, lambda r: getattr(r, key))(ref) == value, key
    assert set(OMITTED_DEFAULTS["gemma-3-27b"]) >= {"vocab_size", "max_position_embeddings", "rope_theta"}


def test_parameter_counts():
    # Mistral-7B-v0.1: 2 × 32000 × 4096 untied embeddings + 32 × (attention 4096 × (4096 + 2 × 1024) + 4096 × 4096,
    # MLP 3 × 4096 × 14336, 2 norms) + the final norm
    assert preset("mistral-7b-v0.1").num_params == 2 * 32000 * 4096 + 32 * (
        4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 4096 == 7_241_732_096
    # Gemma-2-9B: tied embeddings; q 16 × 256, k and v 8 × 256 each; four norms a layer
    assert preset("gemma-2-9b").num_params == 256000 * 3584 + 42 * (
        3584 * (4096 + 2 * 2048) + 4096 * 3584 + 3 * 3584 * 14336 + 4 * 3584) + 3584 == 9_241_705_984
    # gpt-oss: every layer MoE, every expert counted: arXiv:2508.10925 Table 1's 20.91B and 116.83B, the model
    # cards' 21B and 117B (tests/config/test_moe_presets.py checks them against transformers' own count)
    assert [preset(n).num_params for n in ("gpt-oss-20b", "gpt-oss-120b")] == [20_914_757_184, 116_829_156_672]


def _plan_json(*args):
    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "plan", *args, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_the_weights_budget_counts_every_expert():
    got = _plan_json("--preset", "gpt-oss-20b", "--device-memory-gib", "141")
    assert got["weights_bytes"] == 2 * 20_914_757_184  # bf16
    assert got["budget_bytes"] == got["requested_bytes"] - 2 * 20_914_757_184
    got = _plan_json("--preset", "gpt-oss-20b", "--device-memory-gib", "141", "--weight-dtype", "int4")
    assert got["weights_bytes"] == 20_914_757_184 // 2
