"""What `LLM.generate` returns, with vLLM's names and shapes (vLLM's `vllm/outputs.py`).

`RequestOutput` is one prompt's result: its `CompletionOutput`s (the n sampled sequences),
prompt_logprobs when asked, `RequestMetrics` (vLLM's per-request stats, with the prefix-cache
hit) and kvjax's `error` (`kvjax decode`'s per-request refusals, as vLLM's batch runner reports
them; the API raises instead). A log-probability is a `Logprob` (vLLM's `vllm/logprobs.py`),
reported per token as a dict {token id: Logprob}: the chosen token first, then the k most likely.
`GenerateOutputs` is the list of one call's RequestOutputs, with the call's run summary.

The engine's own results come first: `RequestResult` (one generated sequence, one per sample,
filled in step by step, with its `TokenLogprobs`) and `EngineRun` (one `Engine.generate` call's
results and summary). kvjax.engine.output_processor builds RequestOutputs from RequestResults;
`prompt_logprobs` builds prompt_logprobs from teacher-forced log-probabilities.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvjax.engine.stats import Summary


@dataclasses.dataclass
class TokenLogprobs:
    """The log-probabilities reported for one generated token (SamplingParams.logprobs = J)."""

    logprob: float  # the chosen token's raw log-probability
    rank: int  # its rank in the vocabulary (1 = most likely)
    top_ids: list[int]  # the J most likely tokens, most likely first
    top_logprobs: list[float]


def token_logprobs(sampled, row: int, steps, k: int) -> list[TokenLogprobs]:
    """The TokenLogprobs of batch row `row` at `steps` (an index or a slice) of sampling.Sampled
    arrays (host copies, [steps, B, ...]), the k most likely kept."""
    return [TokenLogprobs(float(lp), int(rank), ids[:k].tolist(), lps[:k].tolist())
            for lp, rank, ids, lps in zip(np.atleast_1d(sampled.logprobs[steps, row]),
                                          np.atleast_1d(sampled.ranks[steps, row]),
                                          np.atleast_2d(sampled.top_ids[steps, row]),
                                          np.atleast_2d(sampled.top_logprobs[steps, row]))]


@dataclasses.dataclass
class RequestResult:
    """One generated sequence as the engine keeps it, filled in step by step (one request: one
    sample of a prompt)."""

    request_id: str  # the engine's id for it (unique among its unfinished requests)
    prompt_tokens: int
    output: list[int]  # generated token ids so far (a stop token included)
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked
    finish_reason: str | None = None  # "length" (max_tokens or max_model_len), "stop" or "abort"; None: running
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS or length
    text: str | None = None  # the output's text once finished (with a tokenizer and detokenize), cut at a stop string
    preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (device or host) when first scheduled
    ttft_s: float | None = None  # seconds from its arrival to its first token
    scheduled_s: float | None = None  # seconds from its arrival to the step that first scheduled it
    last_token_s: float | None = None  # seconds from its arrival to its last token
    new_tokens: int = 0  # tokens the last step that touched it appended to output
    index: int = 0  # Engine.generate: the position of its prompt
    sample: int = 0  # Engine.generate: which of the prompt's n samples, 0 .. n-1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class EngineRun:
    results: list[RequestResult]  # prompt by prompt, each prompt's n samples in order
    summary: Summary


@dataclasses.dataclass
class Logprob:
    """vLLM `Logprob`: a token's log-probability, its rank in the vocabulary (1 = most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class RequestMetrics:
    """vLLM's per-request stats (`RequestStateStats`), with the prefix-cache hit. Times are
    seconds from the request's arrival (for `LLM.generate`, about the start of the call); None
    until it happened."""

    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    first_token_latency: float | None = None
    last_token_ts: float | None = None
    scheduled_ts: float | None = None  # first scheduled (a preemption does not move it)


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence (vLLM `CompletionOutput`, its fields in its order). logprobs: one
    {token id: Logprob} per generated token (the sampled token and the k most likely); stop_reason:
    the stop string or stop token id that ended it (None for EOS or length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "length" or "stop"; None if the request was refused
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """What one prompt produced (vLLM `RequestOutput`). outputs: its n completions;
    prompt_logprobs: None, then one {token id: Logprob} per later prompt token, when asked.
    kvjax's extra: `error` says why a request was refused (the other prompts still run)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first scheduled
    error: str | None = None


class GenerateOutputs(list):
    """The RequestOutputs of one `generate` call, in prompt order (a list, as vLLM returns), and
    the call's `summary` (kvjax.engine.stats.Summary: throughput, latencies, prefix hits, preemptions,
    blocks in use)."""

    def __init__(self, outputs: list[RequestOutput], summary: Summary):
        super().__init__(outputs)
        self.summary = summary


# ----------------------------------------------------------------------------------- building them
def prompt_logprobs(tokenizer, ids: list[int], lp: np.ndarray, k: int) -> list[dict[int, Logprob] | None]:
    """vLLM's prompt_logprobs from lp f32[S-1, V], the teacher-forced log-probabilities of prompt
    `ids` (row s predicts token s + 1): None for the first token, then for each later prompt token
    its log-probability given the tokens before it, its rank, and the k most likely (-1: all)."""
    k = lp.shape[-1] if k == -1 else k
    out: list[dict[int, Logprob] | None] = [None]
    for s, token in enumerate(ids[1:]):
        row = lp[s]
        top = np.argsort(-row, kind="stable")[:k]
        out.append(logprob_dict(tokenizer, token, row[token], int((row >= row[token]).sum()), top, row[top]))
    return out


def logprob_dict(tokenizer, token: int, logprob: float, rank: int, top_ids, top_logprobs) -> dict[int, Logprob]:
    """vLLM's per-token dict: the chosen token first, then the k most likely (ranks 1..k); each
    token's text by the tokenizer (None without one: vLLM's detokenize=False)."""
    text = (lambda t: None) if tokenizer is None else (lambda t: tokenizer.decode([t]))  # noqa: E731
    out = {int(token): Logprob(float(logprob), int(rank), text(int(token)))}
    for r, (t, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
        out.setdefault(int(t), Logprob(float(lp), r, text(int(t))))
    return out


__all__ = ["Logprob", "RequestMetrics", "CompletionOutput", "RequestOutput", "GenerateOutputs"]
