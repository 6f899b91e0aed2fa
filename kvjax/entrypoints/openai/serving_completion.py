"""POST /v1/completions' replies (vLLM's `entrypoints/openai/completion/serving.py`).

A prompt's n samples are choices prompt * n + sample, as vLLM numbers them. logprobs (OpenAI's
legacy format): per token its text, its log-probability, its text offset in the choice, and the
engine's dict of the chosen token and the k most likely (vLLM's `logprobs + 1` at most).
A stream is one choice's news per chunk; with stream_options.include_usage a last chunk with
`"choices": []` carries the usage of every prompt (once) and every choice, and with
continuous_usage_stats each chunk carries its own prompt's and choice's usage so far.
"""
from __future__ import annotations

from typing import AsyncIterator

from kvjax.engine.outputs import RequestOutput
from kvjax.entrypoints.openai.api_utils import StreamUsage, clamp, merge, usage


class _Offsets:
    """A choice's running text offset for its logprobs' text_offset (kept across stream chunks)."""

    def __init__(self):
        self.at = 0


def completion_choice(index: int, c, offsets: _Offsets) -> dict:
    """One choice (a CompletionOutput, or a stream chunk's delta of one) in OpenAI's shape."""
    logprobs = None
    if c.logprobs is not None:
        lp = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token, step in zip(c.token_ids, c.logprobs):
            chosen = step[token]
            piece = chosen.decoded_token or ""
            lp["tokens"].append(piece)
            lp["token_logprobs"].append(clamp(chosen.logprob))
            lp["top_logprobs"].append({(x.decoded_token or ""): clamp(x.logprob) for x in step.values()})
            lp["text_offset"].append(offsets.at)
            offsets.at += len(piece)
        logprobs = lp
    return {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def completion_response(head: dict, outs: list[RequestOutput], n: int) -> dict:
    """The reply to a request that does not stream: every prompt's n choices and the usage."""
    choices = [completion_choice(i * n + c.index, c, _Offsets()) for i, out in enumerate(outs) for c in out.outputs]
    return {**head, "choices": choices, "usage": usage(outs)}


async def completion_chunks(head: dict, gens, n: int, include_usage: bool = False,
                            continuous_usage: bool = False) -> AsyncIterator[dict]:
    """A streamed reply's chunks, as the engine's DELTA outputs of every prompt arrive."""
    offsets: dict[int, _Offsets] = {}
    counts = StreamUsage()
    async for i, out in merge(gens):
        for c in out.outputs:
            index = i * n + c.index
            counts.add(i, out, index, len(c.token_ids))
            chunk = {**head, "choices": [completion_choice(index, c, offsets.setdefault(index, _Offsets()))]}
            if continuous_usage:
                chunk["usage"] = counts.of_choice(i, index)
            yield chunk
    if include_usage:
        yield {**head, "choices": [], "usage": counts.total()}
