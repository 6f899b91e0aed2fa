"""Beam search through the server: vLLM 0.33's online beam search
(`vllm/entrypoints/generate/beam_search/online.py`, `BeamSearchOnlineMixin.beam_search`) over
AsyncLLM, with kvjax.engine.beam_search's params, beams and score.

It differs from the offline `LLM.beam_search` (kvjax.engine.beam_search) as vLLM's two do: each step
runs every live beam as one request of one token (logprobs = 2 × beam_width, the beam's tokens as
its prompt, so the prefix cache holds the shared part once), candidates are ranked by cumulative
log-probability alone (the best beam_width survive), a candidate ending in an EOS id is finished
with finish_reason "stop" and stop_reason its id (its EOS kept in the tokens only with
include_stop_str_in_output); allowed_token_ids keeps only those candidates. At the end the
completed and live beams are ranked by the length-penalised score and the best beam_width are the
choices: their text without the prompt (and without a final EOS), finish_reason "length" for a
beam still live. A beam the engine ends with "error" ends the search with one empty "error"
choice; an aborted one ends it as "abort".
"""
from __future__ import annotations

import asyncio
import uuid

import numpy as np

from kvjax.engine.beam_search import BeamSearchParams, BeamSearchSequence, create_sort_beams_key_function
from kvjax.engine.outputs import CompletionOutput, RequestOutput
from kvjax.engine.sampling_params import SamplingParams


async def _last(gen):
    out = None
    async for out in gen:
        pass
    return out


async def beam_search(engine, prompt_ids: list[int], prompt_text: str | None, params: BeamSearchParams,
                      request_id: str, *, allowed_token_ids: list[int] | None = None, priority: int = 0,
                      eos_token_ids=()) -> RequestOutput:
    """One prompt's beam search on AsyncLLM `engine` (module docstring) → its RequestOutput, one
    CompletionOutput per returned beam, best first."""
    width = params.beam_width
    base = SamplingParams(logprobs=2 * width, max_tokens=1, temperature=params.temperature, detokenize=False)
    allowed = set(allowed_token_ids) if allowed_token_ids else None
    eos = set(eos_token_ids)
    sort_key = create_sort_beams_key_function(params.length_penalty)
    prompt = {"prompt_token_ids": prompt_ids}
    beams = [BeamSearchSequence(orig_prompt=prompt, tokens=list(prompt_ids), logprobs=[], cum_logprob=0.0)]
    completed: list[BeamSearchSequence] = []
    n = len(prompt_ids)
    for _ in range(params.max_tokens):
        batch = f"{request_id}-{uuid.uuid4().hex}"
        outs = await asyncio.gather(*(_last(engine.generate({"prompt_token_ids": b.tokens}, base, f"{batch}-beam-{i}",
                                                            priority=priority)) for i, b in enumerate(beams)))
        if any(o.outputs[0].finish_reason == "error" for o in outs):
            return RequestOutput(request_id, prompt_text, prompt_ids, None,
                                 [CompletionOutput(0, "", [], None, None, "error")])
        if any(o.outputs[0].finish_reason == "abort" for o in outs):
            for b in beams:
                b.finish_reason = "abort"
            break
        candidates = []
        for beam, out in zip(beams, outs):
            logprobs = (out.outputs[0].logprobs or [{}])[0]
            if allowed is not None:
                logprobs = {t: lp for t, lp in sorted(logprobs.items(), key=lambda kv: kv[1].logprob, reverse=True)
                            if t in allowed and np.isfinite(lp.logprob)}
            for token, lp in logprobs.items():
                score = beam.cum_logprob + lp.logprob
                if token in eos and not params.ignore_eos:
                    completed.append(BeamSearchSequence(
                        prompt, beam.tokens + [token] if params.include_stop_str_in_output else beam.tokens,
                        beam.logprobs + [logprobs], score, finish_reason="stop", stop_reason=token))
                else:
                    candidates.append((score, int(token), beam, logprobs))
        order = sorted(range(len(candidates)), key=lambda i: -candidates[i][0])[:width]  # stable: ties keep order
        beams = [BeamSearchSequence(prompt, b.tokens + [t], b.logprobs + [lps], s)
                 for s, t, b, lps in (candidates[i] for i in order)]
        if not beams:
            break
    completed.extend(beams)
    best = sorted(completed, key=sort_key, reverse=True)[:width]
    tokenizer = engine.get_tokenizer()
    choices = []
    for i, beam in enumerate(best):
        ids = beam.tokens[n:-1] if beam.tokens[-1] in eos and not params.ignore_eos else beam.tokens[n:]
        text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        choices.append(CompletionOutput(i, text, beam.tokens[n:], beam.cum_logprob, beam.logprobs,
                                        beam.finish_reason or "length", beam.stop_reason))
    return RequestOutput(request_id, prompt_text, prompt_ids, None, choices)
