"""The Hugging Face loader: what it loads, and each refusal with its message."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_fixtures import make_hf_model, save_hf_model
from safetensors.numpy import load_file, save_file

from kvjax.config.model import ModelConfigError
from kvjax.models import UnsupportedModelError, build_model, from_hf_config
from kvjax.models.loader import hf_name, load_checkpoint
from kvjax.models.tensors import (CheckpointError, MissingTensorError, PickledWeightsError, ShapeMismatchError,
                                  UnexpectedTensorError)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return save_hf_model(make_hf_model("llama-gqa"), str(tmp_path_factory.mktemp("llama")))


@pytest.fixture
def folder(hf_folder, tmp_path):
    """A fresh copy of the checkpoint that a test may corrupt."""
    return shutil.copytree(hf_folder, tmp_path / "ckpt")


def _rewrite(folder, change):
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_loads_every_tensor_transposed_where_flax_needs(hf_folder):
    config, params = load_checkpoint(hf_folder, dtype="float32")
    hf = load_file(os.path.join(hf_folder, "model.safetensors"))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    assert len(leaves) == len(hf)
    for path, leaf in leaves:
        name, transposed = hf_name(path)
        np.testing.assert_array_equal(np.asarray(leaf), hf[name].T if transposed else hf[name], err_msg=name)
    assert config.num_kv_heads == 2 and config.rope.rope_type == "llama3"


def test_sharded_checkpoint_equals_single_file(hf_folder, tmp_path):
    sharded = save_hf_model(make_hf_model("llama-gqa"), str(tmp_path / "sharded"), max_shard_size="40KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    _, a = load_checkpoint(hf_folder, dtype="float32")
    _, b = load_checkpoint(sharded, dtype="float32")
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def test_missing_shard_is_named(tmp_path):
    sharded = save_hf_model(make_hf_model("llama-gqa"), str(tmp_path / "sharded"), max_shard_size="40KB")
    shard = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(CheckpointError, match=f"names shard '{shard}', which is missing"):
        load_checkpoint(sharded)


def test_checkpoint_dtype_is_kept_unless_overridden(tmp_path):
    folder = save_hf_model(make_hf_model("llama-gqa").to(torch.bfloat16), str(tmp_path / "bf16"))
    config, params = load_checkpoint(folder)
    assert config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    config, params = load_checkpoint(folder, dtype="float32")
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.float32)}


def test_refuses_pickled_weights(folder):
    os.remove(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "pytorch_model.bin"), "wb") as fh:
        fh.write(b"not opened")  # the loader must refuse without reading it
    with pytest.raises(PickledWeightsError, match=r"refusing to load pickled weights \(pytorch_model.bin\): "
                                                  r"unpickling .* can execute arbitrary code"):
        load_checkpoint(folder)
    with pytest.raises(PickledWeightsError, match="arbitrary code"):
        load_checkpoint(os.path.join(folder, "pytorch_model.bin"))


def test_safetensors_win_over_a_pickle_beside_them(folder):
    with open(os.path.join(folder, "pytorch_model.bin"), "wb") as fh:
        fh.write(b"never read")
    load_checkpoint(folder, dtype="float32")


def test_shape_mismatch_names_tensor_and_shapes(folder):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(folder, lambda t: t.__setitem__(name, np.zeros((16, 64), np.float32)))
    with pytest.raises(ShapeMismatchError, match=rf"tensor '{name}' in model.safetensors: "
                                                 rf"expected shape \[32, 64\], found \[16, 64\]"):
        load_checkpoint(folder)


def test_missing_tensor_is_named(folder):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(folder, lambda t: t.pop(name))
    with pytest.raises(MissingTensorError, match=rf"has no tensor '{name}' \(expected shape \[128, 64\]\)"):
        load_checkpoint(folder)


def test_unexpected_tensor_is_named(folder):
    _rewrite(folder, lambda t: t.__setitem__("model.layers.0.mlp.experts.0.weight", np.zeros(3, np.float32)))
    with pytest.raises(UnexpectedTensorError, match="'model.layers.0.mlp.experts.0.weight'"):
        load_checkpoint(folder)


def test_no_weights_at_all(folder):
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load_checkpoint(folder)


def _deepseek_config(**changes):
    cfg = dict(model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
               v_head_dim=16, first_k_dense_replace=2)
    return {**cfg, **changes}


def test_moe_layers_build_with_transformers_names():
    """MoE layers build (tests/models/test_moe.py checks them against transformers), gpt-oss's with its
    router bias, expert biases and attention sinks (tests/models/test_gpt_oss.py)."""
    from kvjax.models import param_shapes

    config = from_hf_config(_deepseek_config(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_group=2, topk_group=1))
    assert config.moe_layers == (2, 3)
    shapes = param_shapes(build_model(config))
    assert set(shapes["layers_1"]["mlp"]) == {"gate_proj", "up_proj", "down_proj"}  # dense below first_k_dense_replace
    assert shapes["layers_2"]["mlp"]["experts"]["gate_up_proj"].shape == (8, 64, 64)  # [E, D, 2I]
    build_model(from_hf_config(_deepseek_config(first_k_dense_replace=4)))  # all dense: fine
    gpt_oss = from_hf_config(dict(model_type="gpt_oss", vocab_size=128, hidden_size=64, intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_local_experts=8))
    layer = param_shapes(build_model(gpt_oss))["layers_1"]
    assert layer["self_attn"]["sinks"].shape == (4,) and set(layer["self_attn"]["o_proj"]) == {"kernel", "bias"}
    assert {k: v.shape for k, v in layer["mlp"]["router"].items()} == {"kernel": (64, 8), "bias": (8,)}
    assert {k: v.shape for k, v in layer["mlp"]["experts"].items()} == {
        "gate_up_proj": (8, 64, 64), "gate_up_proj_bias": (8, 64), "down_proj": (8, 32, 64), "down_proj_bias": (8, 64)}


def test_sliding_window_builds_and_unknown_configs_are_refused():
    mistral = dict(model_type="mistral", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, sliding_window=4096)
    assert build_model(from_hf_config(mistral)).config.layer_windows == (4096, 4096)  # every Mistral layer slides
    assert build_model(from_hf_config({**mistral, "sliding_window": None})).config.layer_windows == (None, None)
    with pytest.raises(ModelConfigError, match="unsupported model_type 'gpt2'"):
        from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ModelConfigError, match="missing the field 'hidden_size'"):
        from_hf_config({k: v for k, v in mistral.items() if k != "hidden_size"})
    # A rope type kvjax does not compute still sizes a KV cache; building the model refuses it.
    dynamic = from_hf_config({**mistral, "sliding_window": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert dynamic.rope.rope_type == "dynamic" and dynamic.kv_spec().bytes_per_token == 2 * 2 * 4 * 16 * 2
    with pytest.raises(UnsupportedModelError, match="unsupported rope_type 'dynamic'"):
        build_model(dynamic)


def test_config_keeps_explicit_head_dim_and_builds_kv_spec(tmp_path):
    cfg = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=24, dtype="bfloat16")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    config = from_hf_config(tmp_path)
    assert config.head_dim == 24 and config.qk_norm and config.dtype == "bfloat16"
    spec = config.kv_spec("fp8")
    assert (spec.kind, spec.num_kv_heads, spec.head_dim, spec.kv_dtype, spec.model_dtype) == \
        ("gqa", 2, 24, "fp8_e4m3", "bf16")
    mla = from_hf_config(_deepseek_config(first_k_dense_replace=4)).kv_spec()
    assert (mla.kind, mla.head_dim, mla.kv_dtype) == ("mla", 24, "bf16")
