"""Mixture-of-experts GGUF files (models.gguf, models.gguf_moe) against the safetensors checkpoints of
the same weights and against transformers.

The tiny Qwen2-MoE (gated shared expert, q/k/v biases; every layer sparse, as llama.cpp builds it),
Qwen3-MoE (q/k norms, head_dim from key_length) and Mixtral models of tests/moe_fixtures.py are written
as GGUF files the way llama.cpp's convert_hf_to_gguf.py writes them: gguf's TensorNameMap for the names,
each layer's experts stacked into blk.N.ffn_{gate,up,down}_exps ([E, I, D], [E, I, D], [E, D, I] in
torch's order), the shared expert's gate as a vector, Mixtral as a llama file with expert_count (q and
k permuted, `LlamaModel.permute`), Qwen unpermuted; the expert widths as expert_feed_forward_length and
expert_shared_feed_forward_length. In float32:

- every parameter kvjax loads from the GGUF file equals the one it loads from save_pretrained's
  safetensors folder, exactly, and the logits over a 24-token sequence equal transformers' within 1e-4;
- transformers' own GGUF loader (qwen2moe and qwen3moe; it reads a llama file's experts as a dense
  Llama, so not Mixtral) loads the same logits from the same file. It does not read the experts' widths
  from the file (its mapping has no expert_feed_forward_length), so it is given the config;
- with the experts stored Q8_0, every expert parameter is gguf's dequantization of the stored blocks;
- refused: a qwen2moe file without expert_feed_forward_length (naming the key), a MoE architecture kvjax
  does not read (dbrx), YaRN in a llama file, gate and up expert tensors that do not fit side by side or
  join to the wrong shape.

gpt-oss and deepseek2 files: tests/models/test_gguf_gpt_oss.py and test_gguf_deepseek.py.
"""
from __future__ import annotations

import os

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers as tf
from hf_fixtures import hf_logits, save_hf_model
from moe_fixtures import make_moe_model, moe_config
from test_gguf import finish, llama_permute, write_shape

from kvjax.attention.metadata import build_metadata
from kvjax.models import build_model
from kvjax.models.gguf import GGUFArchitectureError, GGUFFile, GGUFFormatError
from kvjax.models.loader import load_checkpoint
from kvjax.models.tensors import ShapeMismatchError
from kvjax.worker.model_runner import make_step
from kvjax.worker.paged_cache import PagedCache

Q = gguf.GGMLQuantizationType
ARCH = {"qwen2-moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3-moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA}
TOKENS = [int(t) for t in np.random.RandomState(0).randint(0, 128, 24)]


def assert_same_params(params, want) -> None:
    """Every leaf of params array-equal to want's, in order (the failing one named by its path)."""
    got_leaves = jax.tree_util.tree_leaves_with_path(params)
    want_leaves = jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for (where, got), expected in zip(got_leaves, want_leaves):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=jax.tree_util.keystr(where))

def _logits(config, params, tokens) -> np.ndarray:
    """f32[S, V]: one prefill of `tokens` through the paged cache (blocks of 4, table 1, 2, ...)."""
    blocks = -(-len(tokens) // 4)
    md = build_metadata([0], [len(tokens)], [list(range(1, blocks + 1))], block_size=4, max_tokens=len(tokens),
                        max_seqs=1, max_blocks_per_seq=blocks)
    cache = PagedCache.create(config.kv_spec(), blocks + 1, 4)
    logits, _ = make_step(build_model(config))(params, np.asarray(tokens, np.int32), md, cache)
    return np.asarray(logits)


def make_model(name: str):
    """The fixture model of `name`; Qwen2-MoE's with every layer sparse (the fixture's layer 1 is dense, which
    llama.cpp's qwen2moe cannot hold), drawn as moe_fixtures draws it."""
    if name != "qwen2-moe":
        return make_moe_model(name)
    config, cls = moe_config(name)
    config.mlp_only_layers = []
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def write_moe_gguf(path, model, name, *, expert_type=Q.F32, widths=True, cut_up=None, yarn=False):
    """`model` as a GGUF file, as llama.cpp's converter writes a MoE model (module docstring). expert_type: the
    ggml type of the stacked experts; widths: write expert_feed_forward_length (and the shared expert's);
    cut_up: store ffn_up_exps one "row" or one "expert" short of ffn_gate_exps (corrupt files); yarn: say
    rope.scaling.type yarn, which only gpt-oss and deepseek2 files may."""
    c = model.config
    arch = ARCH[name]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    write_shape(w, c)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    if widths and name != "mixtral":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if name == "qwen2-moe":
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        data = tensor.numpy()
        base, _, suffix = hf.rpartition(".")
        if suffix == "gate_up_proj":  # [E, 2I, D]: llama.cpp stores the gate and the up halves apart
            layer = base.split(".")[2]
            gate, up = np.split(data, 2, axis=1)
            up = {None: up, "row": up[:, 1:], "expert": up[1:]}[cut_up]
            for part, array in (("gate", gate), ("up", up)):
                _add(w, f"blk.{layer}.ffn_{part}_exps.weight", array, expert_type)
            continue
        if suffix == "down_proj" and base.endswith("experts"):  # [E, D, I]
            _add(w, f"blk.{base.split('.')[2]}.ffn_down_exps.weight", data, expert_type)
            continue
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if name == "mixtral" and ".attn_q." in gguf_name:
            data = llama_permute(data, c.num_attention_heads)
        elif name == "mixtral" and ".attn_k." in gguf_name:
            data = llama_permute(data, c.num_key_value_heads)
        elif gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            data = data[0]  # a vector [D], as llama.cpp holds it
        _add(w, gguf_name, data, Q.F32)
    finish(w)
    return str(path)


def _add(writer, name, data, qtype):
    if qtype == Q.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data, np.float32), qtype), raw_dtype=qtype)


@pytest.fixture(scope="module", params=["qwen2-moe", "qwen3-moe", "mixtral"])
def case(request, tmp_path_factory):
    """(name, transformers model, its GGUF file, its safetensors folder)."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = make_model(name)
    return name, model, write_moe_gguf(folder / f"{name}.gguf", model, name), save_hf_model(model, str(folder / "hf"))


def test_gguf_loads_the_safetensors_weights_and_transformers_logits(case):
    name, model, path, folder = case
    config, params = load_checkpoint(path)
    want_config, want = load_checkpoint(folder, dtype="float32")
    assert config.model_type == want_config.model_type == {"qwen2-moe": "qwen2_moe", "qwen3-moe": "qwen3_moe",
                                                           "mixtral": "mixtral"}[name]
    assert config.moe == want_config.moe and config.moe_layers == want_config.moe_layers
    assert (config.qkv_bias, config.qk_norm, config.head_dim) == (want_config.qkv_bias, want_config.qk_norm,
                                                                  want_config.head_dim)
    assert_same_params(params, want)
    np.testing.assert_allclose(_logits(config, params, TOKENS), hf_logits(model, TOKENS), rtol=0, atol=1e-4)


def test_transformers_reads_the_same_file_to_the_same_logits(case):
    name, model, path, _ = case
    if name == "mixtral":
        pytest.skip("transformers reads a llama GGUF file with experts as a dense Llama (no expert mapping)")
    loaded = tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     config=model.config, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(loaded, TOKENS), hf_logits(model, TOKENS), rtol=0, atol=1e-5)


def test_quantized_experts_are_ggufs_dequantization(tmp_path):
    model = make_model("qwen3-moe")
    path = write_moe_gguf(tmp_path / "q8.gguf", model, "qwen3-moe", expert_type=Q.Q8_0)
    _, params = load_checkpoint(path)
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    for layer in range(model.config.num_hidden_layers):
        experts = params[f"layers_{layer}"]["mlp"]["experts"]  # [E, D, 2I] and [E, I, D], Flax's [in, out]
        gate, up = (stored[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up"))  # [E, I, D]
        np.testing.assert_array_equal(np.asarray(experts["gate_up_proj"]),
                                      np.swapaxes(np.concatenate([gate, up], axis=1), 1, 2))
        np.testing.assert_array_equal(np.asarray(experts["down_proj"]),
                                      np.swapaxes(stored[f"blk.{layer}.ffn_down_exps.weight"], 1, 2))
    original = model.state_dict()["model.layers.0.mlp.experts.down_proj"].numpy()  # Q8_0: close, not equal
    assert 0 < np.abs(np.swapaxes(np.asarray(params["layers_0"]["mlp"]["experts"]["down_proj"]), 1, 2)
                      - original).max() < 0.02 * np.abs(original).max()


def test_refusals(tmp_path):
    model = make_model("qwen2-moe")
    path = write_moe_gguf(tmp_path / "no-width.gguf", model, "qwen2-moe", widths=False)
    with pytest.raises(GGUFFormatError, match="has no metadata field 'qwen2moe.expert_feed_forward_length'"):
        load_checkpoint(path)
    path = write_moe_gguf(tmp_path / "row.gguf", model, "qwen2-moe", cut_up="row")  # joins, to the wrong shape
    with pytest.raises(ShapeMismatchError, match=r"'model.layers.0.mlp.experts.gate_up_proj' in row.gguf \(blk.0."
                                                 r"ffn_gate_exps.weight, F32 \+ blk.0.ffn_up_exps.weight, F32\): "
                                                 r"expected shape \[8, 64, 64\], found \[8, 63, 64\]"):
        load_checkpoint(path)
    path = write_moe_gguf(tmp_path / "expert.gguf", model, "qwen2-moe", cut_up="expert")  # does not join
    with pytest.raises(GGUFFormatError, match=r"\(blk.0.ffn_gate_exps.weight, F32 \+ blk.0.ffn_up_exps.weight, F32\) "
                                              r"do not fit side by side as 'model.layers.0.mlp.experts.gate_up_proj'"):
        load_checkpoint(path)
    path = write_moe_gguf(tmp_path / "yarn.gguf", make_model("mixtral"), "mixtral", yarn=True)
    with pytest.raises(GGUFArchitectureError, match=r"llama.rope.scaling.type 'yarn' is not supported \(only none "
                                                    r"and linear; yarn on gpt-oss and deepseek2\)"):
        load_checkpoint(path)
    w = gguf.GGUFWriter(str(tmp_path / "dbrx.gguf"), "dbrx")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    finish(w)
    with pytest.raises(GGUFArchitectureError, match="holds a 'dbrx' model .* kvjax loads only 'llama' / 'gemma2' "
                                                    "/ 'gemma3' / 'qwen2moe' / 'qwen3moe' / 'gpt-oss' / 'deepseek2'"):
        GGUFFile(tmp_path / "dbrx.gguf")
