"""Every request field vLLM 0.33's OpenAI server accepts is honoured or refused by `kvjax serve`
(kvjax.entrypoints.openai.protocol), and the fields issue 57 found ignored or refused in silence now
do what vLLM does. One server on small-gqa (max_model_len 128) for the module.

References, none of them the server's code: vLLM's own field lists (vendored from its wheel in
data/vllm_0_33_request_fields.json) and docs/server_fields.md's table; vLLM's messages (copied from
its source: renderers/params.py, v1/engine/input_processor.py, sampling_params.py); the offline
LLM (LLM.generate, LLM.beam_search with length_penalty 0, which ranks as vLLM's online search does)
for tokens; hand-worked facts (a +100 bias makes every token that token; a prompt cut from the
left keeps its last tokens)."""
from __future__ import annotations

import json
import os
import re

import openai
import pytest

from serving import http, serving, wait_idle

from kvjax import SamplingParams
from kvjax.engine.beam_search import BeamSearchParams, beam_search
from kvjax.entrypoints.openai.api_server import api_keys
from kvjax.entrypoints.openai.protocol import REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest

HERE = os.path.dirname(__file__)
VLLM_FIELDS = json.load(open(os.path.join(HERE, "data", "vllm_0_33_request_fields.json")))
DOCS = os.path.join(HERE, "..", "..", "docs", "server_fields.md")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
COMMON = dict(model="small-gqa", num_gpu_blocks_override=64, max_num_seqs=4, max_model_len=128, chat_template=TEMPLATE,
              use_tqdm_on_load=False)
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "The key to"]
M = "small-gqa"
USER = [{"role": "user", "content": "Sort it."}]

# server, client, llm, greedy: tests/entrypoints/conftest.py (from COMMON and PROMPTS)

# A value of each refused field that asks for what kvjax does not do (docs/server_fields.md says why).
ASKING = {"watermarking": True, "logprob_token_ids": [5], "prompt_embeds": "AAAA", "return_weight_versions": True,
          "routed_experts_prompt_start": 2, "cache_salt": "salt", "kv_transfer_params": {"do_remote_decode": True},
          "ec_transfer_params": {"x": 1}, "vllm_xargs": {"k": 1}, "repetition_detection": {"min_count": 3},
          "thinking_token_budget": 10, "stream_interval": 4, "media_io_kwargs": {"image": {}},
          "mm_processor_kwargs": {"x": 1}, "guided_json": {"type": "object"}, "guided_regex": "a+",
          "guided_choice": ["a"], "guided_grammar": "root ::= \"a\"", "guided_decoding_backend": "xgrammar",
          "guided_whitespace_pattern": " "}


# ----------------------------------------------------------------------------------- the field walk
@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_vllm_field_is_honoured_or_refused(model):
    vllm = VLLM_FIELDS[model.__name__]
    honoured, refused = set(model.model_fields), set(REFUSED_FIELDS)
    assert not (honoured & refused)
    neither = [f for f in vllm if f not in honoured | refused]
    assert neither == [], f"vLLM fields {neither} are neither honoured nor refused by {model.__name__}"
    assert honoured <= set(vllm), f"fields vLLM does not have: {sorted(honoured - set(vllm))}"


def test_the_docs_table_lists_each_field_and_what_kvjax_does():
    rows = re.findall(r"^\| `(\w+)` \| ([CH, ]+) \| (honoured|refused) \|", open(DOCS).read(), re.M)
    table = {f: (where, status) for f, where, status in rows}
    c, h = VLLM_FIELDS["CompletionRequest"], VLLM_FIELDS["ChatCompletionRequest"]
    assert set(table) == set(c) | set(h) and len(rows) == len(table)
    for field, (where, status) in table.items():
        assert where == ", ".join(x for x, fields in (("C", c), ("H", h)) if field in fields), field
        assert status == ("refused" if field in REFUSED_FIELDS else "honoured"), field
    assert set(ASKING) == set(REFUSED_FIELDS)


@pytest.mark.parametrize("field", sorted(REFUSED_FIELDS))
def test_a_refused_field_is_a_400_naming_it(server, field):
    for path, body in (("/v1/completions", dict(prompt="x")), ("/v1/chat/completions", dict(messages=USER))):
        fields = VLLM_FIELDS["CompletionRequest" if "chat" not in path else "ChatCompletionRequest"]
        if field not in fields and not field.startswith("guided_"):
            continue
        status, _, text = http(server[1] + path, dict(model=M, max_tokens=2, **body, **{field: ASKING[field]}))
        assert status == 400, (field, text)
        err = json.loads(text)["error"]
        assert err["param"] == field and f"`{field}`" in err["message"]
        neutral = REFUSED_FIELDS[field][0][0]  # the value that asks for nothing (vLLM's default) is accepted
        status, _, text = http(server[1] + path, dict(model=M, max_tokens=2, **body, **{field: neutral}))
        assert status == 200, (field, text)


def test_fields_vllm_does_not_know_are_ignored_as_vllm_ignores_them(server):
    status, _, text = http(server[1] + "/v1/completions", dict(model=M, prompt="x", max_tokens=2, no_such_field=1))
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2


# ----------------------------------------------------------------------------------- issue 57's silent ignores
def test_logit_bias_is_applied_and_validated(client, llm):
    vocab = llm.llm_engine.vllm_config.model_config.vocab_size
    resp = client.completions.create(model=M, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                     logit_bias={"65": 100}, extra_body=dict(return_token_ids=True))
    assert resp.choices[0].token_ids == [65] * 6 and resp.choices[0].text == "A" * 6  # the byte "A" every time
    plain = client.completions.create(model=M, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                      extra_body=dict(return_token_ids=True)).choices[0].token_ids[0]
    banned = client.completions.create(model=M, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                       logit_bias={str(plain): -100}, extra_body=dict(return_token_ids=True))
    assert banned.choices[0].token_ids[0] != plain
    ref = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0, logit_bias={plain: -100}),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert banned.choices[0].token_ids == ref
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's test_chat_logit_bias_invalid
        client.completions.create(model=M, prompt="x", max_tokens=2, logit_bias={str(vocab + 1): 1.0})
    assert str(vocab + 1) in str(e.value) and str(vocab) in str(e.value)
    with pytest.raises(openai.BadRequestError, match=r"bad1.*bad2"):  # every bad key at once, as vLLM
        client.completions.create(model=M, prompt="x", max_tokens=2, logit_bias={"bad1": 1.0, "bad2": 2.0})


def test_include_stop_str_in_output(client):
    full = client.completions.create(model=M, prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    cut = full[:full.index(stop)]
    for include, text in ((False, cut), (True, cut + stop)):
        resp = client.completions.create(model=M, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                                         extra_body=dict(include_stop_str_in_output=include))
        assert (resp.choices[0].text, resp.choices[0].finish_reason, resp.choices[0].stop_reason) == \
            (text, "stop", stop)


def test_echo_with_prompt_logprobs(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    resp = client.completions.create(model=M, prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True, logprobs=1)
    c, lp = resp.choices[0], resp.choices[0].logprobs
    ref = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert c.text == PROMPTS[1] + ref.outputs[0].text and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([d[t].logprob for t, d in
                                                            zip(ids[1:], ref.prompt_logprobs[1:])], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    only = client.completions.create(model=M, prompt=PROMPTS[1], max_tokens=0, echo=True)  # the prompt alone
    assert only.choices[0].text == PROMPTS[1]


def test_beam_search_through_the_server(client, llm):
    resp = client.completions.create(model=M, prompt=PROMPTS[2], n=3, max_tokens=5, temperature=0,
                                     extra_body=dict(use_beam_search=True, length_penalty=0.0, return_token_ids=True))
    n = len(llm.get_tokenizer().encode(PROMPTS[2]))
    [ref] = beam_search(llm, [PROMPTS[2]], BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.0))
    assert [c.token_ids for c in resp.choices] == [s.tokens[n:] for s in ref.sequences]
    assert [c.text for c in resp.choices] == [s.text[len(PROMPTS[2]):] for s in ref.sequences]
    assert all(c.finish_reason == "length" for c in resp.choices) and len({c.text for c in resp.choices}) == 3
    chat = client.chat.completions.create(model=M, messages=USER, n=2, max_tokens=4, temperature=0,
                                          extra_body=dict(use_beam_search=True))
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="beam search"):
        client.completions.create(model=M, prompt="x", n=2, max_tokens=2, stream=True,
                                  extra_body=dict(use_beam_search=True))


def test_message_content_as_a_list_of_text_parts(client):
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Sort"}, {"type": "text", "text": "it."}]}]
    joined = [{"role": "user", "content": "Sort\nit."}]  # vLLM joins a string template's text parts by newlines
    kw = dict(model=M, max_tokens=6, temperature=0, extra_body=dict(return_prompt_text=True))
    a = client.chat.completions.create(messages=as_parts, **kw)
    b = client.chat.completions.create(messages=joined, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.model_extra["prompt_text"] == "<|user|>Sort\nit.\n<|assistant|>"
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model=M, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


def test_a_model_by_id_and_unknown_routes(server, client):
    card = client.models.retrieve(M)
    assert (card.id, card.object, card.model_extra["max_model_len"]) == (M, "model", 128)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    status, _, text = http(server[1] + "/v1/nothing/here")
    assert status == 404 and json.loads(text)["error"]["code"] == 404


def test_the_context_length_as_vllm_words_it(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    long = (ids * 40)[:130]
    with pytest.raises(openai.BadRequestError, match=r"This model's maximum context length is 128 tokens\. However, "
                                                     r"your prompt contains 130 input tokens"):
        client.completions.create(model=M, prompt=long, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"The decoder prompt \(length 128\) plus the number of requested "
                                                     r"output tokens \(at least 1\) is longer than the maximum model "
                                                     r"length of 128"):
        client.completions.create(model=M, prompt=long[:128], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens=200 cannot be greater than max_model_len=128"):
        client.completions.create(model=M, prompt="x", max_tokens=200)
    # vLLM 0.33's get_max_tokens: a prompt that fits gets what is left of the context, not a refusal
    resp = client.completions.create(model=M, prompt=long[:120], max_tokens=16, temperature=0)
    assert resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length"
    # truncate_prompt_tokens=-1 keeps max_model_len - 1 tokens, from the left end here
    resp = client.completions.create(model=M, prompt=long, max_tokens=4, temperature=0, extra_body=dict(
        truncate_prompt_tokens=-1, truncation_side="left", return_token_ids=True))
    assert resp.choices[0].prompt_token_ids == long[-127:] and resp.usage.completion_tokens == 1
    # a chat request without max_tokens runs to the context's end (vLLM's get_max_tokens with no
    # generation_config max_new_tokens), not SamplingParams' default 16; small-gqa has no EOS
    resp = client.chat.completions.create(model=M, messages=USER, temperature=0)
    assert resp.usage.total_tokens == 128 and resp.choices[0].finish_reason == "length"


def test_request_id_names_the_response(client):
    resp = client.completions.create(model=M, prompt="x", max_tokens=1, extra_body=dict(request_id="abc"))
    assert resp.id == "cmpl-abc"
    resp = client.completions.create(model=M, prompt="x", max_tokens=1, extra_headers={"X-Request-Id": "hdr"},
                                     extra_body=dict(request_id="abc"))
    assert resp.id == "cmpl-hdr"


def test_return_tokens_as_token_ids(client, llm):
    resp = client.completions.create(model=M, prompt=PROMPTS[3], max_tokens=3, temperature=0, logprobs=1,
                                     extra_body=dict(return_tokens_as_token_ids=True, return_token_ids=True))
    c = resp.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.token_ids]
    assert c.prompt_token_ids == llm.get_tokenizer().encode(PROMPTS[3])
    chat = client.chat.completions.create(model=M, messages=USER, max_tokens=3, temperature=0, logprobs=True,
                                          extra_body=dict(return_tokens_as_token_ids=True, return_token_ids=True))
    assert [x.token for x in chat.choices[0].logprobs.content] == \
        [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]


# ----------------------------------------------------------------------------------- --api-key
def test_api_key_as_vllm_has_it(monkeypatch):
    with serving(api_key=["k1", "k2"], **COMMON) as (engine, base):
        for key in ("k1", "k2"):
            ok = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
            assert ok.completions.create(model=M, prompt="x", max_tokens=1).usage.completion_tokens == 1
            assert ok.models.list().data[0].id == M
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=M, prompt="x", max_tokens=1)
        assert e.value.status_code == 401 and e.value.body["code"] == 401 and e.value.body["message"] == "Unauthorized"
        status, _, text = http(base + "/v1/models")  # no header at all
        assert status == 401 and json.loads(text)["error"]["type"] == "AuthenticationError"
        assert http(base + "/health")[0] == 200 and http(base + "/metrics")[0] == 200  # open, as in vLLM
    for names, want in (((), []), (("VLLM_API_KEY",), ["v"]), (("KVJAX_API_KEY", "VLLM_API_KEY"), ["kv"])):
        for name in ("KVJAX_API_KEY", "VLLM_API_KEY"):
            monkeypatch.delenv(name, raising=False)
        for name in names:
            monkeypatch.setenv(name, "kv" if name == "KVJAX_API_KEY" else "v")
        assert api_keys() == want and api_keys(["flag"]) == ["flag"]  # --api-key wins over the environment


# ----------------------------------------------------------------------------------- structured outputs
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def _valid(value, schema) -> bool:
    """A hand-written check of SCHEMA's rules (no schema library here)."""
    return (isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["name"], str)
            and len(value["name"]) <= 6 and isinstance(value["age"], int) and 0 <= value["age"] <= 99)


def test_structured_outputs_over_the_server(client):
    strict = {"disable_any_whitespace": True}
    for seed in range(3):
        resp = client.completions.create(model=M, prompt="Person: ", max_tokens=60, temperature=1.0, seed=seed,
                                         extra_body=dict(structured_outputs={"json": SCHEMA, **strict}))
        assert resp.choices[0].finish_reason == "stop" and _valid(json.loads(resp.choices[0].text), SCHEMA)
        chat = client.chat.completions.create(
            model=M, messages=USER, max_tokens=60, temperature=1.0, seed=seed, response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
            extra_body=dict(structured_outputs=strict))
        assert _valid(json.loads(chat.choices[0].message.content), SCHEMA)
        choice = client.completions.create(model=M, prompt="Yes or no? ", max_tokens=8, temperature=1.0, seed=seed,
                                           extra_body=dict(structured_outputs={"choice": ["yes", "no", "perhaps"]}))
        assert choice.choices[0].text in ("yes", "no", "perhaps")
        email = client.completions.create(model=M, prompt="Mail: ", max_tokens=30, temperature=1.0, seed=seed,
                                          extra_body=dict(structured_outputs={"regex": r"[a-z]{2,5}@[a-z]{2,5}\.com"}))
        assert re.fullmatch(r"[a-z]{2,5}@[a-z]{2,5}\.com", email.choices[0].text)
        sql = client.completions.create(model=M, prompt="SQL: ", max_tokens=40, temperature=1.0, seed=seed,
                                        extra_body=dict(structured_outputs={"grammar": (
                                            'root ::= "SELECT " col " FROM " tab\ncol ::= "a" | "b"\n'
                                            'tab ::= "t1" | "t2"')}))
        assert re.fullmatch(r"SELECT [ab] FROM t[12]", sql.choices[0].text)
    for bad in ({"regex": "[.*"}, {"grammar": "root ::= nothing_defined"}, {"json": {"type": "object", "foo": 1,
                                                                                       "properties": {"a": "bar"}}},
                {"regex": "a", "choice": ["a"]}, {"structural_tag": "{}"}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=M, prompt="x", max_tokens=4, extra_body=dict(structured_outputs=bad))
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model=M, messages=USER, max_tokens=4, response_format={"type": "json_schema"})
