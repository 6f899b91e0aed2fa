"""Gemma 2 / Gemma 3 GGUF files (models.gguf) against the transformers models they were written from.

The tiny gemma2 and gemma3 checkpoints of tests/hf_fixtures.py are written as GGUF files the way
llama.cpp's convert_hf_to_gguf.py writes them (`Gemma2Model` / `Gemma3Model`: gguf's TensorNameMap
for the names, every norm weight stored as 1 + w, no q/k permutation, the sliding window and
gemma2's soft-caps as metadata); their query_pre_attn_scalar (24, not head_dim) goes in as
`attention.scale`. kvjax must load every parameter back exactly and reproduce transformers'
logits over several windows. Metadata llama.cpp fills in itself (the sliding pattern, the local
RoPE base, the 27B models' scale, gemma2's default caps) is read the same way, and a file with
no sliding window is refused.
"""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import hf_logits, make_hf_model
from test_gguf import finish, write_shape

from kvjax.attention.metadata import build_metadata
from kvjax.models import build_model
from kvjax.models.gguf import GGUFArchitectureError, GGUFFile, GGUFTokenizerError
from kvjax.models.loader import load_checkpoint, load_params
from kvjax.worker.model_runner import make_step
from kvjax.worker.paged_cache import PagedCache

ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}


def write_gemma_gguf(path, model, *, scale=True, window=True, **meta):
    """`model` (a transformers Gemma 2 / 3) as an F32 GGUF file, as llama.cpp's converter writes it."""
    c = model.config
    arch = "gemma2" if c.model_type == "gemma2" else "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    write_shape(w, c)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if window:
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    if scale:
        w.add_attention_scale(c.query_pre_attn_scalar ** -0.5)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("llama")  # Gemma's SentencePiece vocabulary, which kvjax does not rebuild
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    names = gguf.get_tensor_name_map(ARCH[arch], c.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight":
            continue  # tied
        base, suffix = hf.rsplit(".", 1)
        data = tensor.numpy().astype(np.float32)
        if hf.endswith("norm.weight"):
            data = data + 1  # Gemma2Model.modify_tensors: llama.cpp's norm multiplies by the weight alone
        w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    finish(w)
    return path


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def case(request, tmp_path_factory):
    hf = make_hf_model(request.param)
    return hf, write_gemma_gguf(tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf", hf)


@pytest.mark.parametrize("case", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)], indirect=True)
def test_logits_match_the_transformers_model(case):
    hf, path = case
    config, params = load_checkpoint(path)
    assert config.layer_windows == tuple(hf.config.sliding_window if t == "sliding_attention" else None
                                         for t in hf.config.layer_types)
    for field, hf_field in (("query_pre_attn_scalar", "query_pre_attn_scalar"),
                            ("attn_logit_softcap", "attn_logit_softcapping"),
                            ("final_logit_softcap", "final_logit_softcapping")):
        want = getattr(hf.config, hf_field)
        assert getattr(config, field) == pytest.approx(want) if want is not None else getattr(config, field) is None
    tokens = np.random.RandomState(0).randint(0, 128, size=30).astype(np.int32)
    md = build_metadata([0], [30], [list(range(1, 9))], block_size=4, max_tokens=32, max_seqs=1,
                        max_blocks_per_seq=8)
    logits, _ = make_step(build_model(config))(params, jnp.asarray(np.pad(tokens, (0, 2))), md,
                                               PagedCache.create(config.kv_spec(), 10, 4))
    np.testing.assert_allclose(np.asarray(logits)[:30], hf_logits(hf, tokens), atol=1e-4, rtol=0)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    norm = params["layers_0"]["pre_feedforward_layernorm"]["weight"]  # the 1 + w undone
    np.testing.assert_allclose(np.asarray(norm), state["model.layers.0.pre_feedforward_layernorm.weight"], atol=1e-7)
    with GGUFFile(path) as f, pytest.raises(GGUFTokenizerError, match="tokenizer.ggml.model 'llama'"):
        f.tokenizer()


def test_llama_cpp_defaults_fill_what_the_metadata_leaves_out(case, tmp_path):
    hf, _ = case
    arch = "gemma2" if hf.config.model_type == "gemma2" else "gemma3"
    path = write_gemma_gguf(tmp_path / "bare.gguf", hf, scale=False)
    with GGUFFile(path) as f:
        cfg = f.hf_config()
    assert cfg["query_pre_attn_scalar"] == hf.config.head_dim  # not a 27B: head_dim
    period = 2 if arch == "gemma2" else 6  # llama.cpp's set_swa_pattern: the last layer of each period is full
    assert [t == "sliding_attention" for t in cfg["layer_types"]] == \
        [i % period < period - 1 for i in range(hf.config.num_hidden_layers)]
    if arch == "gemma3":
        assert cfg["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
        assert cfg["attn_logit_softcapping"] is None and cfg["final_logit_softcapping"] is None
    pattern = write_gemma_gguf(tmp_path / "pattern.gguf", hf, sliding_window_pattern=3)
    with GGUFFile(pattern) as f:
        assert [t == "sliding_attention" for t in f.hf_config()["layer_types"]] == \
            [i % 3 < 2 for i in range(hf.config.num_hidden_layers)]
    with pytest.raises(GGUFArchitectureError, match=f"no {arch}.attention.sliding_window"):
        load_checkpoint(write_gemma_gguf(tmp_path / "nowindow.gguf", hf, window=False))


def test_gguf_params_equal_the_safetensors_params(case, tmp_path):
    """The same weights by both roads: GGUF (names mapped, 1 + w undone) and a save_pretrained folder."""
    hf, path = case
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    config, from_folder = load_checkpoint(folder, dtype="float32")
    with GGUFFile(path) as f:
        from_gguf = load_params(f, config)
    # exact but for the norms, whose (1 + w) - 1 rounds in f32
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, rtol=0), from_gguf, from_folder)
