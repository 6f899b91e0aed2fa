"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2` architecture; models.gguf_moe) against the safetensors
checkpoints of the same weights and against transformers.

transformers has no deepseek2 GGUF mapping, so the files are written here as llama.cpp's `DeepseekV2Model`
converter writes them (convert_hf_to_gguf.py): gguf's TensorNameMap for the names, each MoE layer's experts
stacked into ffn_{gate,up,down}_exps, the shared experts as ffn_*_shexp, e_score_correction_bias as
exp_probs_b.bias, kv_b_proj viewed [N, nope + v, R] and split into attn_k_b (transposed to [N, R, nope]) and
attn_v_b [N, v, R], no rotary permutation; metadata: head_count_kv 1, key_length R + rope and value_length R
(MLA as MQA over the latent), key_length_mla / value_length_mla, q_lora_rank / kv_lora_rank,
rope.dimension_count, leading_dense_block_count, expert_{count, used_count, shared_count,
feed_forward_length, weights_scale, gating_func, group_count, group_used_count}, expert_weights_norm when
true, and for YaRN rope.scaling.{type, factor, original_context_length, yarn_log_multiplier = 0.1 ·
mscale_all_dim}. `legacy` writes a file of the converter before the split: attn_kv_b whole, head_count_kv N,
key_length nope + rope and value_length v, no `_mla` keys.

The models are tests/moe_fixtures.py's, every one with MoE layers after a dense layer 0:

    deepseek-v2        softmax, greedy, no q LoRA, routed_scaling_factor 1.5, 2 shared experts
    deepseek-v2-group  group_limited_greedy over 2 groups, q LoRA; 3 layers
    deepseek-v3        sigmoid, noaux_tc (exp_probs_b), 4 groups / 2, norm_topk_prob, scaling 2.5, and YaRN
                       (factor 4 over 32 positions, mscale = mscale_all_dim = 0.707: GGUF keeps one of the two)

In float32 every parameter kvjax loads from the GGUF file equals the one it loads from save_pretrained's
safetensors folder, exactly, the routing config is the same, and the logits over 24 tokens equal
transformers' within 2e-5 (they are 5e-6 apart). Refused: k_b and v_b that do not fit together, an
expert_gating_func other than softmax / sigmoid, key_length_mla not above the rope dims (each naming what
it read).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from hf_fixtures import hf_logits, random_model, save_hf_model
from moe_fixtures import moe_config
from test_gguf import finish
from test_gguf_moe import TOKENS, _add, _logits, assert_same_params

from kvjax.models.gguf import GGUFFormatError
from kvjax.models.loader import load_checkpoint

Q = gguf.GGMLQuantizationType
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707, mscale_all_dim=0.707,
            original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0)
CASES = ("deepseek-v2", "deepseek-v2-group", "deepseek-v3", "deepseek-v2-legacy")


def make_model(name: str):
    """The fixture model of `name` (deepseek-v2-legacy: deepseek-v2's), deepseek-v3 with YaRN RoPE."""
    config, cls = moe_config(name.removesuffix("-legacy"))
    if name == "deepseek-v3":
        config.rope_parameters = dict(YARN)
    return random_model(config, cls)


def write_deepseek2_gguf(path, model, *, legacy=False, gating=None, cut_v=False, key_length_mla=None):
    """`model` as llama.cpp's converter writes a DeepSeek model (module docstring). gating: the
    expert_gating_func to write instead of the model's; cut_v: store attn_v_b one latent lane short;
    key_length_mla: write this instead of qk_nope + qk_rope (corrupt files)."""
    c = model.config
    v3 = c.model_type == "deepseek_v3"
    heads, nope, rope_dim, v_dim, rank = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                          c.v_head_dim, c.kv_lora_rank)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(heads if legacy else 1)  # the converter sets num_key_value_heads = 1 (MLA as MQA)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(rank)
    if legacy:
        w.add_key_length(nope + rope_dim)
        w.add_value_length(v_dim)
    else:
        w.add_key_length(rank + rope_dim)
        w.add_value_length(rank)
        w.add_key_length_mla(key_length_mla or nope + rope_dim)
        w.add_value_length_mla(v_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    if c.n_group is not None:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    kind = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX  # config.json's scoring_func
    w.add_uint32(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=w.arch), int(kind if gating is None else gating))
    w.add_rope_dimension_count(rope_dim)
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        data = tensor.numpy()
        base, _, suffix = hf.rpartition(".")
        if suffix == "e_score_correction_bias":  # the converter: e_score_correction.bias
            base, suffix = f"{base}.e_score_correction", "bias"
        if suffix == "gate_up_proj":  # [E, 2I, D]: the converter stacks each expert's gate and up apart
            gate, up = np.split(data, 2, axis=1)
            _add(w, f"{names.get_name(base + '.gate_proj')}.weight", gate, Q.F32)
            _add(w, f"{names.get_name(base + '.up_proj')}.weight", up, Q.F32)
        elif suffix == "down_proj" and base.endswith("experts"):  # [E, D, I]
            _add(w, f"{names.get_name(base + '.down_proj')}.weight", data, Q.F32)
        elif base.endswith("kv_b_proj") and not legacy:
            kv_b = data.reshape(heads, nope + v_dim, rank)
            k_b, v_b = np.swapaxes(kv_b[:, :nope], 1, 2), kv_b[:, nope:]  # [N, R, nope], [N, v, R]
            _add(w, f"{names.get_name(base.replace('kv_b', 'k_b'))}.weight", k_b, Q.F32)
            _add(w, f"{names.get_name(base.replace('kv_b', 'v_b'))}.weight", v_b[..., 1:] if cut_v else v_b, Q.F32)
        else:
            _add(w, f"{names.get_name(base)}.{suffix}", data, Q.F32)
    finish(w)
    return str(path)


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    """(name, transformers model, its GGUF file, its safetensors folder)."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = make_model(name)
    path = write_deepseek2_gguf(folder / f"{name}.gguf", model, legacy=name.endswith("legacy"))
    return name, model, path, save_hf_model(model, str(folder / "hf"))


def test_gguf_loads_the_safetensors_weights_and_transformers_logits(case):
    name, model, path, folder = case
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert ("blk.1.attn_kv_b.weight" in names) == name.endswith("legacy") != ("blk.1.attn_k_b.weight" in names)
    config, params = load_checkpoint(path)
    want_config, want = load_checkpoint(folder, dtype="float32")
    assert config.model_type == want_config.model_type == ("deepseek_v3" if name == "deepseek-v3" else "deepseek_v2")
    assert config.moe == want_config.moe and config.moe_layers == want_config.moe_layers and config.moe_layers[0] == 1
    fields = ("num_heads", "num_kv_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "qkv_bias", "o_bias", "tie_word_embeddings", "max_position_embeddings")
    assert {f: getattr(config, f) for f in fields} == {f: getattr(want_config, f) for f in fields}
    rope, want_rope = config.rope, want_config.rope
    assert (rope.rope_type, rope.layout, rope.factor, rope.original_max_position_embeddings) == \
        (want_rope.rope_type, want_rope.layout, want_rope.factor, want_rope.original_max_position_embeddings)
    if rope.rope_type == "yarn":  # 0.1 · 0.707 stored as float32, read back / 0.1
        np.testing.assert_allclose([rope.mscale, rope.mscale_all_dim], [0.707, 0.707], rtol=1e-6)
    assert_same_params(params, want)
    np.testing.assert_allclose(_logits(config, params, TOKENS), hf_logits(model, TOKENS), rtol=0, atol=2e-5)


def test_refusals(tmp_path):
    model = make_model("deepseek-v2")
    path = write_deepseek2_gguf(tmp_path / "cut.gguf", model, cut_v=True)
    with pytest.raises(GGUFFormatError, match=r"\(blk.0.attn_k_b.weight, F32 \+ blk.0.attn_v_b.weight, F32\) do not "
                                              r"fit side by side as 'model.layers.0.self_attn.kv_b_proj.weight'"):
        load_checkpoint(path)
    path = write_deepseek2_gguf(tmp_path / "gating.gguf", model, gating=3)
    with pytest.raises(GGUFFormatError, match=r"deepseek2.expert_gating_func must be an integer in \[1, 2\], got 3"):
        load_checkpoint(path)
    path = write_deepseek2_gguf(tmp_path / "mla.gguf", model, key_length_mla=8)
    with pytest.raises(GGUFFormatError, match=r"deepseek2.attention.key_length_mla must be more than "
                                              r"rope.dimension_count \(8\): qk_nope \+ qk_rope head dims, got 8"):
        load_checkpoint(path)
