"""Requests on their way in and out (vLLM V1's `vllm/v1/engine/processor.py` and its detokenizer's
stop strings): what fails a request alone, as vLLM's engine fails one request and runs the
others, and the checks after a step that end one: a next-token distribution that is not finite,
a stop string.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import numpy as np

from kvjax.engine.sampling import SamplingParams
from kvjax.math_utils import cdiv


@dataclasses.dataclass(frozen=True)
class Limits:
    """What an engine can serve: the rules a request is checked against."""

    vocab_size: int
    max_model_len: int  # prompt + generated tokens
    block_size: int
    usable_blocks: int  # the pool's blocks, the null block not counted
    max_logprobs: int  # -1: no limit
    has_tokenizer: bool  # stop strings need one
    blocks_for: Callable[[int], int] | None = None  # blocks a request of n tokens holds at most; None: cdiv(n, Z)


def check_request(prompt: Sequence[int], params: SamplingParams, limits: Limits) -> tuple[str | None, int]:
    """(why the request is refused or None, tokens it may generate: max_tokens clamped to
    max_model_len). Rules: a non-empty prompt of ids in the vocabulary, shorter than
    max_model_len; prompt + new tokens fit the pool's usable blocks; logprobs within
    max_logprobs; stop strings need a tokenizer. Where vLLM has the rule the reason is in its
    words (its input processor's and renderer's), kvjax's detail after them."""
    z, n, max_len = limits.block_size, len(prompt), limits.max_model_len
    if n == 0:
        return "The decoder prompt cannot be empty (a request needs at least one prompt token)", 0
    if min(prompt) < 0 or max(prompt) >= limits.vocab_size:  # vLLM names the smallest if negative, else the largest
        return (f"Token id {min(prompt) if min(prompt) < 0 else max(prompt)} is out of vocabulary (the model's token "
                f"ids are [0, {limits.vocab_size}))"), 0
    if n > max_len:
        return (f"This model's maximum context length is {max_len} tokens. However, your prompt contains {n} input "
                "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
                "input prompt."), 0
    if n == max_len:
        return (f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) is longer "
                f"than the maximum model length of {max_len}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens (prompt + requested output tokens)."), 0
    room = limits.max_model_len - n
    new = room if params.max_tokens is None else min(params.max_tokens, room)
    need = cdiv(n + new, z) if limits.blocks_for is None else limits.blocks_for(n + new)
    if need > limits.usable_blocks:
        return (f"needs {need} blocks of {z} tokens ({n} prompt + {new} new), but the pool has only "
                f"{limits.usable_blocks} usable blocks"), 0
    limit = limits.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        k = limits.vocab_size if k == -1 else k
        if k is not None and limit != -1 and k > limit:
            what = "sample logprobs" if name == "logprobs" else "prompt logprobs"
            return f"Requested {what} of {k}, which is greater than max allowed: {limit} (max_logprobs)", 0
    if params.stop and not limits.has_tokenizer:
        return "stop strings need a tokenizer (the engine was built without one)", 0
    return None, new


def normalize_trace_replay(params: SamplingParams, prompt_len: int, max_model_len: int) -> None:
    """vLLM's `_normalize_trace_replay_params`, on a request's own params: the trace is cut to
    what fits after the prompt (at least one token), max_tokens becomes min(trace length,
    max_tokens — None: up to max_model_len), and nothing may end the output early: no min_tokens,
    EOS ignored, no stop strings or stop token ids."""
    trace = params.trace_decode_token_ids[:max(max_model_len - prompt_len, 1)]
    max_tokens = max_model_len - prompt_len if params.max_tokens is None else params.max_tokens
    params.trace_decode_token_ids, params.max_tokens = trace, min(len(trace), max_tokens)
    params.min_tokens, params.ignore_eos, params.stop, params.stop_token_ids = 0, True, [], []


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """A prompt's n samples as n requests (vLLM's `ParentRequest.get_child_info`): each with n = 1,
    the j-th with seed + j when the parent has a seed (else all draw from their own request
    numbers); params itself when n = 1."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + j)
            for j in range(params.n)]


def detokenize(tokenizer, ids: Sequence[int], params: SamplingParams) -> str:
    """A request's output text as its params ask: special tokens skipped (every tokenizer's
    default decode), or kept with skip_special_tokens=False."""
    return tokenizer.decode(ids) if params.skip_special_tokens else tokenizer.decode(ids, skip_special_tokens=False)


def num_logprobs(params: SamplingParams, vocab_size: int) -> int:
    """How many most likely tokens the request's logprobs report (0 when it asks for none)."""
    return 0 if params.logprobs is None else vocab_size if params.logprobs == -1 else params.logprobs


def find_stop_string(text: str, start: int, stops, include: bool) -> tuple[str, str] | None:
    """vLLM's stop-string check on a request's text after a new token: the stop string that
    occurs first, searched from where the text of the last check ended (`start` characters; a
    string may straddle it). → (the text cut before it, or after it with include, the string),
    or None."""
    hits = [(at, s) for s in stops if (at := text.find(s, max(0, start - len(s) + 1))) >= 0]
    if not hits:
        return None
    at, s = min(hits)
    return (text[:at + len(s)] if include else text[:at]), s


def non_finite(active, output: Sequence[int], chosen) -> str | None:
    """vLLM's finish reason "error" for a request whose next-token distribution stopped being
    finite (NaN or infinite logits: NaN weights, a degenerate config), seen as a non-finite
    log-probability of a token it sampled in this step (chosen f32[steps], this request's row of
    them; output: its tokens, this step's included). The tokens from that one on are dropped
    (`active.cut`: never reported) and a warning names the request. → "error" or None."""
    done = len(active.result.output)
    bad = np.flatnonzero(~np.isfinite(chosen[:len(output) - done]))
    if not len(bad):
        return None
    active.cut, active.result.finish_reason = done + int(bad[0]), "error"
    logging.getLogger("kvjax").warning("request %s: the model's logits for output token %d are not finite (NaN or "
                                       "infinite); it ends with finish_reason 'error'", active.result.request_id,
                                       active.cut)
    return "error"


def stop_string(active, output: Sequence[int], tokenizer) -> str | None:
    """vLLM's stop-string check after each sampled token: a stop string in the text ends the
    request ("stop", stop_reason the string), the text cut before it (after it with
    include_stop_str_in_output). One token came since the last check (a request with stop
    strings decodes one step per device call), so the new characters start where the last
    check's text ended (`active.text_chars`). → "stop" or None."""
    params = active.params
    text = detokenize(tokenizer, output, params)
    start, active.text_chars = active.text_chars, len(text)
    hit = find_stop_string(text, start, params.stop, params.include_stop_str_in_output)
    if hit is None:
        return None
    (active.result.text, active.result.stop_reason), active.result.finish_reason = hit, "stop"
    return "stop"
