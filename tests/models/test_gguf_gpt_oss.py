"""gpt-oss GGUF files (llama.cpp's `gpt-oss` architecture; models.gguf_moe) against the safetensors checkpoint
of the same weights and against transformers.

The tiny gpt-oss of tests/moe_fixtures.py (4 layers, 0 and 2 sliding with a window of 5, 8 experts top-2,
sinks and biases perturbed, transformers' default YaRN) is written as llama.cpp's `GptOssModel` converter
writes it: gguf's TensorNameMap for the names (post_attention_layernorm → post_attention_norm, the router →
ffn_gate_inp with its bias, sinks → attn_sinks.weight), the fused experts transposed to ggml's [E, out, in]
and their interleaved gate/up rows split (`[:, ::2]` → ffn_gate_exps, `[:, 1::2]` → ffn_up_exps, the biases
likewise), no rotary permutation; metadata: the shape keys, key_length / value_length (head_dim),
sliding_window, expert_count / expert_used_count / expert_feed_forward_length and the YaRN keys
(rope.scaling.type, factor, original_context_length).

- float32 experts: every parameter kvjax loads from the file equals the one it loads from the safetensors
  folder, exactly, and the logits over 24 tokens (sliding layers included) equal transformers' within 2e-5 (7e-6 apart);
- F16, BF16 and MXFP4 experts: every expert parameter is gguf's dequantization of the stored blocks;
- MXFP4 experts repacked from the released checkpoints' `_blocks` / `_scales` as the converter repacks them
  (`repack_mxfp4`: the scale byte before the 16 code bytes, element j in the low nibble of byte j and j + 16
  in the high one) load to the parameters kvjax loads from that MXFP4 safetensors checkpoint, which
  tests/models/test_gpt_oss.py checks against transformers' dequantization, bit for bit;
- refused: gate and up experts that do not fit together, a file without sliding_window (naming the key).

transformers 5.24 cannot load these files (its rope.scaling reader fails on the first key; without those keys
it finds no tensor for the experts or the sinks), so the reference is its model of the safetensors weights.
"""
from __future__ import annotations

import types

import gguf
import numpy as np
import pytest
from hf_fixtures import hf_logits, save_hf_model
from moe_fixtures import make_gpt_oss_model
from test_gguf import finish, write_shape
from test_gguf_moe import TOKENS, _add, _logits, assert_same_params
from test_gpt_oss import _mxfp4_folder

from kvjax.models.gguf import GGUFFormatError
from kvjax.models.loader import load_checkpoint

Q = gguf.GGMLQuantizationType


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' MXFP4 (blocks u8[..., G, 16], low nibble first; scales u8[..., G]) → ggml's MXFP4 bytes
    u8[..., G · 17]: per block the scale byte, then element j in the low nibble of byte j, j + 16 in the high."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], packed], axis=-1).reshape(*blocks.shape[:-2], -1)


def write_gpt_oss_gguf(path, model, *, expert_type=Q.F32, mxfp4=None, window=True, cut_up=False):
    """`model` as llama.cpp's converter writes it (module docstring). expert_type: the ggml type of the expert
    weights; mxfp4: {HF name: array} of a checkpoint whose experts are `_blocks` / `_scales`, repacked instead;
    window: write attention.sliding_window; cut_up: store ffn_up_exps one row short (a corrupt file)."""
    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    write_shape(w, c)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if window:
        w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        data = tensor.numpy()
        base, _, suffix = hf.rpartition(".")
        layer = hf.split(".")[2] if hf.startswith("model.layers.") else None
        blk = f"blk.{layer}.ffn"
        if suffix in ("gate_up_proj", "down_proj") and mxfp4 is not None:
            blocks, scales = mxfp4[f"{hf}_blocks"], mxfp4[f"{hf}_scales"]  # [E, out, in / 32, 16], [E, out, in / 32]
            parts = {"down": (blocks, scales)} if suffix == "down_proj" else \
                {"gate": (blocks[:, ::2], scales[:, ::2]), "up": (blocks[:, 1::2], scales[:, 1::2])}
            for part, (b, s) in parts.items():
                w.add_tensor(f"{blk}_{part}_exps.weight", ggml_mxfp4(b, s), raw_dtype=Q.MXFP4)
        elif suffix == "gate_up_proj":  # [E, D, 2I] → [E, 2I, D], rows interleaved gate, up, gate, ...
            data = np.swapaxes(data, 1, 2)
            up = data[:, 1::2][:, 1 if cut_up else 0:]
            _add(w, f"{blk}_gate_exps.weight", data[:, ::2], expert_type)
            _add(w, f"{blk}_up_exps.weight", up, expert_type)
        elif suffix == "gate_up_proj_bias":  # [E, 2I]
            _add(w, f"{blk}_gate_exps.bias", data[:, ::2], Q.F32)
            _add(w, f"{blk}_up_exps.bias", data[:, 1::2], Q.F32)
        elif suffix == "down_proj":  # [E, I, D] → [E, D, I]
            _add(w, f"{blk}_down_exps.weight", np.swapaxes(data, 1, 2), expert_type)
        elif suffix == "down_proj_bias":
            _add(w, f"{blk}_down_exps.bias", data, Q.F32)
        elif suffix == "sinks":
            _add(w, f"blk.{layer}.attn_sinks.weight", data, Q.F32)
        else:
            _add(w, f"{names.get_name(base)}.{suffix}", data, Q.F32)
    finish(w)
    return str(path)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(transformers model, its float32 GGUF file, its safetensors folder)."""
    folder = tmp_path_factory.mktemp("gpt-oss")
    model = make_gpt_oss_model()
    return model, write_gpt_oss_gguf(folder / "gpt-oss.gguf", model), save_hf_model(model, str(folder / "hf"))


def test_gguf_loads_the_safetensors_weights_and_transformers_logits(case):
    model, path, folder = case
    config, params = load_checkpoint(path)
    want_config, want = load_checkpoint(folder, dtype="float32")
    assert config.model_type == want_config.model_type == "gpt_oss"
    assert config.moe == want_config.moe and config.moe_layers == want_config.moe_layers == (0, 1, 2, 3)
    assert config.layer_windows == want_config.layer_windows == (5, None, 5, None)
    assert (config.head_dim, config.num_kv_heads, config.qkv_bias, config.o_bias) == \
        (want_config.head_dim, want_config.num_kv_heads, want_config.qkv_bias, want_config.o_bias)
    rope, want_rope = config.rope, want_config.rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings, rope.beta_fast, rope.beta_slow,
            rope.truncate, rope.theta, rope.layout) == \
        (want_rope.rope_type, want_rope.factor, want_rope.original_max_position_embeddings, want_rope.beta_fast,
         want_rope.beta_slow, want_rope.truncate, want_rope.theta, want_rope.layout)
    assert_same_params(params, want)
    np.testing.assert_allclose(_logits(config, params, TOKENS), hf_logits(model, TOKENS), rtol=0, atol=2e-5)


def _interleaved(params, layer):
    """Layer `layer`'s expert weights in the file's terms: gate f32[E, I, D], up [E, I, D], down [E, D, I]."""
    experts = params[f"layers_{layer}"]["mlp"]["experts"]
    gate, up = np.split(np.asarray(experts["gate_up_proj"]), 2, axis=-1)  # [E, D, I] each
    return {"gate": np.swapaxes(gate, 1, 2), "up": np.swapaxes(up, 1, 2),
            "down": np.swapaxes(np.asarray(experts["down_proj"]), 1, 2)}


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.MXFP4], ids=lambda q: q.name)
def test_stored_experts_are_ggufs_dequantization(case, tmp_path, qtype):
    model = case[0]
    path = write_gpt_oss_gguf(tmp_path / f"{qtype.name}.gguf", model, expert_type=qtype)
    _, params = load_checkpoint(path)
    stored = {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.shape[::-1]))
              for t in gguf.GGUFReader(path).tensors}
    original = model.state_dict()["model.layers.0.mlp.experts.down_proj"].numpy()
    for layer in range(model.config.num_hidden_layers):
        for part, got in _interleaved(params, layer).items():
            kind, values = stored[f"blk.{layer}.ffn_{part}_exps.weight"]
            assert kind == qtype
            np.testing.assert_array_equal(got, values, err_msg=f"layer {layer} {part}")
    down = np.swapaxes(_interleaved(params, 0)["down"], 1, 2)  # back to [E, I, D]: close to, not equal to the F32
    assert 0 < np.abs(down - original).max() < 0.3 * np.abs(original).max()


def test_mxfp4_repacked_from_the_released_blocks_loads_as_the_safetensors_mxfp4(case, tmp_path):
    model, _, folder = case
    tensors = _mxfp4_folder(types.SimpleNamespace(folder=folder, hf=model), str(tmp_path / "mxfp4"))
    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", model, mxfp4=tensors)
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors if "_exps.weight" in t.name} == {Q.MXFP4}
    _, params = load_checkpoint(path)
    _, want = load_checkpoint(str(tmp_path / "mxfp4"), dtype="float32")
    assert_same_params(params, want)


def test_refusals(case, tmp_path):
    model = case[0]
    path = write_gpt_oss_gguf(tmp_path / "cut.gguf", model, cut_up=True)
    with pytest.raises(GGUFFormatError, match=r"\(blk.0.ffn_gate_exps.weight, F32 \+ blk.0.ffn_up_exps.weight, F32\) "
                                              r"do not fit side by side as 'model.layers.0.mlp.experts.gate_up_proj'"):
        load_checkpoint(path)
    path = write_gpt_oss_gguf(tmp_path / "no-window.gguf", model, window=False)
    with pytest.raises(GGUFFormatError, match="has no metadata field 'gpt-oss.attention.sliding_window'"):
        load_checkpoint(path)
