"""Tiny random-init transformers models, saved as Hugging Face folders, for kvjax's tests.

Every model is built offline from a config object (HF_HUB_OFFLINE=1), with weights drawn
larger than transformers' default (initializer_range 0.15, so logits and attention scores are
O(1) and a wrong mask or a wrong page shows up) and with RMSNorm weights and biases perturbed
away from their 1 / 0 initial values (so a dropped bias or norm weight shows up too).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402

torch.set_num_threads(1)

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            initializer_range=0.15)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
           first_k_dense_replace=2)  # every layer dense
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707, mscale_all_dim=1.0,
            original_max_position_embeddings=32, beta_fast=32, beta_slow=1)
LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)


def _config(name: str):
    """(transformers config, model class) for one named test case."""
    if name == "llama-mha":
        return tf.LlamaConfig(**BASE, num_key_value_heads=4), tf.LlamaForCausalLM
    if name == "llama-gqa":  # also llama3 rope scaling
        return tf.LlamaConfig(**BASE, num_key_value_heads=2, rope_parameters=LLAMA3), tf.LlamaForCausalLM
    if name == "llama-mqa":  # also tied embeddings
        return (tf.LlamaConfig(**BASE, num_key_value_heads=1, tie_word_embeddings=True), tf.LlamaForCausalLM)
    if name == "qwen2":
        return tf.Qwen2Config(**BASE, num_key_value_heads=2), tf.Qwen2ForCausalLM
    if name == "qwen3":  # explicit head_dim: heads × head_dim ≠ hidden
        return tf.Qwen3Config(**BASE, num_key_value_heads=2, head_dim=24), tf.Qwen3ForCausalLM
    if name == "deepseek-v3":  # q_lora_rank set, yarn with mscale, interleaved rope
        return (tf.DeepseekV3Config(**BASE, **MLA, q_lora_rank=32, n_group=1, topk_group=1, rope_parameters=YARN,
                                    max_position_embeddings=128), tf.DeepseekV3ForCausalLM)
    if name == "deepseek-v3-noq":  # q_lora_rank None: a single q_proj; rope_interleave off
        return (tf.DeepseekV3Config(**BASE, **MLA, q_lora_rank=None, n_group=1, topk_group=1,
                                    rope_interleave=False), tf.DeepseekV3ForCausalLM)
    if name == "deepseek-v2":  # complex-pair rope, yarn
        return (tf.DeepseekV2Config(**BASE, **MLA, q_lora_rank=None, rope_parameters=YARN,
                                    max_position_embeddings=128), tf.DeepseekV2ForCausalLM)
    return _sliding_config(name)


CASES = ("llama-mha", "llama-gqa", "llama-mqa", "qwen2", "qwen3", "deepseek-v3", "deepseek-v3-noq", "deepseek-v2")

# Models mixing sliding-window and full attention, with windows of a few tokens so that a test's
# sequences run several windows long. SLIDE: 3 layers, so a full layer sits between sliding ones.
SLIDE = {**BASE, "num_hidden_layers": 3, "num_key_value_heads": 2}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def _sliding_config(name: str):
    if name == "mistral-window":  # every layer slides
        return tf.MistralConfig(**SLIDE, sliding_window=6), tf.MistralForCausalLM
    if name == "qwen2-window":  # layers >= max_window_layers slide: 1 and 2
        return (tf.Qwen2Config(**SLIDE, use_sliding_window=True, sliding_window=5, max_window_layers=1),
                tf.Qwen2ForCausalLM)
    if name == "qwen3-window":  # layer 2 slides; q/k norms, head_dim 16 ≠ hidden / heads
        return (tf.Qwen3Config(**SLIDE, head_dim=16, use_sliding_window=True, sliding_window=7, max_window_layers=2),
                tf.Qwen3ForCausalLM)
    if name == "gemma2":  # layers 0 and 2 slide; soft-caps small enough to bend the scores and logits
        return (tf.Gemma2Config(**SLIDE, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0), tf.Gemma2ForCausalLM)
    if name == "gemma3":  # 5 sliding to 1 full (layer 5), then sliding again; local and global RoPE
        return (tf.Gemma3TextConfig(**{**SLIDE, "num_hidden_layers": 7}, head_dim=16, sliding_window=5,
                                    query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE), tf.Gemma3ForCausalLM)
    if name == "gemma3-capped":  # 4 layers (pattern 2: 0 and 2 slide), a final soft-cap
        return (tf.Gemma3TextConfig(**{**SLIDE, "num_hidden_layers": 4}, head_dim=16, sliding_window=4,
                                    sliding_window_pattern=2, final_logit_softcapping=3.0,
                                    rope_parameters=GEMMA3_ROPE), tf.Gemma3ForCausalLM)
    raise KeyError(name)


SLIDING_CASES = ("mistral-window", "qwen2-window", "qwen3-window", "gemma2", "gemma3", "gemma3-capped")


def make_hf_model(name: str, seed: int = 0):
    """A random-init transformers model for case `name` (eval mode, eager attention, fp32)."""
    return random_model(*_config(name), seed)


def random_model(config, cls, seed: int = 0):
    """cls(config) in eval mode with eager attention, seeded; its norm weights and biases are moved
    off their initial 1 / 0 (a test must not pass because a norm is the identity), and so is a
    DeepSeek-V3 router's e_score_correction_bias buffer (zeros would never change a choice)."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def save_hf_model(model, folder: str, **kwargs) -> str:
    model.save_pretrained(folder, **kwargs)
    return folder


def hf_logits(model, tokens) -> np.ndarray:
    """f32[S, V] logits of one sequence from transformers (no cache)."""
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens)[None], dtype=torch.long)).logits[0].float().numpy()


def hf_greedy(hf, prompt, max_new: int, margin: float):
    """(tokens, comparable length): transformers' greedy continuation of max_new tokens and how many
    of them come before the first near-tie (a step whose top-2 logit margin is below margin)."""
    hf.generation_config.eos_token_id = None  # random weights: never stop early
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in out.scores]
    near = [i for i, m in enumerate(margins) if m < margin]
    return tokens, (near[0] if near else max_new)


def random_tokens(seed: int, n: int, vocab: int = 128):
    """n token ids in [0, vocab), seeded."""
    return np.random.RandomState(seed).randint(0, vocab, size=n).astype(np.int32)


def random_tables(seed: int, lengths, num_blocks: int, block_size: int) -> list[list[int]]:
    """Disjoint block tables for sequences of `lengths` tokens, drawn from a random permutation of
    the usable blocks 1..num_blocks-1 (block 0 is the null block)."""
    free = list(np.random.RandomState(seed).permutation(np.arange(1, num_blocks)))
    return [[int(free.pop()) for _ in range(-(-n // block_size))] for n in lengths]
