"""`kvjax serve`'s vLLM extras (kvjax.entrypoints.openai: serving_completion, serving_chat, api_utils,
protocol): stream_options' usage, chat logprobs, the chat template's options, clients that leave, and
vLLM's request-level 400s. One server on small-gqa for the module, OpenAI's client over loopback, raw
sockets where a test must hang up mid-reply.

References, none of them the server's code: LLM.generate on the same engine arguments (the offline
path, checked against transformers in tests/engine/test_llm.py) for tokens and logprobs; the tokenizer
on the prompt for prompt_tokens; jinja2 itself (with transformers' trim_blocks / lstrip_blocks) for the
rendered conversation; the engine's block pool and its finished_reason counters for what a
disconnect freed."""
from __future__ import annotations

import json
import threading

import jinja2
import openai
import pytest

from serving import finished_count, http, metric, post_raw, read_events, wait_idle

from kvjax import SamplingParams
from kvjax.engine.outputs import Logprob
from kvjax.entrypoints.openai.protocol import ChatCompletionRequest
from kvjax.entrypoints.openai.serving_chat import chat_logprobs

# Short prompts (at most 32 tokens, as PROMPTS') keep the engine on the programs it compiled already.
TEMPLATE = ("{% if hint %}({{ hint }}){% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
COMMON = dict(model="small-gqa", num_gpu_blocks_override=64, max_num_seqs=4, chat_template=TEMPLATE,
              use_tqdm_on_load=False)
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "The key to"]
MESSAGES = [{"role": "user", "content": "Sort it."}]
M = "small-gqa"


# server, client, llm, greedy: tests/entrypoints/conftest.py (from COMMON and PROMPTS)


def _render(messages, **variables) -> str:
    """The conversation as transformers renders a chat template (jinja2 with trim_blocks, lstrip_blocks)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(TEMPLATE).render(messages=messages, **{"add_generation_prompt": True, **variables})


def _n_tokens(llm, text: str) -> int:
    return len(llm.get_tokenizer().encode(text))


# ----------------------------------------------------------------------------------- stream_options
def test_completion_stream_usage(client, llm):
    params = SamplingParams(n=2, max_tokens=8, temperature=0.9, seed=7)
    ref = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    prompt_tokens = sum(_n_tokens(llm, p) for p in PROMPTS[:2])  # each prompt once, not once per choice
    completion_tokens = sum(len(c.token_ids) for o in ref for c in o.outputs)
    kw = dict(model=M, prompt=PROMPTS[:2], n=2, max_tokens=8, temperature=0.9, seed=7, stream=True)

    chunks = list(client.completions.create(**kw, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and all(c.usage is None and len(c.choices) == 1 for c in body)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
    texts = {}
    for c in body:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {i * 2 + j: ref[i].outputs[j].text for i in range(2) for j in range(2)}

    chunks = list(client.completions.create(**kw, stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.total_tokens == prompt_tokens + completion_tokens
    seen: dict[int, int] = {}
    for c in body:  # each chunk: its own prompt and its own choice's tokens so far
        i = c.choices[0].index
        assert c.usage.prompt_tokens == _n_tokens(llm, PROMPTS[i // 2])
        assert c.usage.completion_tokens >= seen.get(i, 0)
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        seen[i] = c.usage.completion_tokens
    assert seen == {i * 2 + j: len(ref[i].outputs[j].token_ids) for i in range(2) for j in range(2)}

    # continuous_usage_stats alone is nothing (vLLM's: only with include_usage); no usage chunk either
    chunks = list(client.completions.create(**kw, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_chat_stream_usage(client, llm):
    ref = llm.generate([_render(MESSAGES)], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    prompt_tokens = _n_tokens(llm, _render(MESSAGES))
    chunks = list(client.chat.completions.create(model=M, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}))
    role, *body, last = chunks
    assert role.choices[0].delta.role == "assistant"
    assert (role.usage.prompt_tokens, role.usage.completion_tokens) == (prompt_tokens, 0)
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.outputs[0].text
    assert body[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (prompt_tokens, len(ref.outputs[0].token_ids), prompt_tokens + len(ref.outputs[0].token_ids))


# ----------------------------------------------------------------------------------- chat logprobs
def _expected_logprobs(llm, out, k: int) -> list[dict]:
    """OpenAI's chat entries from LLM.generate's dicts: the chosen token, and the first k of its
    dict (the chosen token, then the most likely), each token's text by the tokenizer."""
    tok = llm.get_tokenizer()
    rows = []
    for t, step in zip(out.token_ids, out.logprobs):
        text = tok.decode([t])
        tops = [{"token": tok.decode([u]), "logprob": lp.logprob, "bytes": list(tok.decode([u]).encode())}
                for u, lp in list(step.items())[:k]]
        rows.append({"token": text, "logprob": step[t].logprob, "bytes": list(text.encode()), "top_logprobs": tops})
    return rows


def _assert_entries(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.token, g.bytes) == (w["token"], w["bytes"]) and g.logprob == pytest.approx(w["logprob"], abs=1e-4)
        assert [(t.token, t.bytes) for t in g.top_logprobs] == [(t["token"], t["bytes"]) for t in w["top_logprobs"]]
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([t["logprob"] for t in w["top_logprobs"]],
                                                                    abs=1e-4)


def test_chat_logprobs_match_llm_generate(client, llm):
    prompt = _render(MESSAGES)
    kw = dict(model=M, messages=MESSAGES, max_tokens=8, temperature=0.8, seed=3)
    ref = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2),
                       use_tqdm=False)[0].outputs[0]

    resp = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    assert resp.choices[0].message.content == ref.text
    _assert_entries(resp.choices[0].logprobs.content, _expected_logprobs(llm, ref, 2))

    assert client.chat.completions.create(**kw).choices[0].logprobs is None

    chunks = list(client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, stream=True))
    assert chunks[0].choices[0].logprobs is None  # the role chunk
    streamed = [e for c in chunks[1:] for e in c.choices[0].logprobs.content]
    _assert_entries(streamed, _expected_logprobs(llm, ref, 2))


def test_chat_logprobs_without_top_logprobs():
    """logprobs alone asks the engine for the chosen token's log-probability only (vLLM's
    SamplingParams.logprobs = top_logprobs = 0), and lists no alternatives."""
    default = SamplingParams()
    for body, k in [(dict(logprobs=True), 0), (dict(logprobs=True, top_logprobs=None), 0),
                    (dict(logprobs=True, top_logprobs=5), 5), (dict(logprobs=False), None), ({}, None)]:
        req = ChatCompletionRequest(messages=MESSAGES, **body)
        req.check()
        assert req.to_sampling_params(default_sampling_params=default).logprobs == k
    out = chat_logprobs([66], [{66: Logprob(-0.5, 2, "B")}], 0, None)
    assert out == {"content": [{"token": "B", "logprob": -0.5, "bytes": [66], "top_logprobs": []}]}


def test_chat_logprobs_clamp_minus_infinity(llm):
    tok = llm.get_tokenizer()
    out = chat_logprobs([65], [{65: Logprob(float("-inf"), 256, "A"), 66: Logprob(-0.1, 1, "B")}], 2, tok)
    (entry,) = out["content"]
    assert (entry["token"], entry["logprob"], entry["bytes"]) == ("A", -9999.0, [65])
    assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [("A", -9999.0), ("B", -0.1)]
    assert json.dumps(out)  # strict JSON: no -Infinity


# ----------------------------------------------------------------------------------- template options
def test_chat_template_options(client, llm):
    greedy = SamplingParams(max_tokens=6, temperature=0)

    def reply(prompt: str) -> str:
        return llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text

    kw = dict(model=M, max_tokens=6, temperature=0)
    resp = client.chat.completions.create(**kw, messages=MESSAGES, extra_body=dict(
        chat_template_kwargs={"hint": "terse", "add_generation_prompt": False}))  # the request's field wins
    prompt = _render(MESSAGES, hint="terse")
    assert resp.usage.prompt_tokens == _n_tokens(llm, prompt) and resp.choices[0].message.content == reply(prompt)

    resp = client.chat.completions.create(**kw, messages=MESSAGES, extra_body=dict(add_generation_prompt=False))
    prompt = _render(MESSAGES, add_generation_prompt=False)
    assert resp.usage.prompt_tokens == _n_tokens(llm, prompt) and resp.choices[0].message.content == reply(prompt)

    # continue_final_message: transformers cuts the rendering right after the final message's content
    partial = MESSAGES + [{"role": "assistant", "content": "def f("}]
    full = _render(partial, add_generation_prompt=False)
    prompt = full[:full.rindex("def f(") + len("def f(")]
    body = dict(add_generation_prompt=False, continue_final_message=True, echo=True)
    resp = client.chat.completions.create(**kw, messages=partial, extra_body=body)
    assert resp.usage.prompt_tokens == _n_tokens(llm, prompt)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == "def f(" + reply(prompt)  # echo: the last message first
    chunks = list(client.chat.completions.create(**kw, messages=partial, extra_body=body, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.content == "def f("
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "def f(" + reply(prompt)
    resp = client.chat.completions.create(**kw, messages=MESSAGES, extra_body=dict(echo=True))
    assert resp.choices[0].message.content == reply(_render(MESSAGES))  # last message is the user's: no echo


# ----------------------------------------------------------------------------------- batch chat completions
def test_batch_chat_completions_answer_each_conversation(server, llm):
    convs = [MESSAGES, [{"role": "user", "content": "Reverse it."}], [{"role": "system", "content": "Be brief."},
                                                                      *MESSAGES]]
    refs = llm.generate([_render(c) for c in convs], SamplingParams(max_tokens=6, temperature=0, logprobs=2),
                        use_tqdm=False)
    body = dict(model=M, messages=convs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    status, _, text = http(server[1] + "/v1/chat/completions/batch", body)
    assert status == 200, text
    reply = json.loads(text)
    assert reply["object"] == "chat.completion" and reply["id"].startswith("chatcmpl-")
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]  # one choice per conversation, in order
    assert [c["message"]["content"] for c in reply["choices"]] == [r.outputs[0].text for r in refs]
    assert [e["logprob"] for c in reply["choices"] for e in c["logprobs"]["content"]] == pytest.approx(
        [lp[t].logprob for r in refs for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)], abs=1e-4)
    assert reply["usage"] == {"prompt_tokens": sum(_n_tokens(llm, _render(c)) for c in convs),
                              "completion_tokens": 18, "total_tokens": reply["usage"]["prompt_tokens"] + 18}
    for bad, param in [(dict(n=2), "n"), (dict(use_beam_search=True), "use_beam_search"), (dict(stream=True), "stream"),
                       (dict(messages=[MESSAGES, []]), "messages"), (dict(messages=[]), "body.messages"),
                       (dict(logprobs=True, top_logprobs=21), "top_logprobs"), (dict(cache_salt="s"), "cache_salt")]:
        status, _, text = http(server[1] + "/v1/chat/completions/batch", {**body, **bad})
        assert status == 400 and json.loads(text)["error"]["param"] == param, (bad, text)


# ----------------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", dict(prompt="x", stream_options={"include_usage": True}), "stream_options", "stream=True"),
    ("/v1/chat/completions", dict(messages=MESSAGES, stream=False, stream_options={"include_usage": False}),
     "stream_options", "stream=True"),
    ("/v1/chat/completions", dict(messages=MESSAGES, top_logprobs=3), "top_logprobs", "(3)"),
    ("/v1/chat/completions", dict(messages=MESSAGES, logprobs=False, top_logprobs=2), "top_logprobs", "(2)"),
    ("/v1/chat/completions", dict(messages=MESSAGES, logprobs=True, top_logprobs=21), "top_logprobs", "=21"),
    ("/v1/chat/completions", dict(messages=MESSAGES, logprobs=True, top_logprobs=-1), "top_logprobs", "=-1"),
    ("/v1/chat/completions", dict(messages=MESSAGES, logprobs=True, top_logprobs=-2), "top_logprobs", "-2"),
    ("/v1/chat/completions", dict(messages=MESSAGES, continue_final_message=True), "continue_final_message",
     "add_generation_prompt"),
    ("/v1/chat/completions", dict(messages=MESSAGES, chat_template_kwargs={"messages": []}), "chat_template_kwargs",
     "'messages'"),
    ("/v1/chat/completions", dict(messages=MESSAGES, chat_template_kwargs={"template": "{{ 1 }}"}),
     "chat_template_kwargs", "'template'"),
])
def test_bad_requests_are_400(server, path, body, param, words):
    status, _, text = http(server[1] + path, dict(model=M, max_tokens=2, **body))
    assert status == 400, text
    err = json.loads(text)["error"]
    assert (err["type"], err["code"], err["param"]) == ("BadRequestError", 400, param) and words in err["message"]


def test_bad_requests_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=M, messages=MESSAGES, top_logprobs=3, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stream=True"):
        client.completions.create(model=M, prompt="x", max_tokens=2, stream_options={"include_usage": True})
    # vLLM tests the raw body's truthiness: an empty stream_options without stream is allowed
    status, _, text = http(server[1] + "/v1/completions", dict(model=M, prompt="x", max_tokens=2, stream_options={}))
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
    wait_idle(server[0])


# ----------------------------------------------------------------------------------- clients that leave
def test_eight_streams_half_of_them_leaving(server, client, greedy):
    """4 clients read a stream to the end while 4 hang up after 3 events: the finished ones get
    LLM.generate's greedy tokens, the others are aborted, and every block is free after."""
    engine, base = server
    aborted = finished_count(engine, "abort")
    finished, errors = [None] * 4, []

    def finish(i):
        try:
            chunks = client.completions.create(model=M, prompt=PROMPTS[i], max_tokens=12, temperature=0, stream=True)
            finished[i] = "".join(c.choices[0].text for c in chunks)
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    def leave(i):
        try:
            path = "/v1/completions" if i % 2 else "/v1/chat/completions"
            body = dict(model=M, max_tokens=300, temperature=0, stream=True, ignore_eos=True)
            body.update(prompt=PROMPTS[i]) if i % 2 else body.update(messages=MESSAGES)
            sock = post_raw(base, path, body)
            got = read_events(sock, 3)
            assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
            sock.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=f, args=(i,)) for i in range(4) for f in (finish, leave)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert finished == greedy
    wait_idle(engine)
    assert finished_count(engine, "abort") == aborted + 4
    resp = client.completions.create(model=M, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert resp.choices[0].text == greedy[0]  # the server still answers


@pytest.mark.parametrize("path, body", [("/v1/completions", dict(prompt=PROMPTS[1])),
                                        ("/v1/chat/completions", dict(messages=MESSAGES))])
def test_a_client_that_leaves_before_the_reply_aborts_it(server, path, body):
    engine, base = server
    aborted, made = finished_count(engine, "abort"), metric(engine, "vllm:generation_tokens")
    sock = post_raw(base, path, dict(model=M, max_tokens=900, temperature=0, ignore_eos=True, **body))
    for _ in range(500):  # until the engine runs the request (it has made a token)
        # The metrics are the engine's state readable from any thread; its scheduler's device arrays
        # are not (a step donates them while this thread would read them).
        if metric(engine, "vllm:generation_tokens") > made:
            break
        threading.Event().wait(0.01)
    sock.close()
    wait_idle(engine)
    assert finished_count(engine, "abort") == aborted + 1  # aborted, not run to its 900 tokens
    assert http(base + "/health")[0] == 200
