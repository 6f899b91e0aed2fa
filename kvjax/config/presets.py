"""The preset registry: `PRESETS` by name, and `preset(name)`.

Tiny configs for tests (GQA, MHA, MQA and MLA, tiny-long with 32K positions of Llama 3.1's rope
scaling, and three mixture-of-experts ones: Qwen3-MoE-,
DeepSeek-V3- and gpt-oss-shaped), the published configs
of SPEC Tables 1-2 (Llama-2/3, SmolLM2, DeepSeek-V3) for random-weight benchmarks and the tables, models
with sliding-window layers for the hybrid KV cache (Gemma 2 and 3, gpt-oss, Mistral-7B-v0.1), and
mixture-of-experts models (DeepSeek-V3, DeepSeek-V2-Lite, Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss), attention +
Mamba hybrids (Granite-4.0-H tiny and small, Nemotron-H-8B, Bamba-9B, Falcon-H1-0.5B, Jamba-v0.1): each a
`kvjax.config.model.ModelConfig`. The hybrid and MoE ones are their config.json files (`HF_CONFIGS`,
`MOE_CONFIGS`) read by `kvjax.config.hf.from_hf_config`, so a preset and the real file parse the same.
Every published preset's parameter count is counted from its shapes (`ModelConfig.num_params`, every
expert resident), never looked up. Plain Python, no JAX.
"""
from __future__ import annotations

from typing import Any

from kvjax.config.hf import from_hf_config
from kvjax.config.mamba_presets import MAMBA_CONFIGS, MAMBA_TITLES
from kvjax.config.model import ModelConfig, ModelConfigError, MoEConfig, RopeConfig

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             max_position_embeddings=256)
_TINY_MLA = dict(_TINY, model_type="deepseek_v3", num_kv_heads=4, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope=RopeConfig(layout="interleaved"))
# Tiny mixture-of-experts models: Qwen3-MoE's shape (every layer MoE, q/k norms, top-2 of 8 renormalised,
# no shared expert) and DeepSeek-V3's (MLA, layer 0 dense as first_k_dense_replace says, sigmoid scores
# with noaux_tc over 4 groups of which 2 are used, one shared expert). Each expert is 32 wide, so TP 2 and
# 4 split it (kvjax.worker.sharding).
_TINY_QWEN3_MOE = MoEConfig(8, 2, 32, norm_topk_prob=True, f32_weights=False)
_TINY_V3_MOE = MoEConfig(8, 2, 32, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                         norm_topk_prob=True, routed_scaling_factor=2.5, shared_intermediate_size=32, router_f32=True)
# A random-weight stand-in for a long-context model (`kvjax accuracy --model preset:tiny-long`, the
# 16K passkey and long-window tests): tiny's shapes with Llama 3.1's rope scaling stretching 4K
# pretrained positions over 32K, and a vocabulary of 256 so that every id of the byte tokenizer a
# preset gets (models.hub) is a token of the model.
_TINY_LONG_ROPE = RopeConfig("llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=4096)
# https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json, its model fields (token ids, auto_map,
# quantization_config and the like left out; num_nextn_predict_layers 1, the 14B multi-token-prediction
# module that the checkpoint adds, is not part of the decoder): 671B parameters, as the model card says.
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
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
    "tiny-moe": ModelConfig("qwen3_moe", num_kv_heads=2, head_dim=16, qk_norm=True, moe_layers=(0, 1),
                            moe=_TINY_QWEN3_MOE, name="tiny-moe", **_TINY),
    "tiny-moe-mla": ModelConfig(moe_layers=(1,), moe=_TINY_V3_MOE, name="tiny-moe-mla", **_TINY_MLA),
    "tiny-long": ModelConfig("llama", num_kv_heads=2, head_dim=16, rope=_TINY_LONG_ROPE, name="tiny-long",
                             **dict(_TINY, vocab_size=256, max_position_embeddings=32768)),
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
    "deepseek-v3": from_hf_config(_DEEPSEEK_V3).replace(name="deepseek-v3", title="DeepSeek-V3"),
}


# ---- models with sliding-window layers: their config.json files, parsed ---------------------------
# Each dict is the published config.json's model fields (token ids, initializer_range, use_cache,
# transformers_version, quantization_config and the like left out). `OMITTED_DEFAULTS` are the
# fields a file leaves out, as transformers' config class fills them in when it loads the file (its
# __init__ defaults), written in so that the parser sees what transformers sees.
_GEMMA3_27B_TEXT = {  # text_config of https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json
    "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    "torch_dtype": "bfloat16"}  # the file's top-level torch_dtype (the text_config names none)
_GEMMA3_270M = {  # https://huggingface.co/google/gemma-3-270m/blob/main/config.json
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh",
    "attention_bias": False, "query_pre_attn_scalar": 256, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": None, "sliding_window": 512, "_sliding_window_pattern": 6,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "use_bidirectional_attention": False,
    "torch_dtype": "bfloat16"}
# https://huggingface.co/google/gemma-2-9b/blob/main/config.json. Its torch_dtype is not copied (no
# stored copy of the base checkpoint's file was found; gemma-2-9b-it's says bfloat16): the parser's
# default, bfloat16, is what vLLM serves it in either way (vllm/config/model.py _resolve_auto_dtype
# downcasts a float32 checkpoint to bfloat16).
_GEMMA2_9B = {
    "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rope_theta": 10000.0,
    "sliding_window": 4096, "sliding_window_size": 4096}
# https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json; the file names no torch_dtype
# (the MoE weights are MXFP4, the rest bfloat16, the parser's default).
_GPT_OSS_20B = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "hidden_act": "silu", "attention_bias": True,
    "num_local_experts": 32, "experts_per_token": 4, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
    "initial_context_length": 4096, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "tie_word_embeddings": False}
# https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json: gpt-oss-20b's but for these
_GPT_OSS_120B = {**_GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                 "layer_types": ["sliding_attention", "full_attention"] * 18}
_MISTRAL_7B = {  # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "hidden_act": "silu", "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

OMITTED_DEFAULTS: dict[str, dict[str, Any]] = {
    # transformers' Gemma3TextConfig: 262,208 embeddings, 128K positions, rope_theta 1e6 for the full
    # layers (scaled by the file's rope_scaling) and rope_local_base_freq 1e4 for the sliding ones, 5
    # sliding layers in every 6, tied embeddings, no soft-caps.
    "gemma-3-27b": {"vocab_size": 262208, "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
                    "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "tie_word_embeddings": True,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "gemma-3-270m": {"tie_word_embeddings": True},  # Gemma3TextConfig's default
    "gemma-2-9b": {"tie_word_embeddings": True},  # Gemma2Config's default
    "gpt-oss-20b": {}, "gpt-oss-120b": {}, "mistral-7b-v0.1": {},
}
_PUBLISHED = {"gemma-3-27b": _GEMMA3_27B_TEXT, "gemma-3-270m": _GEMMA3_270M, "gemma-2-9b": _GEMMA2_9B,
              "gpt-oss-20b": _GPT_OSS_20B, "gpt-oss-120b": _GPT_OSS_120B, "mistral-7b-v0.1": _MISTRAL_7B}
# The config.json each hybrid preset is parsed from: the file's fields over transformers' defaults.
HF_CONFIGS: dict[str, dict[str, Any]] = {name: {**OMITTED_DEFAULTS[name], **cfg} for name, cfg in _PUBLISHED.items()}
_TITLES = {"gemma-3-27b": "Gemma-3-27B", "gemma-3-270m": "Gemma-3-270M", "gemma-2-9b": "Gemma-2-9B",
           "gpt-oss-20b": "gpt-oss-20b", "gpt-oss-120b": "gpt-oss-120b", "mistral-7b-v0.1": "Mistral-7B-v0.1"}
# gpt-oss counts 20,914,757,184 and 116,829,156,672 parameters (num_params), arXiv:2508.10925 Table 1's
# 20.91B and 116.83B, the model cards' "21B" and "117B" (https://huggingface.co/openai/gpt-oss-20b, -120b).
# The weights budget counts them at --weight-dtype (bf16 by default), which is more than the MXFP4
# checkpoints' 12.8 / 60.8 GiB (--weights-gib for those).
PRESETS.update({name: from_hf_config(cfg).replace(name=name, title=_TITLES[name]) for name, cfg in HF_CONFIGS.items()})


# ---- mixture-of-experts models: their config.json files, parsed ------------------------------------
# The published files' model fields, as above; every field the parser reads is in the file (nothing
# omitted), and the counts below are num_params (tests/config/test_moe_presets.py checks each against
# the model card's total at the card's rounding).
# https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json: MLA without q LoRA, 64 routed
# experts (top 6, softmax, not renormalised) and 2 shared ones in every layer but the first;
# 15,706,484,224 parameters, the card's "15.7B".
_DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
    "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: 48 layers, every one MoE (128 experts of
# width 768, top 8, renormalised), 32 query heads over 4 kv heads of 128 dims; 30,532,122,624 parameters,
# the card's "30.5B".
_QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False, "hidden_act": "silu",
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json: 8 experts of width 14336 in
# every layer, top 2; 46,702,792,704 parameters, the "46.7B total parameters" of Mistral's announcement
# (https://mistral.ai/news/mixtral-of-experts).
_MIXTRAL_8X7B = {
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# The config.json of each MoE preset (gpt-oss's are in HF_CONFIGS, with the sliding-window models).
MOE_CONFIGS: dict[str, dict[str, Any]] = {"deepseek-v3": _DEEPSEEK_V3, "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
                                          "qwen3-30b-a3b": _QWEN3_30B_A3B, "mixtral-8x7b": _MIXTRAL_8X7B}
_MOE_TITLES = {"deepseek-v2-lite": "DeepSeek-V2-Lite", "qwen3-30b-a3b": "Qwen3-30B-A3B", "mixtral-8x7b": "Mixtral-8x7B"}
PRESETS.update({name: from_hf_config(MOE_CONFIGS[name]).replace(name=name, title=title)
                for name, title in _MOE_TITLES.items()})
# gpt-oss-20b's config at the tiny models' size, float32 (random weights: `kvjax accuracy --model
# preset:tiny-gpt-oss` and the tests): 4 layers alternating sliding (window 8) and full, 4 query heads
# over 2 kv heads with biases and learned sinks, 8 experts top 2 of width 32 with biases and the clamped
# SwiGLU, gpt-oss's YaRN RoPE.
_TINY_GPT_OSS = {**_GPT_OSS_20B, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "max_position_embeddings": 256, "num_local_experts": 8, "experts_per_token": 2,
                 "num_experts_per_tok": 2, "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention"] * 2, "torch_dtype": "float32"}
PRESETS["tiny-gpt-oss"] = from_hf_config(_TINY_GPT_OSS).replace(name="tiny-gpt-oss")
# Attention + state-space hybrids (Granite-4.0-H, Nemotron-H, Bamba, Falcon-H1, Jamba): their config.json
# files (kvjax.config.mamba_presets), parsed
PRESETS.update({name: from_hf_config(cfg).replace(name=name, title=MAMBA_TITLES[name])
                for name, cfg in MAMBA_CONFIGS.items()})
# A tiny Bamba (3 Mamba2 layers of 8 heads in 2 groups around 1 attention layer), for random-weight runs
PRESETS["tiny-bamba"] = from_hf_config({
    "model_type": "bamba", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "attn_layer_indices": [1],
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_chunk_size": 8, "torch_dtype": "float32"}).replace(name="tiny-bamba")


def preset(name: str) -> ModelConfig:
    """A registered config by name (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[key]
