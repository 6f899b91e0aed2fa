"""POST /v1/chat/completions' prompt and replies (vLLM's `entrypoints/openai/chat_completion/serving.py`).

The conversation is rendered as LLM.chat renders it (LLMEngine.render_chat with the engine's chat
template, the request's add_generation_prompt, continue_final_message, documents and
chat_template_kwargs). The reply's role is the assistant's, or without a generation prompt the last
message's. logprobs come in OpenAI's chat format, per token
    {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}
where top_logprobs lists the first top_logprobs entries of the engine's dict in its order (the
chosen token first, then the most likely: vLLM's chat_top_logprobs_limit), all of them for -1.
A stream opens with one chunk per choice giving its role (and with echo, one giving the echoed
text), then one choice's news per chunk; stream_options' usage as in serving_completion (here one
prompt, counted once however many choices).
"""
from __future__ import annotations

from typing import AsyncIterator

from kvjax.engine.async_llm import AsyncLLM
from kvjax.engine.outputs import Logprob, RequestOutput
from kvjax.entrypoints.openai.api_utils import StreamUsage, clamp, merge, usage
from kvjax.entrypoints.openai.protocol import ChatCompletionRequest, InvalidRequest


def render_prompt(engine: AsyncLLM, body: ChatCompletionRequest) -> str:
    """The conversation as LLM.chat renders it (LLMEngine.render_chat: the engine's chat template)."""
    if not engine.llm_engine.chat_template:
        raise InvalidRequest(f"model {engine.vllm_config.model!r} has no chat template: serve it with "
                             "--chat-template", "messages")
    return engine.llm_engine.render_chat(body.messages, **body.template_options())


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


def chat_logprobs(token_ids, steps: list[dict[int, Logprob]], top_logprobs: int, tokenizer) -> dict:
    """vLLM's _create_chat_logprobs over a choice's tokens (or a chunk's new ones) and their dicts."""
    limit = None if top_logprobs == -1 else top_logprobs

    def text(token_id: int, lp: Logprob | None) -> str:
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
    return chat_logprobs(c.token_ids, c.logprobs or [], body.top_logprobs or 0, tokenizer)


def chat_response(head: dict, body: ChatCompletionRequest, out: RequestOutput, tokenizer) -> dict:
    """The reply to a request that does not stream: its n choices and the usage."""
    role, echo = body.response_role(), echoed_text(body)
    choices = [{"index": c.index, "message": {"role": role, "content": echo + c.text},
                "logprobs": _choice_logprobs(body, c, tokenizer), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason} for c in out.outputs]
    return {**head, "choices": choices, "usage": usage([out])}


async def chat_chunks(head: dict, body: ChatCompletionRequest, gen, tokenizer) -> AsyncIterator[dict]:
    """A streamed reply's chunks. The opening chunks wait for the engine's first output, as vLLM's do
    (their continuous usage needs the prompt's length)."""
    include_usage, continuous_usage = body.usage_flags()
    role, echo, n = body.response_role(), echoed_text(body), body.n
    counts = StreamUsage()

    def chunk(index: int, delta: dict, **fields) -> dict:
        out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None,
                                    **fields}]}
        if continuous_usage:
            out["usage"] = counts.of_choice(0, index)
        return out

    first = True
    async for _, out in merge([gen]):
        if first:
            first = False
            counts.prompt[0] = len(out.prompt_token_ids)
            for index in range(n):
                yield chunk(index, {"role": role, "content": ""})
            for index in range(n if echo else 0):
                yield chunk(index, {"content": echo})
        for c in out.outputs:
            counts.add(0, out, c.index, len(c.token_ids))
            yield chunk(c.index, {"content": c.text}, logprobs=_choice_logprobs(body, c, tokenizer),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": counts.total()}
