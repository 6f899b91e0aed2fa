"""What the completions and chat endpoints share (vLLM's `entrypoints/serve/utils/api_utils.py` and
`generate/base/serving.py`): cancelling a handler whose client left, running a request's engine
requests together, and counting its tokens for `usage`.

`with_cancellation` is vLLM's: the handler races a task that waits for the client's
`http.disconnect` (read from the ASGI receive channel, as Starlette's StreamingResponse does; vLLM
does not use `request.is_disconnected()`, which middleware can hide). When the client leaves first,
the handler's task is cancelled: the engine generators it awaits close, and AsyncLLM aborts their
requests, so their blocks are free before the engine's next step. A handler that returns a
StreamingResponse returns at once, and the response watches for the disconnect itself.
"""
from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator

from fastapi import Request, Response

from kvjax.engine.outputs import RequestOutput


# ----------------------------------------------------------------------------------- disconnects
async def listen_for_disconnect(request: Request) -> None:
    """Return when the client has gone (the body is read already: nothing else can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler):
    """A route handler (taking `raw_request: Request` by keyword) cancelled when its client disconnects;
    the client that left gets an empty response (nobody reads it)."""

    @functools.wraps(handler)  # FastAPI reads the handler's signature through __wrapped__
    async def wrapper(*args, **kwargs):
        work = asyncio.create_task(handler(*args, **kwargs))
        gone = asyncio.create_task(listen_for_disconnect(kwargs["raw_request"]))
        done, pending = await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if work in done:
            return work.result()
        return Response()

    return wrapper


# ----------------------------------------------------------------------------------- engine requests
async def final_outputs(gens) -> list[RequestOutput]:
    """Each generator's one (FINAL_ONLY) output, the prompts run concurrently; cancelled, every
    generator closes (AsyncLLM aborts its request)."""
    async def last(gen):
        out = None
        async for out in gen:
            pass
        return out

    return list(await asyncio.gather(*(last(g) for g in gens)))


async def merge(gens) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every generator as they come; leaving early cancels them all,
    which aborts their requests."""
    if len(gens) == 1:  # the usual case: no tasks needed
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, which raises it)
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


# ----------------------------------------------------------------------------------- usage
def usage_info(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage(outs: list[RequestOutput]) -> dict:
    """A finished request's usage: each prompt counted once, every choice's tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    return usage_info(prompt, sum(len(c.token_ids) for o in outs for c in o.outputs))


class StreamUsage:
    """A streamed request's token counts as its chunks go by (vLLM's num_prompt_tokens and
    previous_num_tokens): prompt tokens per prompt, generated tokens so far per choice."""

    def __init__(self):
        self.prompt: dict[int, int] = {}  # prompt index -> its length
        self.completion: dict[int, int] = {}  # choice index -> tokens so far

    def add(self, prompt_index: int, out: RequestOutput, choice_index: int, new_tokens: int) -> None:
        self.prompt[prompt_index] = len(out.prompt_token_ids)
        self.completion[choice_index] = self.completion.get(choice_index, 0) + new_tokens

    def of_choice(self, prompt_index: int, choice_index: int) -> dict:
        """continuous_usage_stats' usage of one chunk: its prompt and its choice so far."""
        return usage_info(self.prompt.get(prompt_index, 0), self.completion.get(choice_index, 0))

    def total(self) -> dict:
        """include_usage's last chunk: every prompt once, every choice's tokens."""
        return usage_info(sum(self.prompt.values()), sum(self.completion.values()))


def timing_metrics(metrics, num_generation_tokens: int) -> dict:
    """vLLM's build_per_request_timing_metrics (--enable-per-request-metrics) from a RequestOutput's
    RequestMetrics: time_to_first_token_ms from its first scheduling to its first token,
    generation_time_ms from its first token to its last, queue_time_ms from its arrival to its first
    scheduling, mean_itl_ms (with two tokens or more) and tokens_per_second over scheduling to last
    token; a field whose times are unknown is left out (vLLM's None, dropped as its exclude_none)."""
    if metrics is None:
        return {}
    scheduled, first, last = metrics.scheduled_ts, metrics.first_token_latency, metrics.last_token_ts
    out = {}
    if scheduled is not None and first is not None:
        out["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first is not None and last is not None:
        out["generation_time_ms"] = (last - first) * 1000
    if scheduled is not None:
        out["queue_time_ms"] = scheduled * 1000  # from arrival (0 on the request's own clock)
    if first is not None and last is not None and num_generation_tokens > 1:
        out["mean_itl_ms"] = (last - first) / (num_generation_tokens - 1) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        out["tokens_per_second"] = num_generation_tokens / (last - scheduled)
    return out


def clamp(logprob: float) -> float:
    """JSON has no -inf: vLLM reports a log-probability below -9999 as -9999.0."""
    return max(logprob, -9999.0)
