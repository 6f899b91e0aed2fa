"""POST /v1/completions' replies (vLLM's `entrypoints/openai/completion/serving.py`).

A prompt's n samples are choices prompt * n + sample, as vLLM numbers them. logprobs (OpenAI's
legacy format, vLLM's `_create_completion_logprobs`): per token its text, its log-probability (at
least -9999.0), its text offset in the choice, and the first logprobs + 1 entries of the engine's
dict (the chosen token, then the most likely; all of them for -1). With echo the choice's text,
tokens and logprobs start with the prompt's (its first token's log-probability None, its entries
from prompt_logprobs), and with max_tokens 0 are the prompt's alone. return_token_ids adds each
choice's token_ids and prompt_token_ids; return_tokens_as_token_ids writes tokens as
"token_id:<id>"; prompt_logprobs adds each choice's prompt_logprobs ({id: {logprob, rank,
decoded_token}} per token, the first None).
A stream is one choice's news per chunk; with stream_options.include_usage a last chunk with
`"choices": []` carries the usage of every prompt (once) and every choice, and with
continuous_usage_stats each chunk carries its own prompt's and choice's usage so far.
"""
from __future__ import annotations

from typing import AsyncIterator

from kvjax.engine.outputs import RequestOutput
from kvjax.entrypoints.openai.api_utils import StreamUsage, clamp, merge, timing_metrics, usage


def token_text(token_id: int, lp, tokenizer, as_id: bool) -> str:
    """vLLM's _get_decoded_token: "token_id:<id>" when asked, else the entry's text, else the tokenizer's."""
    if as_id:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def completion_logprobs(token_ids, steps, k: int, tokenizer, as_id: bool, offset: int = 0) -> dict:
    """vLLM's CompletionLogProbs of these tokens and their dicts (None for a prompt's first token)."""
    limit = None if k == -1 else max(k + 1, 0)  # vLLM's completion_top_logprobs_limit
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, step in zip(token_ids, steps):
        if step is None:
            piece = token_text(token, None, tokenizer, as_id)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            piece = token_text(token, step[token], tokenizer, as_id)
            out["token_logprobs"].append(clamp(step[token].logprob))
            out["top_logprobs"].append({token_text(t, lp, tokenizer, as_id): clamp(lp.logprob)
                                        for t, lp in list(step.items())[:limit]})
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def prompt_logprobs_json(steps) -> list | None:
    """vLLM's prompt_logprobs in a reply: per prompt token None or {id: {logprob, rank, decoded_token}}."""
    if steps is None:
        return None
    return [None if s is None else {str(t): {"logprob": clamp(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in s.items()}
            for s in steps]


class _Choice:
    """A choice's running state across stream chunks: its text offset and whether its prompt went out."""

    def __init__(self):
        self.offset, self.echoed = 0, False


def completion_choice(index: int, out: RequestOutput, c, body, tokenizer, state: _Choice) -> dict:
    """One choice (a CompletionOutput, or a stream chunk's delta of one) in OpenAI's shape."""
    text, ids, steps = c.text, list(c.token_ids), c.logprobs
    prompt_ids = None
    if not state.echoed and (body.echo or body.return_token_ids):
        state.echoed, prompt_ids = True, list(out.prompt_token_ids)
        if body.echo:
            prompt_text = "" if body.return_token_ids else (out.prompt or tokenizer.decode(out.prompt_token_ids))
            prompt_steps = list(out.prompt_logprobs or [None] * len(prompt_ids))
            if body.max_tokens == 0:  # the prompt alone (vLLM generates one token and shows none)
                text, ids, steps = prompt_text, prompt_ids, prompt_steps
            else:
                text, ids = prompt_text + text, prompt_ids + ids
                steps = None if steps is None else prompt_steps + list(steps)
    logprobs = None
    if body.logprobs is not None and steps is not None:
        logprobs = completion_logprobs(ids, steps, body.logprobs, tokenizer, bool(body.return_tokens_as_token_ids),
                                       state.offset)
        if logprobs["tokens"]:
            state.offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason}
    if body.return_token_ids:
        choice["token_ids"] = list(c.token_ids)
        choice["prompt_token_ids"] = prompt_ids
    if out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return choice


def _full(choice: dict) -> dict:
    """A reply that does not stream has every field of vLLM's CompletionResponseChoice (null when unset);
    a stream's chunks only the ones set (vLLM's exclude_unset)."""
    return {"token_ids": None, "prompt_token_ids": None, "prompt_logprobs": None, **choice}


def completion_response(head: dict, body, outs: list[RequestOutput], n: int, tokenizer) -> dict:
    """The reply to a request that does not stream: every prompt's n choices and the usage."""
    choices = [_full(completion_choice(i * n + c.index, out, c, body, tokenizer, _Choice()))
               for i, out in enumerate(outs) for c in out.outputs]
    return {**head, "choices": choices, "usage": usage(outs)}


async def completion_chunks(head: dict, body, gens, n: int, tokenizer,
                            per_request_metrics: bool = False) -> AsyncIterator[dict]:
    """A streamed reply's chunks, as the engine's DELTA outputs of every prompt arrive. per_request_metrics:
    the usage chunk carries the request's timings when it has one prompt and one choice (vLLM's
    --enable-per-request-metrics)."""
    include_usage, continuous_usage = body.usage_flags()
    states: dict[int, _Choice] = {}
    counts = StreamUsage()
    last = None
    async for i, out in merge(gens):
        last = out
        for c in out.outputs:
            index = i * n + c.index
            counts.add(i, out, index, len(c.token_ids))
            chunk = {**head, "choices": [completion_choice(index, out, c, body, tokenizer,
                                                           states.setdefault(index, _Choice()))]}
            if continuous_usage:
                chunk["usage"] = counts.of_choice(i, index)
            yield chunk
    if include_usage:
        final = {**head, "choices": [], "usage": counts.total()}
        if per_request_metrics and len(gens) == 1 and n == 1 and last is not None:
            final["metrics"] = timing_metrics(last.metrics, final["usage"]["completion_tokens"])
        yield final


__all__ = ["completion_response", "completion_chunks", "completion_logprobs", "prompt_logprobs_json"]
