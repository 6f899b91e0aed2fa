"""POST /v1/chat/completions' prompt and replies (vLLM's `entrypoints/openai/chat_completion/serving.py`).

The conversation is rendered as LLM.chat renders it (LLMEngine.render_chat with the engine's chat
template, the request's add_generation_prompt, continue_final_message, documents and
chat_template_kwargs, tools and reasoning_effort); message content given as a list of text parts is
joined by newlines for a template that expects strings (vLLM's content format "auto": a template that
loops over a message's content gets the parts). The reply's role is the assistant's, or without a
generation prompt the last message's. logprobs come in OpenAI's chat format, per token
    {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}
where top_logprobs lists the first top_logprobs entries of the engine's dict in its order (the
chosen token first, then the most likely: vLLM's chat_top_logprobs_limit), all of them for -1.
A stream opens with one chunk per choice giving its role (and with echo, one giving the echoed
text), then one choice's news per chunk; stream_options' usage as in serving_completion (here one
prompt, counted once however many choices).
"""
from __future__ import annotations

import functools
from typing import AsyncIterator

import jinja2
import jinja2.nodes

from kvjax.engine.async_llm import AsyncLLM
from kvjax.engine.outputs import Logprob, RequestOutput
from kvjax.entrypoints.openai.api_utils import StreamUsage, clamp, merge, timing_metrics, usage
from kvjax.entrypoints.openai.protocol import ChatCompletionRequest, InvalidRequest
from kvjax.entrypoints.openai.serving_completion import prompt_logprobs_json

_TEXT_PARTS = ("text", "input_text", "output_text")  # vLLM's text content parts


@functools.lru_cache(maxsize=32)
def content_format(template: str) -> str:
    """vLLM's `_detect_content_format`: "openai" when the template loops over a message's content
    (it expects a list of parts), else "string" (the parts are joined into one string first)."""
    try:
        root = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    messages = {loop.target.name for loop in root.find_all(jinja2.nodes.For)
                if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, "messages")}
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, m, "content") for m in messages):
            return "openai"
    return "string"


def _reads(node, name: str, key: str | None = None) -> bool:
    """node is `name` (or a slice of it, or filtered), or with key `name['key']` / `name.key`."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        node = node.node
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name == name
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _reads(node.node, name)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return node.arg.value == key and _reads(node.node, name)
    return False


def _string_content(messages: list[dict]) -> list[dict]:
    """vLLM's "string" content format: each list of text parts joined by newlines; a part that is
    not text (images, audio) is refused, kvjax serving text models only."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type", "text") if isinstance(part, dict) else None
                if isinstance(part, str):
                    texts.append(part)
                elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "refusal" and isinstance(part.get("refusal"), str):
                    texts.append(part["refusal"])
                else:
                    raise InvalidRequest(f"messages[{i}].content: a {kind or type(part).__name__!r} part is not "
                                         "supported by kvjax (text models only: text parts)", "messages")
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


def render_prompt(engine: AsyncLLM, body: ChatCompletionRequest) -> str:
    """The conversation as LLM.chat renders it (LLMEngine.render_chat: the engine's chat template),
    list-of-parts content joined for a template that expects strings (vLLM's content format "auto")."""
    template = engine.llm_engine.chat_template
    if not template:
        raise InvalidRequest(f"model {engine.vllm_config.model!r} has no chat template: serve it with "
                             "--chat-template", "messages")
    messages = body.messages
    if content_format(str(template)) == "string":
        messages = _string_content(messages)
    return engine.llm_engine.render_chat(messages, **body.template_options())


def echoed_text(body: ChatCompletionRequest) -> str:
    """What echo puts before the reply (vLLM's): the last message's content when it has the reply's
    role (a list of text parts joined by newlines), else nothing."""
    if not body.echo or not body.messages or body.messages[-1].get("role") != body.response_role():
        return ""
    content = body.messages[-1].get("content") or ""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _entry(token: str, lp: Logprob, with_bytes: bool = True) -> dict:
    return {"token": token, "logprob": clamp(lp.logprob),
            "bytes": list(token.encode("utf-8", errors="replace")) if with_bytes else None}


def chat_logprobs(token_ids, steps: list[dict[int, Logprob]], top_logprobs: int, tokenizer,
                  as_id: bool = False) -> dict:
    """vLLM's _create_chat_logprobs over a choice's tokens (or a chunk's new ones) and their dicts;
    as_id: tokens written "token_id:<id>" (return_tokens_as_token_ids)."""
    limit = None if top_logprobs == -1 else top_logprobs

    def text(token_id: int, lp: Logprob | None) -> str:
        if as_id:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return tokenizer.decode([token_id])

    content = []
    for token_id, step in zip(token_ids, steps):
        chosen = step.get(token_id)
        if chosen is None:  # vLLM's: no logprob for this token, its text alone
            piece = text(token_id, None)
            content.append({"token": piece, "logprob": -9999.0, "bytes": list(piece.encode("utf-8", errors="replace")),
                            "top_logprobs": []})
            continue
        entry = _entry(text(token_id, chosen), chosen, with_bytes=chosen.decoded_token is not None)
        entry["top_logprobs"] = [_entry(text(t, lp), lp) for t, lp in list(step.items())[:limit]]
        content.append(entry)
    return {"content": content}


def _choice_logprobs(body: ChatCompletionRequest, c, tokenizer) -> dict | None:
    if not body.logprobs:
        return None
    return chat_logprobs(c.token_ids, c.logprobs or [], body.top_logprobs or 0, tokenizer,
                         bool(body.return_tokens_as_token_ids))


def chat_response(head: dict, body: ChatCompletionRequest, out: RequestOutput, tokenizer, prompt: str) -> dict:
    """The reply to a request that does not stream: its n choices and the usage (with
    return_token_ids each choice's token_ids and the prompt's; with return_prompt_text the rendered
    prompt; with prompt_logprobs or echo the prompt's log-probabilities, as vLLM)."""
    role, echo = body.response_role(), echoed_text(body)
    choices = []
    for c in out.outputs:
        choice = {"index": c.index, "message": {"role": role, "content": echo + c.text},
                  "logprobs": _choice_logprobs(body, c, tokenizer), "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        choice["token_ids"] = list(c.token_ids) if body.return_token_ids else None
        choices.append(choice)
    # every field of vLLM's ChatCompletionResponse, null when not asked for
    return {**head, "choices": choices, "usage": usage([out]),
            "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
            "prompt_token_ids": list(out.prompt_token_ids) if body.return_token_ids else None,
            "prompt_text": prompt if body.return_prompt_text else None}


async def chat_chunks(head: dict, body: ChatCompletionRequest, gen, tokenizer, prompt: str,
                      per_request_metrics: bool = False) -> AsyncIterator[dict]:
    """A streamed reply's chunks. The opening chunks wait for the engine's first output, as vLLM's do
    (their continuous usage needs the prompt's length). per_request_metrics: the usage chunk carries the
    request's timings when it has one choice (vLLM's --enable-per-request-metrics)."""
    include_usage, continuous_usage = body.usage_flags()
    role, echo, n = body.response_role(), echoed_text(body), body.n or 1
    counts = StreamUsage()

    def chunk(index: int, delta: dict, **fields) -> dict:
        out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None,
                                    **fields}]}
        if continuous_usage:
            out["usage"] = counts.of_choice(0, index)
        return out

    first, last = True, None
    async for _, out in merge([gen]):
        last = out
        if first:
            first = False
            counts.prompt[0] = len(out.prompt_token_ids)
            for index in range(n):
                opening = chunk(index, {"role": role, "content": ""})
                if index == 0 and body.return_token_ids:  # vLLM: the prompt's ids on the first chunk only
                    opening["prompt_token_ids"] = list(out.prompt_token_ids)
                if index == 0 and body.return_prompt_text:
                    opening["prompt_text"] = prompt
                yield opening
            for index in range(n if echo else 0):
                yield chunk(index, {"content": echo})
        for c in out.outputs:
            counts.add(0, out, c.index, len(c.token_ids))
            ids = {"token_ids": list(c.token_ids)} if body.return_token_ids else {}
            yield chunk(c.index, {"content": c.text}, logprobs=_choice_logprobs(body, c, tokenizer),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason, **ids)
    if include_usage:
        final = {**head, "choices": [], "usage": counts.total()}
        if per_request_metrics and n == 1 and last is not None:
            final["metrics"] = timing_metrics(last.metrics, final["usage"]["completion_tokens"])
        yield final
