"""The preset registry: `PRESETS` by name, and `preset(name)`.

Tiny configs for tests (GQA, MHA, MQA and MLA), and the published configs of SPEC Tables 1-2
(Llama-2/3, SmolLM2, DeepSeek-V3) for random-weight benchmarks and the tables: each a
`kvjax.config.model.ModelConfig`. Plain Python, no JAX.
"""
from __future__ import annotations

from kvjax.config.model import ModelConfig, ModelConfigError, RopeConfig

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
