"""models.tokenizer.Tokenizer's transformers-named API (what a vLLM user calls on `llm.get_tokenizer()`)
against transformers' own tokenizer loaded from the same files, offline: a tokenizer.json folder
with its tokenizer_config.json, and GGUF files (written by test_gguf's writer, with and without
add_bos_token) loaded through models.hub; the byte vocabulary by hand.
"""
from __future__ import annotations

import json
import os

import pytest
import transformers as tf
from test_gguf import _float_types, make_llama, train_vocab, write_gguf
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers, processors, trainers
from tokenizers import models as tok_models

from kvjax.errors import KvjaxError
from kvjax.models import hub
from kvjax.models.tokenizer import Tokenizer

CORPUS = "the cat sat on the mat. the dog ate the cat's food! 2024 " * 5
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|extra|>"]  # ids 0 .. 4
TEXTS = ["the cat<|extra|> ate <think> 2024</s>", "  dog  ", "<s>mat", ""]
ATTRIBUTES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "all_special_tokens",
              "vocab_size", "bos_token", "eos_token")


def _folder(path, config: dict | None, legacy: dict | None = None) -> str:
    """A checkpoint folder's tokenizer files: a byte-level BPE whose post-processor prepends <s>,
    an added (not special) token <think>, and tokenizer_config.json / special_tokens_map.json."""
    t = HFTokenizer(tok_models.BPE(unk_token="<unk>"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    t.add_tokens(["<think>"])
    os.makedirs(path, exist_ok=True)
    t.save(os.path.join(path, "tokenizer.json"))
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", legacy)):
        if content is not None:
            with open(os.path.join(path, name), "w") as f:
                json.dump(content, f)
    return str(path)


def _same_as_transformers(ours: Tokenizer, theirs) -> None:
    for name in ATTRIBUTES:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    for text in TEXTS:
        for add in (True, False):
            ids = theirs.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, (text, add)
            assert ours(text, add_special_tokens=add) == dict(theirs(text, add_special_tokens=add))
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.encode(text) == theirs.encode(text)  # both add special tokens by default
    ids = theirs.encode(TEXTS[0]) + [10_000]
    for skip in (True, False):
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
            theirs.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids[1]) == theirs.convert_ids_to_tokens(ids[1])
    tokens = ["<s>", "<think>", "no-such-token", "cat"]
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("</s>") == theirs.convert_tokens_to_ids("</s>")
    assert ours(["a", "the"]) == dict(theirs(["a", "the"]))
    assert ours.max_token_id == max(theirs.get_vocab().values())


EOS = {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
       "single_word": False}


@pytest.mark.parametrize("config, legacy", [
    ({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": EOS, "pad_token": "<pad>",
      "unk_token": "<unk>", "additional_special_tokens": ["<|extra|>"]}, None),
    # legacy: special_tokens_map.json names the tokens (read when there is no added_tokens_decoder)
    ({"tokenizer_class": "PreTrainedTokenizerFast"}, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}),
], ids=["tokenizer_config", "special_tokens_map"])
def test_a_folder_matches_transformers(tmp_path, config, legacy):
    folder = _folder(tmp_path / "tok", config, legacy)
    # a loader's EOS (config.json's) is the fallback: the tokenizer's own files win, as in transformers
    _same_as_transformers(Tokenizer(folder, eos_token_id=77), tf.AutoTokenizer.from_pretrained(folder))


def test_a_folder_without_tokenizer_config_takes_the_loaders_ids(tmp_path):
    folder = _folder(tmp_path / "tok", None)
    tok = Tokenizer(folder, eos_token_id=2)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.eos_token) == (2, None, None, "</s>")
    assert tok.all_special_ids == [2]
    assert tok.encode("the")[0] == 1 and tok.encode("the", add_special_tokens=False)[0] != 1  # the <s> template


@pytest.fixture(scope="module")
def vocab():
    return train_vocab()


@pytest.mark.parametrize("add_bos", [False, True])
def test_a_gguf_through_the_loader_matches_transformers(vocab, tmp_path, add_bos):
    path = write_gguf(tmp_path / "m.gguf", make_llama(len(vocab[0]), False), _float_types, vocab, add_bos=add_bos)
    loaded = hub.load_model(path)
    theirs = tf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    _same_as_transformers(loaded.tokenizer, theirs)
    _same_as_transformers(hub.load_tokenizer(path), theirs)  # without the weights: the same tokenizer
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id) == (1, 2)  # write_gguf's ids
    assert (loaded.tokenizer.encode("a")[0] == 1) == add_bos  # a BOS only where the GGUF adds one
    assert loaded.tokenizer.encode("a", add_special_tokens=False)[0] != 1


def test_load_tokenizer_without_weights():
    """hub.load_tokenizer (what bench serve's client tokenizes with) on a registry name and a
    preset: the byte vocabulary, by hand; a name that names nothing is refused, naming it."""
    tok = hub.load_tokenizer("small-gqa")
    assert tok.is_bytes and tok.vocab_size == 256 and tok.encode("héllo") == list("héllo".encode())
    assert hub.load_tokenizer("preset:tiny").is_bytes
    for name in ("nope", "preset:nope"):
        with pytest.raises(KvjaxError, match="nope"):
            hub.load_tokenizer(name)


def test_the_byte_vocabulary_by_hand():
    tok = Tokenizer()
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.all_special_ids) == (None, None, None, [])
    assert (tok.vocab_size, len(tok), tok.max_token_id) == (256, 256, 255)
    assert tok.encode("hé") == tok.encode("hé", add_special_tokens=False) == [104, 195, 169]
    assert tok("hi") == {"input_ids": [104, 105], "attention_mask": [1, 1]}
    assert tok.decode([104, 105], skip_special_tokens=False) == tok.decode([104, 105]) == "hi"
    assert tok.decode(104) == "h"
    assert tok.convert_ids_to_tokens([104]) == [None]  # a byte is no text token
    with_eos = Tokenizer(eos_token_id=3)
    assert (with_eos.eos_token_id, with_eos.all_special_ids) == (3, [3])
