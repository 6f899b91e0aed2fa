"""Structured outputs (kvjax.engine.structured_output, the mask in kvjax.engine.sampling, the
matcher in kvjax.engine.core): a tiny random model's constrained output always matches its
constraint, an unconstrained request beside constrained ones is unchanged, and the jitted mask
is the bitmask's.

References: json.loads and hand-written checks of each schema's rules, re.fullmatch, the choice
list; NumPy's unpackbits for the bitmask layout (bit t % 32 of int32 word t // 32, llguidance's
and xgrammar's); the same engine without the constrained requests for "unchanged"."""
from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from kvjax import LLM, SamplingParams
from kvjax.engine import sampling
from kvjax.engine.sampling_params import SamplingParamsError, StructuredOutputsParams as S
from kvjax.engine.structured_output import StructuredOutputManager
from kvjax.models.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
EMAIL = r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"
CHOICES = ["yes", "no", "maybe", "it depends"]
GRAMMAR = 'root ::= "SELECT " col " FROM " tab\ncol ::= "id" | "name" | "*"\ntab ::= "users" | "t" [0-9]'


def _person(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "ok"} and isinstance(value["name"], str)
            and len(value["name"]) <= 8 and type(value["age"]) is int and 0 <= value["age"] <= 120
            and type(value["ok"]) is bool)


@pytest.fixture(scope="module")
def llm():
    return LLM("preset:tiny", num_gpu_blocks_override=512, max_num_seqs=16, max_model_len=256, use_tqdm_on_load=False)


def _unpacked(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little").reshape(len(bitmask), -1)[:, :vocab].astype(bool)


def test_the_jitted_mask_is_the_bitmask():
    rng = np.random.default_rng(0)
    b, v = 5, 100  # 4 words, the last one partly past the vocabulary
    bitmask = rng.integers(-2 ** 31, 2 ** 31, size=(b, 4), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # a row that allows everything
    logits = rng.normal(size=(b, v)).astype(np.float32)
    rows = sampling.SamplingRows.build([SamplingParams(temperature=0)] * b, np.zeros((b, 2), np.uint32),
                                       [[1]] * b, [[]] * b, (), v, bitmask)
    masked = np.asarray(jax.jit(sampling.mask_grammar)(logits, rows))
    allowed = _unpacked(bitmask, v)
    np.testing.assert_array_equal(masked, np.where(allowed, logits, -np.inf))
    out = sampling.sample(logits, rows, np.ones(b, np.int32), num_logprobs=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.where(allowed, logits, -np.inf).argmax(-1))
    assert np.isfinite(np.asarray(out.logprobs)).all()  # of the masked distribution, as vLLM reports them


def test_bitmask_rows_and_the_eos_after_a_complete_grammar():
    tok = Tokenizer()  # the byte vocabulary
    with_eos = StructuredOutputManager(tok, 256, eos_token_ids=(10,))
    g = with_eos.compile(S(choice=["ab", "b"]))
    allowed = _unpacked(with_eos.bitmask([g, None]), 256)
    assert np.flatnonzero(allowed[0]).tolist() == [ord("a"), ord("b")] and allowed[1].all()
    assert g.advance([ord("a")], "r") is None and g.advance([ord("a"), ord("b")], "r") is None and g.terminated
    assert np.flatnonzero(_unpacked(with_eos.bitmask([g]), 256)[0]).tolist() == [10]  # only EOS may follow
    no_eos = StructuredOutputManager(tok, 256)  # the model has none: a complete grammar ends the request
    g = no_eos.compile(S(choice=["ab", "b"]))
    assert g.advance([ord("b")], "r") == "stop"
    assert not _unpacked(no_eos.bitmask([g]), 256)[0].any()
    g = no_eos.compile(S(regex="a+"))
    assert g.advance([ord("b")], "r") == "error"  # a token the mask would have refused
    assert "Grammar error" in no_eos.check(S(regex="[.*")) and no_eos.check(S(regex="a+")) is None
    with pytest.raises(SamplingParamsError, match="You must use one kind"):
        S()


def test_100_constrained_generations_are_all_valid(llm):
    """25 each of a JSON schema, a regex, a choice and a grammar, sampled at temperature 1 from a
    random-weight model (so the mask, not the model, makes them valid)."""
    kinds = [("json", S(json=PERSON, disable_any_whitespace=True)), ("regex", S(regex=EMAIL)),
             ("choice", S(choice=CHOICES)), ("grammar", S(grammar=GRAMMAR))]
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured_outputs=so)
              for seed in range(25) for _, so in kinds]
    outs = llm.generate(["Answer: "] * 100, params, use_tqdm=False)
    texts = {}
    for i, out in enumerate(outs):
        kind, c = kinds[i % 4][0], out.outputs[0]
        assert c.finish_reason == "stop", (kind, c.text)
        texts.setdefault(kind, set()).add(c.text)
        if kind == "json":
            assert _person(json.loads(c.text)), c.text
        elif kind == "regex":
            assert re.fullmatch(EMAIL, c.text), c.text
        elif kind == "choice":
            assert c.text in CHOICES
        else:
            assert re.fullmatch(r"SELECT (id|name|\*) FROM (users|t[0-9])", c.text), c.text
    assert all(len(v) > 2 for v in texts.values())  # the draws differ: the mask does not pick the answer


def test_json_object_and_default_whitespace(llm):
    """response_format json_object (any object) and a schema with vLLM's default flexible whitespace."""
    small = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2, 3]}},
             "required": ["a", "b"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=240, temperature=1.0, seed=s, structured_outputs=S(json=small))
              for s in range(8)]
    params += [SamplingParams(max_tokens=240, temperature=1.0, seed=s, structured_outputs=S(
        json_object=True, whitespace_pattern=" ?")) for s in range(4)]
    for out, p in zip(llm.generate(["{"] * 12, params, use_tqdm=False), params):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            value = json.loads(c.text)
            assert isinstance(value, dict)
            if p.structured_outputs.json is not None:
                assert set(value) == {"a", "b"} and type(value["a"]) is bool and value["b"] in (1, 2, 3)
        else:  # a random model may write a long string: what it wrote is still a valid start
            assert c.finish_reason == "length" and c.text.lstrip().startswith("{")
    assert sum(o.outputs[0].finish_reason == "stop" for o in llm.generate(["{"] * 8, params[:8], use_tqdm=False)) == 8


def test_an_unconstrained_request_beside_constrained_ones_is_unchanged(llm):
    plain = [SamplingParams(max_tokens=24, temperature=0, logprobs=2),
             SamplingParams(max_tokens=24, temperature=0.8, seed=3)]
    alone = llm.generate(["def f(x):", "Hello"], plain, use_tqdm=False)
    constrained = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=S(regex=EMAIL))
                   for s in range(3)]
    mixed = llm.generate(["def f(x):", "a", "Hello", "b", "c"], [plain[0], constrained[0], plain[1], *constrained[1:]],
                         use_tqdm=False)
    for ref, got in zip(alone, [mixed[0], mixed[2]]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    for a, b in zip(alone[0].outputs[0].logprobs, mixed[0].outputs[0].logprobs):
        assert {t: round(x.logprob, 4) for t, x in a.items()} == {t: round(x.logprob, 4) for t, x in b.items()}
    assert all(re.fullmatch(EMAIL, mixed[i].outputs[0].text) for i in (1, 3, 4))
