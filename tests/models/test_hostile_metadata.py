"""Model files are data, bounded (issue 37): hostile metadata is refused when the model loads.

Each class the hostile tester found is a table of hostile inputs, each built here from a good
file by one change: GGUF files written with gguf.GGUFWriter (a one-layer llama with a four-token
byte-level BPE vocabulary), checkpoint folders copied from models/checkpoints/small-gqa with one
config.json / generation_config.json / tokenizer file changed, and chat templates from a
ChatTemplate, a folder's chat_template.jinja and a GGUF's tokenizer.chat_template. Each must be
refused by `models.hub.load_model` (or `render_chat`) with one KvjaxError line that names the
file, the field and the bad value, all taken from the hostile input itself; the good files load.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time

import gguf
import numpy as np
import pytest

from kvjax.errors import KvjaxError
from kvjax.models import hub
from kvjax.models.gguf import GGUFFile
from kvjax.models.template_sandbox import (MAX_TEMPLATE_CHARS, MAX_TEMPLATE_DEPTH, MAX_TEMPLATE_SOURCE,
                                           MAX_TEMPLATE_STEPS, ChatTemplate, ChatTemplateError, ChatTemplateLimitError)
from kvjax.models.tokenizer import Tokenizer, render_chat

T = gguf.GGUFValueType
SMALL_GQA = hub.BUILTIN["small-gqa"]
MESSAGES = [{"role": "user", "content": "hi"}]


def refusal(load, *args) -> str:
    """The one-line message of the KvjaxError load(*args) raises."""
    with pytest.raises(KvjaxError) as e:
        load(*args)
    message = str(e.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------------------------
# A tiny llama GGUF: four tokens ("<|end|>" a control token, BOS and EOS), one merge, one layer
# --------------------------------------------------------------------------------------------
TOKENS = ["a", "b", "ab", "<|end|>"]
D, F, N, K, H = 16, 32, 2, 1, 8  # hidden, MLP width, query heads, kv heads, head dim
TEMPLATE = "{% for m in messages %}{{ m.content }}<|end|>{% endfor %}"
META = {
    "llama.block_count": (1, T.UINT32), "llama.context_length": (64, T.UINT32),
    "llama.embedding_length": (D, T.UINT32), "llama.feed_forward_length": (F, T.UINT32),
    "llama.attention.head_count": (N, T.UINT32), "llama.attention.head_count_kv": (K, T.UINT32),
    "llama.rope.freq_base": (10000.0, T.FLOAT32), "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32),
    "llama.rope.dimension_count": (H, T.UINT32), "llama.vocab_size": (len(TOKENS), T.UINT32),
    "tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.pre": ("gpt2", T.STRING),
    "tokenizer.ggml.tokens": (TOKENS, T.ARRAY), "tokenizer.ggml.token_type": ([1, 1, 1, 3], T.ARRAY),
    "tokenizer.ggml.merges": (["a b"], T.ARRAY), "tokenizer.ggml.bos_token_id": (3, T.UINT32),
    "tokenizer.ggml.eos_token_id": (3, T.UINT32), "tokenizer.ggml.add_bos_token": (False, T.BOOL),
    "tokenizer.chat_template": (TEMPLATE, T.STRING),
}


def tensors() -> dict[str, np.ndarray]:
    """A one-layer llama's tensors under GGUF's names, in torch's [out, in] layout; tied embeddings."""
    rng = np.random.RandomState(0)
    shapes = {"token_embd.weight": (len(TOKENS), D), "output_norm.weight": (D,), "blk.0.attn_norm.weight": (D,),
              "blk.0.attn_q.weight": (N * H, D), "blk.0.attn_k.weight": (K * H, D), "blk.0.attn_v.weight": (K * H, D),
              "blk.0.attn_output.weight": (D, N * H), "blk.0.ffn_norm.weight": (D,),
              "blk.0.ffn_gate.weight": (F, D), "blk.0.ffn_up.weight": (F, D), "blk.0.ffn_down.weight": (D, F)}
    return {name: (0.1 * rng.randn(*shape)).astype(np.float32) for name, shape in shapes.items()}


def write_gguf(path, **changes) -> str:
    """The tiny llama as a GGUF file, with metadata changes {key: (value, type)} (None: left out)."""
    meta = {**META, **{k.replace("__", "."): v for k, v in changes.items()}}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if value is not None:
            w.add_key_value(key, *value)
    for name, data in tensors().items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_good_gguf_loads(tmp_path):
    model = hub.load_model(write_gguf(tmp_path / "good.gguf"), dtype="float32")
    assert model.eos_token_ids == (3,) and model.config.vocab_size == len(TOKENS)
    assert model.tokenizer.encode("ab") == [2] and model.tokenizer.eos_token_id == 3
    assert model.chat_template == TEMPLATE and model.chat_template.source.startswith(str(tmp_path / "good.gguf"))
    assert render_chat(model.chat_template, MESSAGES) == "hi<|end|>"


NULL = 0xFFFFFFFF  # llama.cpp's LLAMA_TOKEN_NULL (-1) written as a uint32
# (case, metadata changes, the key the error names, the value it shows)
GGUF_CASES = {
    # special token ids: each must be an id of the four-token vocabulary
    "eos-null": ({"tokenizer.ggml.eos_token_id": (NULL, T.UINT32)}, "tokenizer.ggml.eos_token_id", str(NULL)),
    "padding-null": ({"tokenizer.ggml.padding_token_id": (NULL, T.UINT32)}, "tokenizer.ggml.padding_token_id",
                     str(NULL)),
    "bos-past-vocab": ({"tokenizer.ggml.bos_token_id": (len(TOKENS), T.UINT32)}, "tokenizer.ggml.bos_token_id",
                       str(len(TOKENS))),
    "unknown-past-int32": ({"tokenizer.ggml.unknown_token_id": (2**31, T.UINT64)},
                           "tokenizer.ggml.unknown_token_id", str(2**31)),
    "eos-string": ({"tokenizer.ggml.eos_token_id": ("3", T.STRING)}, "tokenizer.ggml.eos_token_id", "'3'"),
    # the tokenizer the library builds from the tokens and merges
    "merge-unknown-token": ({"tokenizer.ggml.merges": (["a zz"], T.ARRAY)}, "tokenizer.ggml.merges", "zz"),
    "merge-three-tokens": ({"tokenizer.ggml.merges": (["a b ab"], T.ARRAY)}, "tokenizer.ggml.merges[0]",
                           "'a b ab'"),
    "merges-not-strings": ({"tokenizer.ggml.merges": ([1, 2], T.ARRAY)}, "tokenizer.ggml.merges", "[1, 2]"),
    "more-tokens-than-vocab": ({"llama.vocab_size": (2, T.UINT32), "tokenizer.ggml.bos_token_id": None,
                                "tokenizer.ggml.eos_token_id": None}, "llama.vocab_size", "2"),
    "token-types-short": ({"tokenizer.ggml.token_type": ([1, 1], T.ARRAY)}, "tokenizer.ggml.token_type", "2"),
    "add-bos-string": ({"tokenizer.ggml.add_bos_token": ("yes", T.STRING)}, "tokenizer.ggml.add_bos_token",
                       "'yes'"),
    "pre-array": ({"tokenizer.ggml.pre": (["gpt2"], T.ARRAY)}, "tokenizer.ggml.pre", "['gpt2']"),
    "chat-template-number": ({"tokenizer.chat_template": (5, T.UINT32)}, "tokenizer.chat_template", "5"),
    # sizes, numbers and enums of the architecture
    "block-count-string": ({"llama.block_count": ("1", T.STRING)}, "llama.block_count", "'1'"),
    "block-count-huge": ({"llama.block_count": (2**40, T.UINT64)}, "llama.block_count", str(2**40)),
    "context-length-huge": ({"llama.context_length": (2**40, T.UINT64)}, "llama.context_length", str(2**40)),
    "head-count-zero": ({"llama.attention.head_count": (0, T.UINT32)}, "llama.attention.head_count", "0"),
    "freq-base-tiny": ({"llama.rope.freq_base": (1e-300, T.FLOAT64)}, "llama.rope.freq_base", "1e-300"),
    "freq-base-nan": ({"llama.rope.freq_base": (math.nan, T.FLOAT32)}, "llama.rope.freq_base", "nan"),
    "rms-eps-zero": ({"llama.attention.layer_norm_rms_epsilon": (0.0, T.FLOAT32)},
                     "llama.attention.layer_norm_rms_epsilon", "0.0"),
    "scaling-type-number": ({"llama.rope.scaling.type": (1, T.UINT32)}, "llama.rope.scaling.type", "1"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_hostile_gguf_refused_at_load(case, tmp_path):
    changes, key, shown = GGUF_CASES[case]
    path = write_gguf(tmp_path / f"{case}.gguf", **changes)
    message = refusal(hub.load_model, path)
    assert path in message and key in message and shown in message, message


# --------------------------------------------------------------------------------------------
# Checkpoint folders: config.json, generation_config.json, tokenizer files
# --------------------------------------------------------------------------------------------
def folder_with(tmp_path, config=None, files=None) -> str:
    """A copy of small-gqa with config.json fields replaced (None: removed) and files written."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(SMALL_GQA, folder)
    path = os.path.join(folder, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    for key, value in (config or {}).items():
        cfg[key] = value
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    for name, text in (files or {}).items():
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(text if isinstance(text, str) else json.dumps(text))
    return folder


def yarn(**params):
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 1024,
            **params}


with open(os.path.join(SMALL_GQA, "config.json")) as _fh:
    VOCAB = json.load(_fh)["vocab_size"]
# (case, config.json changes, the field the error names, the value it shows)
CONFIG_CASES = {
    "eos-past-int32": ({"eos_token_id": 2**40}, "eos_token_id", str(2**40)),
    "eos-list-past-vocab": ({"eos_token_id": [1, VOCAB]}, "eos_token_id", f"[1, {VOCAB}]"),
    "eos-negative": ({"eos_token_id": -1}, "eos_token_id", "-1"),
    "eos-string": ({"eos_token_id": "2"}, "eos_token_id", "'2'"),
    "tie-string-false": ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "'false'"),
    "tie-number": ({"tie_word_embeddings": 0}, "tie_word_embeddings", "0"),
    "attention-bias-string": ({"attention_bias": "true"}, "attention_bias", "'true'"),
    "mlp-bias-number": ({"mlp_bias": 1}, "mlp_bias", "1"),
    "yarn-beta-fast-negative": ({"rope_parameters": yarn(beta_fast=-1)}, "beta_fast", repr(-1.0)),
    "yarn-beta-slow-negative": ({"rope_parameters": yarn(beta_slow=-0.5)}, "beta_slow", repr(-0.5)),
    "yarn-mscale-negative": ({"rope_parameters": yarn(mscale=-10.0, mscale_all_dim=1.0)}, "mscale", repr(-10.0)),
    "yarn-original-huge": ({"rope_parameters": yarn(original_max_position_embeddings=2**40)},
                           "original_max_position_embeddings", str(2**40)),
    "rope-theta-tiny": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e-300}}, "rope_theta", "1e-300"),
    "rope-theta-one": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1}}, "rope_theta", repr(1.0)),
    "rope-theta-string": ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_theta", "'1e4'"),
    "linear-factor-tiny": ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 1e-40}}, "factor",
                           repr(1e-40)),
    "llama3-equal-freq-factors": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                       "low_freq_factor": 2.0, "high_freq_factor": 2.0,
                                                       "original_max_position_embeddings": 1024}},
                                  "high_freq_factor", repr(2.0)),
    "partial-rotary-above-one": ({"partial_rotary_factor": 2}, "partial_rotary_factor", repr(2.0)),
    "rms-eps-tiny": ({"rms_norm_eps": 1e-300}, "rms_norm_eps", "1e-300"),
    "rms-eps-zero": ({"rms_norm_eps": 0}, "rms_norm_eps", "0"),
    "hidden-size-past-int32": ({"hidden_size": 2**31}, "hidden_size", str(2**31)),
    "layers-huge": ({"num_hidden_layers": 2**40}, "num_hidden_layers", str(2**40)),
    "vocab-zero": ({"vocab_size": 0}, "vocab_size", "0"),
    "model-type-unknown": ({"model_type": "gpt2"}, "model_type", "'gpt2'"),
    "dtype-unknown": ({"dtype": "float64"}, "dtype", "'float64'"),
}


def test_good_folder_loads(tmp_path):
    folder = folder_with(tmp_path, {"eos_token_id": [VOCAB - 1, 0], "tie_word_embeddings": False},
                         {"generation_config.json": {"eos_token_id": 2}, "chat_template.jinja": TEMPLATE})
    model = hub.load_model(folder)
    assert model.eos_token_ids == (VOCAB - 1, 0, 2) and not model.config.tie_word_embeddings
    assert model.chat_template.source == os.path.join(folder, "chat_template.jinja")


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_hostile_config_refused_at_load(case, tmp_path):
    changes, field, shown = CONFIG_CASES[case]
    folder = folder_with(tmp_path, changes)
    message = refusal(hub.load_model, folder)
    assert os.path.join(folder, "config.json") in message and field in message and shown in message, message


def test_hostile_generation_config_refused_at_load(tmp_path):
    folder = folder_with(tmp_path, files={"generation_config.json": {"eos_token_id": [2, VOCAB]}})
    message = refusal(hub.load_model, folder)
    assert os.path.join(folder, "generation_config.json") in message and f"[2, {VOCAB}]" in message, message


def bpe_json(**changes) -> dict:
    """A three-token BPE tokenizer.json ("a", "b" and their merge), with top-level keys replaced."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    doc = json.loads(HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")])).to_str())
    doc.update(changes)
    return doc


# (case, files written into the folder, the file the error names, what it shows)
TOKENIZER_CASES = {
    "merge-unknown-token": ({"tokenizer.json": bpe_json(model={**bpe_json()["model"], "merges": ["a zz"]})},
                            "tokenizer.json", "zz"),
    "id-past-u32": ({"tokenizer.json": bpe_json(added_tokens=[{
        "id": 2**40, "content": "<x>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
        "special": True}])}, "tokenizer.json", str(2**40)),
    # a post-processor naming a token it does not define: a Rust panic (a BaseException) on every encode
    "post-processor-unknown-token": ({"tokenizer.json": bpe_json(post_processor={
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [], "special_tokens": {}})}, "tokenizer.json", "PanicException"),
    "config-not-json": ({"tokenizer.json": bpe_json(), "tokenizer_config.json": "{not json"},
                        "tokenizer_config.json", "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_CASES))
def test_hostile_tokenizer_files_refused_at_load(case, tmp_path):
    files, name, shown = TOKENIZER_CASES[case]
    folder = folder_with(tmp_path, files=files)
    message = refusal(hub.load_model, folder)
    assert os.path.join(folder, name) in message and shown in message, message


def test_good_tokenizer_file_loads(tmp_path):
    tok = Tokenizer(folder_with(tmp_path, files={"tokenizer.json": bpe_json()}))
    assert tok.encode("ab") == [2] and tok.max_token_id == 2


# --------------------------------------------------------------------------------------------
# Chat templates: rendered within limits of work, depth and size, refusals naming the file
# --------------------------------------------------------------------------------------------
# (case, template, what the refusal says)
TEMPLATE_CASES = {
    "nested-range-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           f"{MAX_TEMPLATE_STEPS:,} steps"),
    "self-calling-macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                           f"deeper than {MAX_TEMPLATE_DEPTH}"),
    "recursive-loop": ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", f"deeper than {MAX_TEMPLATE_DEPTH}"),
    "string-repeat": ("{{ 'x' * 20000000000 }}", "20,000,000,000"),
    "list-repeat": ("{{ ([0] * 20000000000)|length }}", "20,000,000,000"),
    "huge-power": ("{{ 10 ** (10 ** 10) }}", "bits"),
    "squaring-loop": ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                      "{% endfor %}{{ ns.x > 0 }}", "bits"),
    "doubling-concat": ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}"
                        "{% endfor %}{{ ns.x|length }}", f"{MAX_TEMPLATE_CHARS:,}"),
    "doubling-plus": ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}"
                      "{% endfor %}{{ ns.x|length }}", f"{MAX_TEMPLATE_CHARS:,}"),
    "doubling-macro": ("{% macro d(x) %}{{ x }}{{ x }}{% endmacro %}{% set ns = namespace(x='ab') %}"
                       "{% for i in range(40) %}{% set ns.x = d(ns.x) %}{% endfor %}{{ ns.x|length }}",
                       f"{MAX_TEMPLATE_CHARS:,}"),
    "center-filter": ("{{ 'x'|center(10000000000) }}", "10,000,000,000"),
    "ljust-method": ("{{ 'x'.ljust(10000000000) }}", "10,000,000,000"),
    "format-width": ("{{ '{:>10000000000}'.format('x') }}", "10,000,000,000"),
    "percent-width": ("{{ '%10000000000d' % 1 }}", "10,000,000,000"),
    "to-bytes": ("{{ (1).to_bytes(10000000000, 'big')|length }}", "10,000,000,000"),
    "replace-blowup": ("{% set ns = namespace(x='a') %}{% for i in range(20) %}{% set ns.x = ns.x + ns.x %}"
                       "{% endfor %}{{ ns.x|replace('a', ns.x) }}", "replace"),
    "list-of-big-strings": ("{% set ns = namespace(x='a') %}{% for i in range(22) %}{% set ns.x = ns.x + ns.x %}"
                            "{% endfor %}{{ [ns.x] * 1000 }}", f"{MAX_TEMPLATE_CHARS:,}"),
    "batch-fill": ("{{ [1]|batch(10000000000, 0)|list }}", "10,000,000,000"),
    "output-size": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "the rendered prompt"),
    "source-size": ("x" * (MAX_TEMPLATE_SOURCE + 1), f"{MAX_TEMPLATE_SOURCE + 1:,} characters"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATE_CASES))
def test_hostile_template_refused(case):
    template, says = TEMPLATE_CASES[case]
    source = f"/models/{case}/chat_template.jinja"
    start = time.monotonic()
    with pytest.raises(ChatTemplateLimitError) as e:
        render_chat(ChatTemplate(template, source), MESSAGES)
    assert time.monotonic() - start < 5  # refused, not run to the end
    message = str(e.value)
    assert isinstance(e.value, ChatTemplateError) and isinstance(e.value, KvjaxError)
    assert source in message and says in message and "\n" not in message, message


def test_template_refusals_name_the_model_file(tmp_path):
    """The template of a folder's chat_template.jinja, tokenizer_config.json and a GGUF file."""
    loop = TEMPLATE_CASES["self-calling-macro"][0]
    folder = folder_with(tmp_path, files={"chat_template.jinja": loop})
    assert os.path.join(folder, "chat_template.jinja") in refusal(render_chat, hub.chat_template(folder), MESSAGES)
    os.remove(os.path.join(folder, "chat_template.jinja"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump({"chat_template": loop}, fh)
    assert os.path.join(folder, "tokenizer_config.json") in refusal(render_chat, hub.chat_template(folder), MESSAGES)
    path = write_gguf(tmp_path / "loop.gguf", tokenizer__chat_template=(loop, T.STRING))
    with GGUFFile(path) as f:
        template = f.chat_template
    assert f"{path} (tokenizer.chat_template)" in refusal(render_chat, template, MESSAGES)
    bad = ChatTemplate("{% for %}", "/x/chat_template.jinja")  # not Jinja at all: named too
    assert "/x/chat_template.jinja" in refusal(render_chat, bad, MESSAGES)


def test_long_conversation_renders_within_the_limits():
    """A real template over 2,000 messages uses a fraction of the step budget."""
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " * 10} for i in range(2000)]
    rendered = render_chat(ChatTemplate(chatml, "chatml.jinja"), messages)
    assert rendered.count("<|im_start|>") == 2001 and rendered.endswith("<|im_start|>assistant\n")
