"""SamplingParams as a mutable object with vLLM 0.33's normalisations and checks (vllm/sampling_params.py):
assignment after construction, `verify()`, `clone()`, RequestOutputKind, logit_bias, allowed_token_ids,
the vocabulary checks vLLM's input processor runs, and `update_from_tokenizer` for bad words.

Expected values are vLLM's rules applied by hand: its `from_optional` for logit_bias (int keys,
clamp to [-100, 100]), `_validate_*` for the vocabulary, and `update_from_tokenizer`'s loop
(each word as it stands, then with a leading space when that gives a new first token of the same
length) on a tokenizer whose answers the test fixes.
"""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from kvjax.engine.sampling_params import (MAX_NUM_BAD_WORDS, RequestOutputKind, SamplingParams, SamplingParamsError,
                                          needs_host_every_token)
from kvjax.models.tokenizer import Tokenizer


def test_request_output_kind_is_vllms():
    assert [(k.name, k.value) for k in RequestOutputKind] == [("CUMULATIVE", 0), ("DELTA", 1), ("FINAL_ONLY", 2)]
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA
    with pytest.raises(SamplingParamsError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_fields_can_be_set_and_verify_checks_them():
    sp = SamplingParams()
    sp.max_tokens, sp.temperature, sp.stop = 3, 0, "\n"
    sp.verify()
    assert (sp.max_tokens, sp.temperature, sp.stop) == (3, 0.0, ["\n"])
    sp.temperature, sp.top_p = 1e-3, 0.5
    sp.verify()  # the constructor's normalisations again: vLLM's _MAX_TEMP floor
    assert (sp.temperature, sp.top_p) == (1e-2, 0.5)
    sp.temperature = 0
    sp.verify()  # greedy resets the filters
    assert (sp.top_p, sp.top_k, sp.min_p) == (1.0, 0, 0.0)
    again = copy.deepcopy(sp)
    again.verify()
    assert again == sp  # a second verify changes nothing


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens must be at least 1, got 0."),  # vLLM's words where vLLM has the rule
    ("temperature", 3.0, "temperature must be in [0, 2], got 3.0."),
    ("min_tokens", 17, "min_tokens must be less than or equal to max_tokens=16, got 17."),
    ("n", 2, "n must be 1 when using greedy sampling, got 2."),  # with the temperature set below
    ("stop", ["a", ""], "stop cannot contain an empty string."),
    ("logit_bias", {"x": 1.0}, "logit_bias keys must be token ids, got 'x'"),
    ("allowed_token_ids", [], "allowed_token_ids is not None and empty!"),
    ("bad_words", "word", "bad_words must be a list of non-empty strings"),
    ("bad_words", ["ok", ""], "bad_words must be a list of non-empty strings"),
    ("output_kind", 1, "output_kind must be a RequestOutputKind"),
])
def test_verify_refuses_a_bad_value_set_after_construction(field, value, message):
    sp = SamplingParams(temperature=0) if field == "n" else SamplingParams()
    setattr(sp, field, value)  # accepted as it is set (vLLM's params are plain attributes) ...
    with pytest.raises(SamplingParamsError) as e:
        sp.verify()  # ... and refused when the engine verifies the request
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_and_unimplemented_fields_are_refused_on_assignment():
    sp = SamplingParams()
    with pytest.raises(SamplingParamsError, match="SamplingParams has no parameter 'max_token'"):
        sp.max_token = 8  # a typo would otherwise be ignored
    with pytest.raises(SamplingParamsError, match="SamplingParams.watermarking: watermarks are not"):
        sp.watermarking = True


def test_mutable_means_unhashable_and_replace_still_works():
    with pytest.raises(TypeError):
        hash(SamplingParams())
    sp = SamplingParams(n=3, seed=1, bad_words=["x"], _bad_words_token_ids=[[120]], logit_bias={2: 1.0})
    child = dataclasses.replace(sp, n=1, seed=2)
    assert (child.n, child.seed, child.bad_words_token_ids, child.logit_bias) == (1, 2, [[120]], {2: 1.0})
    assert sp.n == 3  # the original is untouched


def test_clone_is_deep_unless_skip_clone():
    sp = SamplingParams(stop=["a"], logit_bias={1: 2.0}, allowed_token_ids=[1, 2])
    c = sp.clone()
    assert c == sp and c is not sp and c.stop is not sp.stop and c.logit_bias is not sp.logit_bias
    c.stop.append("b")
    c.allowed_token_ids.append(3)
    assert sp.stop == ["a"] and sp.allowed_token_ids == [1, 2]
    shallow = SamplingParams(stop=["a"], skip_clone=True)
    s = shallow.clone()
    assert s == shallow and s is not shallow and s.stop is shallow.stop  # vLLM's copy.copy
    assert pickle.loads(pickle.dumps(sp)) == sp


def test_logit_bias_as_vllms_from_optional():
    # string keys are token ids; biases clamped to [-100, 100] (vLLM's OpenAI path, from_optional)
    sp = SamplingParams(logit_bias={"7": 250, 3: -0.5, "12": float("-inf")})
    assert sp.logit_bias == {7: 100.0, 3: -0.5, 12: -100.0}
    assert all(type(k) is int and type(v) is float for k, v in sp.logit_bias.items())
    for bias, message in [({-1: 1.0}, "a logit_bias token id must be an integer in [0, 2147483647], got -1"),
                          ({1.5: 1.0}, "a logit_bias token id must be an integer"),
                          ({1: float("nan")}, "logit_bias[1] must be a number"),
                          ({1: "2"}, "logit_bias[1] must be a number"),
                          ([1, 2], "logit_bias must be a dict of token id → bias")]:
        with pytest.raises(SamplingParamsError, match=message.replace("[", r"\[").replace("]", r"\]")):
            SamplingParams(logit_bias=bias)


def test_allowed_token_ids_are_a_list_of_ids():
    assert SamplingParams(allowed_token_ids=(4, 1)).allowed_token_ids == [4, 1]
    with pytest.raises(SamplingParamsError, match="an allowed token id must be an integer in"):
        SamplingParams(allowed_token_ids=[1, -3])
    with pytest.raises(SamplingParamsError, match="allowed_token_ids must be a sequence of token ids"):
        SamplingParams(allowed_token_ids="12")


@pytest.mark.parametrize("kw, message", [
    (dict(logit_bias={3: 1.0, 10: 1.0}),
     "token_id(s) [10] in logit_bias contain out-of-vocab token ids. Vocabulary size: 10"),  # vLLM's words
    (dict(allowed_token_ids=[0, 9, 12, 10]), "allowed_token_ids contains out-of-vocab token id! ([12, 10]"),
    (dict(stop_token_ids=[11]), "token_id(s) [11] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 10"),
])
def test_token_ids_are_checked_against_the_vocabulary(kw, message):
    sp = SamplingParams(**kw)  # fine on its own: the vocabulary is the engine's to know
    with pytest.raises(SamplingParamsError) as e:
        sp.verify(vocab_size=10)
    assert message in str(e.value)
    with pytest.raises(SamplingParamsError):
        sp.verify_token_ids(10)
    sp.verify(vocab_size=13)  # all in range


def test_skip_special_tokens_false_is_accepted():
    assert SamplingParams(skip_special_tokens=False).skip_special_tokens is False
    # spaces_between_special_tokens only matters without skipping (vLLM: skip or spaces)
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False


def test_needs_host_every_token():
    assert needs_host_every_token(SamplingParams(stop=["\n"]))
    assert not needs_host_every_token(SamplingParams())
    # bad words are followed on the device (SamplingRows.add_tokens), penalties and the rest too
    assert not needs_host_every_token(SamplingParams(bad_words=["x"], presence_penalty=1.0, logit_bias={1: 1.0}))


# ----------------------------------------------------------------------------------- update_from_tokenizer
class FixedTokenizer:
    """A tokenizer whose every answer the test fixes (text → ids), recording how it was called."""

    def __init__(self, table, max_token_id=99):
        self.table, self.max_token_id, self.calls = table, max_token_id, []

    def encode(self, text, add_special_tokens=True):
        self.calls.append((text, add_special_tokens))
        return list(self.table[text])


def test_update_from_tokenizer_follows_vllms_rule():
    tok = FixedTokenizer({
        "cat": [5], " cat": [6],  # a new first token, same length: both forms banned
        "dog": [7, 8], " dog": [9],  # the spaced form is shorter: only "dog"
        "bird": [10], " bird": [10],  # the same first token: once
        "y": [3], " y": [],  # the spaced form tokenizes to nothing: skipped
    })
    sp = SamplingParams(bad_words=["cat", "dog", "  bird", "y"])  # leading spaces are stripped first
    assert sp.bad_words_token_ids is None
    sp.update_from_tokenizer(tok)
    assert sp.bad_words_token_ids == [[5], [6], [7, 8], [10], [3]]
    assert {flag for _, flag in tok.calls} == {False}  # no BOS or other special token around a word
    assert [t for t, _ in tok.calls] == ["cat", " cat", "dog", " dog", "bird", " bird", "y", " y"]
    assert SamplingParams().update_from_tokenizer(tok) is None  # no bad words: nothing asked


def test_update_from_tokenizer_refusals():
    with pytest.raises(SamplingParamsError, match="bad_words need a tokenizer"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(None)
    SamplingParams().update_from_tokenizer(None)  # nothing to tokenize
    with pytest.raises(SamplingParamsError, match="bad word 'x' tokenizes to no token"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(FixedTokenizer({"x": []}))
    with pytest.raises(SamplingParamsError, match=r"outside the vocabulary \[0, 99\]"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(FixedTokenizer({"x": [100], " x": [101]}))
    many = {f"w{i}": [i] for i in range(MAX_NUM_BAD_WORDS + 1)} | {f" w{i}": [i] for i in range(MAX_NUM_BAD_WORDS + 1)}
    with pytest.raises(SamplingParamsError, match=f"more than {MAX_NUM_BAD_WORDS} token sequences"):
        SamplingParams(bad_words=[f"w{i}" for i in range(MAX_NUM_BAD_WORDS + 1)]).update_from_tokenizer(
            FixedTokenizer(many, max_token_id=1000))


def test_update_from_tokenizer_with_the_byte_vocabulary():
    sp = SamplingParams(bad_words=["ab"])
    sp.update_from_tokenizer(Tokenizer())
    assert sp.bad_words_token_ids == [[97, 98]]  # " ab" is [32, 97, 98]: longer, so not added
