"""The published configs of attention + state-space hybrids (`MAMBA_CONFIGS`), vendored as data: each the
model fields of its config.json on the Hugging Face hub that kvjax.config.hf_mamba reads (token ids,
multipliers, initialisation and the like left out), parsed into `kvjax.config.presets.PRESETS` under the
same names. kvjax.accounting.hybrid's arithmetic on them is checked against vLLM 0.33's own functions
(experiments/vllm_mamba_reference.py; tests/accounting/test_mamba.py holds its table). Plain Python.

    preset               layers                                   attention           Mamba
    granite-4.0-h-tiny   40: attention at 5, 15, 25, 35; MoE 64×6   12 q / 4 kv × 128   Mamba2 48 × 64, G 1, N 128
    granite-4.0-h-small  40: the same pattern; MoE 72×10            32 q / 8 kv × 128   Mamba2 128 × 64, G 1, N 128
    nemotron-h-8b        52: 24 Mamba, 4 attention, 24 MLP          32 q / 8 kv × 128   Mamba2 128 × 64, G 8, N 128
    bamba-9b             32: attention at 9, 18, 27                 32 q / 8 kv × 128   Mamba2 128 × 64, G 1, N 128
    falcon-h1-0.5b       36, each attention and Mamba side by side  8 q / 2 kv × 64     Mamba2 24 × 64, G 1, N 128
    jamba-v0.1           32: attention at i % 8 == 4; MoE 16×2      32 q / 8 kv × 128   Mamba1 8192, N 16

Sources: https://huggingface.co/ibm-granite/granite-4.0-h-tiny, ibm-granite/granite-4.0-h-small,
nvidia/Nemotron-H-8B-Base-8K, ibm-ai-platform/Bamba-9B, tiiuae/Falcon-H1-0.5B-Instruct and
ai21labs/Jamba-v0.1 (config.json of each; Jamba-v0.1's is transformers' JambaConfig defaults, which its
docstring names as that checkpoint's).
"""
from __future__ import annotations

from typing import Any

_GRANITE_LAYERS = ["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3 + ["mamba"] * 4
_GRANITE_MAMBA = {"mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
                  "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False}
_GRANITE = {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 100352,
            "num_hidden_layers": 40, "layer_types": _GRANITE_LAYERS, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05, "position_embedding_type": "nope", "attention_bias": False,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", **_GRANITE_MAMBA}

MAMBA_CONFIGS: dict[str, dict[str, Any]] = {
    "granite-4.0-h-tiny": {**_GRANITE, "hidden_size": 1536, "intermediate_size": 512, "shared_intermediate_size": 1024,
                           "num_attention_heads": 12, "num_key_value_heads": 4, "num_local_experts": 64,
                           "num_experts_per_tok": 6, "mamba_n_heads": 48},
    "granite-4.0-h-small": {**_GRANITE, "hidden_size": 4096, "intermediate_size": 768,
                            "shared_intermediate_size": 1536, "num_attention_heads": 32, "num_key_value_heads": 8,
                            "num_local_experts": 72, "num_experts_per_tok": 10, "mamba_n_heads": 128},
    "nemotron-h-8b": {
        "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 131072,
        "hidden_size": 4096, "intermediate_size": 21504, "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "expand": 2, "chunk_size": 128, "use_conv_bias": True, "mamba_proj_bias": False, "mlp_hidden_act": "relu2",
        "attention_bias": False, "mlp_bias": False, "layer_norm_epsilon": 1e-05, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"},
    "bamba-9b": {
        "model_type": "bamba", "architectures": ["BambaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "attn_layer_indices": [9, 18, 27], "max_position_embeddings": 262144, "rms_norm_eps": 1e-05,
        "rope_theta": 10000, "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "falcon-h1-0.5b": {
        "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "vocab_size": 32784, "hidden_size": 1024,
        "intermediate_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 16384, "mamba_d_ssm": 1536, "mamba_n_heads": 24,
        "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_chunk_size": 128, "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_norm_before_gate": False,
        "mamba_rms_norm": False, "rope_theta": 100000000000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"},
    "jamba-v0.1": {
        "model_type": "jamba", "architectures": ["JambaForCausalLM"], "vocab_size": 65536, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 16, "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_dt_rank": 256, "mamba_conv_bias": True, "mamba_proj_bias": False, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}
MAMBA_TITLES = {"granite-4.0-h-tiny": "Granite-4.0-H-Tiny", "granite-4.0-h-small": "Granite-4.0-H-Small",
                "nemotron-h-8b": "Nemotron-H-8B", "bamba-9b": "Bamba-9B", "falcon-h1-0.5b": "Falcon-H1-0.5B",
                "jamba-v0.1": "Jamba-v0.1"}
