"""From the engine's per-request results to vLLM's RequestOutputs (vLLM V1's
`vllm/v1/engine/output_processor.py`, `parallel_sampling.py` and its detokenizer's output text).

The engine (kvjax.engine.core) runs one request per sample and fills in a `RequestResult` per
request at each step. The output processor keeps one `RequestState` per request the user added
(its n samples are n engine requests, vLLM's ParentRequest) and turns each step's results into
RequestOutputs as the request's `output_kind` asks (vLLM's RequestOutputKind):

- CUMULATIVE: at every step that gave it tokens, everything so far (text, token ids, logprobs);
- DELTA: only what is new since the last output (the first one also carries prompt_logprobs);
- FINAL_ONLY: one output, when the request (all n samples) finished — what `LLM.generate` asks.

With n > 1 a streaming output holds the samples that changed in that step; a final one all n,
in order. Text is the detokenized output; while a request streams, the characters that could
still start one of its stop strings are held back (vLLM's stop_buffer_length) and so is a
trailing incomplete UTF-8 character (U+FFFD), so a streamed text never has to be taken back.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from kvjax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestResult, logprob_dict
from kvjax.engine.sampling_params import RequestOutputKind


@dataclasses.dataclass
class _Sample:
    """One engine request (a sample of a user's request) as the processor streams it."""

    index: int  # which of the n samples
    sent_tokens: int = 0  # output tokens already in an output (DELTA)
    sent_chars: int = 0  # text characters already in an output (DELTA)
    finished: CompletionOutput | None = None  # its final completion (kept for a FINAL_ONLY parent)


@dataclasses.dataclass
class RequestState:
    """A request the user added: its prompt, params, samples and what it has sent."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object  # SamplingParams (the parent's: n, output_kind, logprobs, stop, detokenize)
    samples: dict[str, _Sample]  # engine request id → sample
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int | None = None
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finished is not None for s in self.samples.values())


class OutputProcessor:
    """The RequestStates of the unfinished requests, and their outputs step by step."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # by the user's request id
        self.parent_of: dict[str, str] = {}  # engine request id → the user's request id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params,
                    children: Sequence[str], prompt_logprobs=None) -> RequestState:
        state = RequestState(request_id, prompt, list(prompt_token_ids), params,
                             {c: _Sample(i) for i, c in enumerate(children)}, prompt_logprobs)
        self.requests[request_id] = state
        for c in children:
            self.parent_of[c] = request_id
        return state

    def children(self, request_ids: Sequence[str]) -> list[str]:
        """The engine requests of these user requests (unknown ids are ignored)."""
        return [c for r in request_ids if r in self.requests for c in self.requests[r].samples]

    def remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id)
        for c in state.samples:
            self.parent_of.pop(c, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ outputs
    def process(self, results: Sequence[RequestResult]) -> list[RequestOutput]:
        """The RequestOutputs of one engine step's results (those that got tokens or finished),
        one per user request that has something to say; finished requests are forgotten."""
        changed: dict[str, list[RequestResult]] = {}
        for res in results:
            parent = self.parent_of.get(res.request_id)
            if parent is None:
                continue
            state = self.requests[parent]
            if not res.finished and state.params.output_kind == RequestOutputKind.FINAL_ONLY:
                if state.num_cached_tokens is None:  # nothing else to say before the end (LLM.generate)
                    state.num_cached_tokens = res.num_cached_tokens
                continue
            changed.setdefault(parent, []).append(res)
        outputs = []
        for parent, ress in changed.items():
            out = self._output(self.requests[parent], ress)
            if out is not None:
                outputs.append(out)
            if self.requests[parent].finished:
                self.remove(parent)
        return outputs

    def _output(self, state: RequestState, results: list[RequestResult]) -> RequestOutput | None:
        kind = RequestOutputKind(state.params.output_kind)
        final_only = kind == RequestOutputKind.FINAL_ONLY
        completions = []
        for res in results:
            sample = state.samples[res.request_id]
            if state.num_cached_tokens is None and res.ttft_s is not None:
                state.num_cached_tokens = res.num_cached_tokens
            if final_only and not res.finished:
                continue  # nothing is said before the end: no text to decode at every step
            completion = self._completion(state, sample, res, kind)
            if res.finished:
                sample.finished = completion if kind != RequestOutputKind.DELTA else self._completion(
                    state, dataclasses.replace(sample, sent_tokens=0, sent_chars=0), res, RequestOutputKind.CUMULATIVE)
                state.num_preemptions += res.preemptions
            completions.append(completion)
        finished = state.finished
        if final_only:
            if not finished:
                return None
            completions = [s.finished for s in sorted(state.samples.values(), key=lambda s: s.index)]
        prompt_lps = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            prompt_lps, state.prompt_logprobs_sent = (None if state.prompt_logprobs_sent else prompt_lps), True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, prompt_lps,
                             sorted(completions, key=lambda c: c.index), finished, self._metrics(state, results),
                             state.num_cached_tokens)

    def _completion(self, state: RequestState, sample: _Sample, res: RequestResult,
                    kind: RequestOutputKind) -> CompletionOutput:
        """One sample's CompletionOutput: all of it, or (DELTA) what is new since its last output."""
        params, delta = state.params, kind == RequestOutputKind.DELTA
        text = self._text(params, res)
        start_tok = sample.sent_tokens if delta else 0
        start_chr = sample.sent_chars if delta else 0
        if delta:
            sample.sent_tokens, sample.sent_chars = len(res.output), max(len(text), sample.sent_chars)
        token_ids = list(res.output[start_tok:])
        logprobs = None
        if res.logprobs is not None:
            detok = params.detokenize
            logprobs = [logprob_dict(self.tokenizer if detok else None, tok, t.logprob, t.rank, t.top_ids,
                                     t.top_logprobs) for tok, t in zip(res.output[start_tok:], res.logprobs[start_tok:])]
        cumulative = None if res.logprobs is None else float(sum(t.logprob for t in res.logprobs))
        return CompletionOutput(sample.index, text[start_chr:], token_ids, cumulative, logprobs, res.finish_reason,
                                res.stop_reason)

    def _text(self, params, res: RequestResult) -> str:
        """The output's text so far: the engine's final text once finished; while streaming, the
        decoded tokens without what could still change (module docstring)."""
        if not params.detokenize or self.tokenizer is None:
            return ""
        if res.finished:
            return res.text or ""
        from kvjax.engine.processor import detokenize

        text = detokenize(self.tokenizer, res.output, params)
        hold = 0 if params.include_stop_str_in_output or not params.stop else max(map(len, params.stop)) - 1
        text = text[:len(text) - hold] if hold else text
        return text.rstrip("\ufffd")

    @staticmethod
    def _metrics(state: RequestState, results: list[RequestResult]) -> RequestMetrics:
        ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
        scheduled = [r.scheduled_s for r in results if r.scheduled_s is not None]
        return RequestMetrics(sum(len(r.output) for r in results), state.num_preemptions,
                              state.num_cached_tokens or 0, min(ttfts) if ttfts else None,
                              max((r.last_token_s or 0.0) for r in results), min(scheduled) if scheduled else None)


__all__ = ["OutputProcessor", "RequestState"]
