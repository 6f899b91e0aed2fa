"""Tiny random-init attention + Mamba hybrids of each family transformers 5 builds (Bamba, Granite-4.0-H with
and without experts, Nemotron-H, Falcon-H1, Jamba), for kvjax's tests. Built offline from config objects; the
shapes are small enough for CPU and large enough that a wrong group, head or chunk shows: 8 Mamba heads of 16
channels in 2 groups, an SSD chunk of 8 tokens, a 4-wide causal convolution.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers as tf  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            initializer_range=0.15, max_position_embeddings=256)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
             mamba_chunk_size=8)


def hybrid_config(name: str):
    """(transformers config, model class) for one named tiny hybrid."""
    if name == "bamba":
        return tf.BambaConfig(**BASE, **MAMBA, num_hidden_layers=4, attn_layer_indices=[1]), tf.BambaForCausalLM
    if name in ("granite", "granite-dense"):
        experts = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32) if name == "granite" else \
            dict(num_local_experts=0)
        return tf.GraniteMoeHybridConfig(**{**BASE, **experts}, **MAMBA, num_hidden_layers=4, shared_intermediate_size=64,
                                         layer_types=["mamba", "attention", "mamba", "mamba"],
                                         position_embedding_type="nope", embedding_multiplier=2.0,
                                         attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0,
                                         tie_word_embeddings=True), tf.GraniteMoeHybridForCausalLM
    if name == "nemotron_h":
        return tf.NemotronHConfig(**BASE, head_dim=16, hybrid_override_pattern="M-*M", mamba_num_heads=8,
                                  mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8,
                                  num_hidden_layers=4), tf.NemotronHForCausalLM
    if name == "falcon_h1":
        return tf.FalconH1Config(**BASE, head_dim=16, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4,
                                 mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                                 mamba_chunk_size=8, mamba_rms_norm=True), tf.FalconH1ForCausalLM
    if name == "jamba":
        return tf.JambaConfig(**BASE, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                              expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                              mamba_d_state=8, mamba_d_conv=4, mamba_expand=2), \
            tf.JambaForCausalLM
    raise KeyError(name)


NAMES = ("bamba", "granite", "granite-dense", "nemotron_h", "falcon_h1", "jamba")
