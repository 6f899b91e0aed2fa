"""`kvjax serve` (kvjax.entrypoints.openai.api_server): OpenAI's own client over loopback against the
server in a background thread, on small-gqa.

Reference: LLM.generate / LLM.chat on the same model and sampling params (the synchronous path of the
same engine, checked against transformers in tests/engine/test_llm.py); the block pool's own count of
free blocks for a stream the client left."""
from __future__ import annotations

import json
import threading

import openai
import pytest

from serving import http, wait_idle

from kvjax import SamplingParams
from kvjax.commands.main import build_parser
from kvjax.commands.serve import resolve_model

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
COMMON = dict(model="small-gqa", num_gpu_blocks_override=64, max_num_seqs=4, chat_template=TEMPLATE,
              use_tqdm_on_load=False)
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "The key to"]
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


# server, client, llm, greedy: tests/entrypoints/conftest.py (from COMMON and PROMPTS)


def _stream_text(client, prompt, **kw):
    chunks = list(client.completions.create(model="small-gqa", prompt=prompt, stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks)
    return text, chunks


def test_completions_match_llm_generate(client, greedy):
    resp = client.completions.create(model="small-gqa", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == greedy
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 48 and resp.usage.total_tokens == resp.usage.prompt_tokens + 48
    text, chunks = _stream_text(client, PROMPTS[0], max_tokens=12, temperature=0)
    assert text == greedy[0] and chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != resp.id


def test_token_id_prompt_and_vllm_extra_fields(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(max_tokens=10, temperature=0, top_k=5, min_p=0.01, repetition_penalty=1.2,
                            ignore_eos=True, min_tokens=3)
    ref = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].text
    resp = client.completions.create(model="small-gqa", prompt=ids, max_tokens=10, temperature=0,
                                     extra_body=dict(top_k=5, min_p=0.01, repetition_penalty=1.2, ignore_eos=True,
                                                     min_tokens=3))
    assert resp.choices[0].text == ref


def test_n_samples_with_a_seed_and_logprobs(client, llm):
    params = SamplingParams(n=2, max_tokens=8, temperature=0.9, seed=7, logprobs=2)
    ref = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    resp = client.completions.create(model="small-gqa", prompt=PROMPTS[1], n=2, max_tokens=8, temperature=0.9,
                                     seed=7, logprobs=2)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [c.text for c in ref.outputs]
    for choice, out in zip(resp.choices, ref.outputs):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert lp.token_logprobs == pytest.approx([step[t].logprob for t, step in zip(out.token_ids, out.logprobs)],
                                                  abs=1e-4)
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
        assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    texts = {}
    for chunk in client.completions.create(model="small-gqa", prompt=PROMPTS[1], n=2, max_tokens=8, temperature=0.9,
                                           seed=7, stream=True):
        (c,) = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: ref.outputs[0].text, 1: ref.outputs[1].text}


def test_chat_completions_match_llm_chat(client, llm):
    ref = llm.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    resp = client.chat.completions.create(model="small-gqa", messages=MESSAGES, max_completion_tokens=10,
                                          temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) and resp.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model="small-gqa", messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_a_template_is_a_bad_request(server, client, monkeypatch):
    monkeypatch.setattr(server[0].llm_engine, "chat_template", None)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="small-gqa", messages=MESSAGES, max_tokens=4)


def test_errors_have_openai_shape(server, client):
    engine, base = server
    status, _, text = http(base + "/v1/completions", dict(model="small-gqa", prompt="x", temperature=-1))
    assert status == 400
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and "temperature" in err["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="small-gqa", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    status, _, _ = http(base + "/v1/completions", dict(model="small-gqa", prompt="x", stream=True, temperature=-1))
    assert status == 400  # checked before the stream starts
    status, _, text = http(base + "/v1/completions", dict(model="small-gqa"))  # no prompt
    assert status == 400 and "prompt" in json.loads(text)["error"]["message"]
    wait_idle(engine)


def test_health_models_and_metrics(server, client):
    base = server[1]
    assert http(base + "/health")[0] == 200
    assert [m.id for m in client.models.list().data] == ["small-gqa"]
    status, headers, text = http(base + "/metrics")
    assert status == 200 and "vllm:prompt_tokens" in text and headers["content-type"].startswith("text/plain")


def test_concurrent_streaming_clients(client, greedy):
    results = [None] * 4

    def one(i):
        results[i] = _stream_text(client, PROMPTS[i], max_tokens=12, temperature=0)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == greedy


def test_a_client_that_leaves_a_stream_frees_its_request(server, client):
    engine = server[0]
    stream = client.completions.create(model="small-gqa", prompt=PROMPTS[0], max_tokens=300, temperature=0,
                                       stream=True, extra_body=dict(ignore_eos=True))
    for _, _chunk in zip(range(3), stream):
        pass
    assert engine.llm_engine.has_unfinished_requests()
    stream.close()
    wait_idle(engine)


def test_serve_command_line():
    args = build_parser("serve").parse_args(["serve", "small-gqa", "--port", "0", "--max-num-seqs", "4",
                                             "--served-model-name", "m"])
    resolve_model(args)
    assert (args.model, args.host, args.port, args.max_num_seqs, args.served_model_name) == \
        ("small-gqa", "127.0.0.1", 0, 4, "m")
    args = build_parser("serve").parse_args(["serve", "--model", "small-mla"])
    resolve_model(args)
    assert args.model == "small-mla" and args.port == 8000
