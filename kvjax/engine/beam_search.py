"""Beam search on a kvjax `LLM`: vLLM 0.33's `LLM.beam_search`, step for step, on the public
`LLM.generate` (vLLM's `vllm/entrypoints/generate/beam_search/offline.py` and `utils.py`,
`BeamSearchParams` in `vllm/sampling_params.py`).

    from kvjax import LLM
    from kvjax.engine.beam_search import BeamSearchParams, beam_search
    llm = LLM("small-gqa")
    out = beam_search(llm, [{"prompt_token_ids": [100, 101, 102]}], BeamSearchParams(beam_width=4, max_tokens=16))
    best = out[0].sequences[0]  # .tokens (prompt + generated), .text, .cum_logprob, .logprobs

The algorithm (vLLM's; it follows Hugging Face transformers' beam search):

- Each prompt starts with one beam, its prompt tokens, cumulative log-probability 0.
- A step runs every live beam of every prompt in the batch as one request of one token:
  `generate({"prompt_token_ids": beam.tokens}, SamplingParams(logprobs=2 * beam_width,
  max_tokens=1, temperature))`. A beam's prompt is its parent's tokens plus one, so with
  enable_prefix_caching the engine finds the parent's full blocks in its prefix cache, and the
  beams of one prompt share the prompt's KV blocks as vLLM's do.
- Each token in the step's log-probability dict (the sampled token, then the 2 × beam_width most
  likely; raw log-probabilities, not the temperature's) makes a candidate: the beam's tokens plus
  it, cum_logprob plus its log-probability, the dict appended to the beam's logprobs. A candidate
  whose token is one of the model's EOS ids (`llm.model.eos_token_ids`) is finished: it joins the
  prompt's completed beams, its EOS kept in `tokens` (unless ignore_eos, which makes EOS an
  ordinary token). The others are sorted by score (stable, best first) and the best beam_width
  are the prompt's next beams.
- After max_tokens steps (or when no prompt has a live beam), each prompt's completed and live
  beams are sorted by score and the best beam_width returned, each with its text: the tokenizer's
  decoding of all its tokens, prompt included.
- Score (`get_beam_search_score`): cum_logprob / max(generated tokens, 1) ** length_penalty, the
  generated tokens counting a final EOS. length_penalty 1 is the mean log-probability per
  token; above 0 it favours longer beams, below 0 shorter ones, 0 ranks by cum_logprob alone.
- A prompt any of whose beams' requests is aborted stops there: all its beams are completed with
  finish_reason "abort". Otherwise finish_reason and stop_reason stay None, as in vLLM's offline
  beam search (its online one sets them).
- A request the engine refuses (a beam that would pass max_model_len) fails the whole call, as
  vLLM's input processor fails it (LLMError, naming the step).

vLLM's `BeamSearchParams` fields are all here. include_stop_str_in_output is kept but not read,
as in vLLM's offline `LLM.beam_search` (its online server reads it). Refused by name
(SamplingParamsError): structured_outputs, watermarking, allowed_token_ids (vLLM scores those
tokens with exact-id log-probabilities, which kvjax's SamplingParams do not have). LoRA has no
counterpart in kvjax. vLLM logs a warning that its progress bar counts steps, not prompts; here
that is said only in `beam_search`'s docstring (library code never prints).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from kvjax.engine.arg_utils import LLMError
from kvjax.engine.outputs import Logprob
from kvjax.engine.sampling_params import MAX_N, SamplingParams, SamplingParamsError
from kvjax.utils.checks import INT32_MAX, check_int, is_int

# vLLM BeamSearchParams fields kvjax has no counterpart for: (their neutral values, what they are).
_NOT_IMPLEMENTED = {"structured_outputs": ((None,), "structured outputs"),
                    "watermarking": ((None, False), "watermarks"),
                    "allowed_token_ids": ((None,), "allowed-token lists (exact-id log-probabilities)")}


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, its fields in its order with its defaults (module docstring).
    beam_width: beams kept per prompt (1 .. 16384; the engine's max_logprobs must allow 2 ×
    beam_width). max_tokens: search steps (tokens generated per beam at most). temperature: of
    the one sampled token per beam (0 = greedy, which adds no candidate beyond the top 2 ×
    beam_width). length_penalty: the score's exponent (get_beam_search_score)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # as in vLLM's offline beam search: not read
    structured_outputs: Any = None
    skip_special_tokens: bool = True
    watermarking: bool | None = None
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.beam_width = check_int(self.beam_width, "beam_width", 1, MAX_N, SamplingParamsError)
        self.max_tokens = check_int(self.max_tokens, "max_tokens", 0, INT32_MAX, SamplingParamsError)
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value):
                raise SamplingParamsError(f"{name} must be a finite number, got {value!r:.40}")
            setattr(self, name, float(value))
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be True or False, got {getattr(self, name)!r:.40}")
        for name, (neutral, what) in _NOT_IMPLEMENTED.items():
            if not any(getattr(self, name) is v for v in neutral):
                raise SamplingParamsError(f"BeamSearchParams({name}=...): {what} are not implemented in kvjax")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam (vLLM's): its tokens (the prompt's, then the generated ones, a final EOS
    included), one log-probability dict per generated token (each the whole dict of its step:
    the sampled token and the 2 × beam_width most likely), their sum, and its text once returned."""

    orig_prompt: dict  # {"prompt_token_ids": [...], "prompt": text (when the prompt was text)}
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "abort", else None (vLLM's offline beam search)
    stop_reason: int | str | None = None

    def get_prompt(self) -> dict:
        """The prompt that extends this beam by one token: its tokens so far."""
        return {"prompt_token_ids": self.tokens}


@dataclasses.dataclass
class BeamSearchOutput:
    """One prompt's result (vLLM's): its best beams, at most beam_width, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """One prompt's search: its live beams (at most beam_width) and its completed ones."""

    def __init__(self, prompt: dict, priority: int = 0):
        self.beams = [BeamSearchSequence(orig_prompt=prompt, tokens=list(prompt["prompt_token_ids"]), logprobs=[])]
        self.completed: list[BeamSearchSequence] = []
        self.priority = priority


def get_beam_search_score(num_generated_tokens: int, cumulative_logprob: float, length_penalty: float = 1.0) -> float:
    """vLLM's (and transformers') beam score: cumulative_logprob / max(n, 1) ** length_penalty,
    n the generated tokens (a final EOS counted; an aborted beam may have none)."""
    return cumulative_logprob / (max(num_generated_tokens, 1) ** length_penalty)


def create_sort_beams_key_function(length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        # logprobs has one dict per generated token, a final EOS included (tokens also holds the prompt)
        return get_beam_search_score(len(beam.logprobs), beam.cum_logprob, length_penalty)

    return sort_beams_key


def beam_search(llm, prompts, params: BeamSearchParams, use_tqdm: bool = False, concurrency_limit: int | None = None,
                priority: int | Sequence[int] | None = None) -> list[BeamSearchOutput]:
    """vLLM's `LLM.beam_search(prompts, params, lora_request, use_tqdm, concurrency_limit, priority)`
    without lora_request: one BeamSearchOutput per prompt, in order (module docstring).

    llm: a kvjax LLM (generate, get_tokenizer, model.eos_token_ids). prompts: a prompt or a list
    of them, each a string, {"prompt": str}, {"prompt_token_ids": [...]} or a list of token ids.
    use_tqdm: a progress bar on stderr of search steps (the upper bound max_tokens: the search may
    end sooner), or a tqdm-like class; turned off, with a warning, when concurrency_limit is set
    (as vLLM does). concurrency_limit: at most this many prompts searched at once (None: all).
    priority: one for all prompts or one per prompt, given to every request of its beams (the
    LLM's scheduling_policy "priority"; None: the engine's default)."""
    if not isinstance(params, BeamSearchParams):
        raise LLMError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    tokenizer = llm.get_tokenizer()
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and all(
            is_int(t) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise LLMError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    token_prompts = [_token_prompt(tokenizer, p) for p in prompts]
    priorities = _priorities(priority, len(token_prompts))
    if concurrency_limit is None:
        concurrency_limit = max(1, len(token_prompts))
    else:
        concurrency_limit = check_int(concurrency_limit, "concurrency_limit", 1, None, LLMError)
        if use_tqdm:
            warnings.warn("Progress bar is not supported when using concurrency_limit. Disabling progress bar.",
                          stacklevel=2)
            use_tqdm = False
    # 2 × beam_width candidates per beam, as transformers' beam search (vLLM: "following the
    # huggingface transformers implementation").
    base_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature,
                                 detokenize=False)
    eos_token_ids = set(llm.model.eos_token_ids)
    sort_beams_key = create_sort_beams_key_function(params.length_penalty)
    instances = [BeamSearchInstance(p, prio) for p, prio in zip(token_prompts, priorities)]
    for start in range(0, len(instances), concurrency_limit):
        batch = instances[start:start + concurrency_limit]
        steps = _progress(use_tqdm, params.max_tokens)
        try:
            for step in steps:
                if _beam_search_step(llm, batch, base_params, eos_token_ids, params, sort_beams_key, step,
                                     pass_priorities=priority is not None):
                    break
        finally:
            if not isinstance(steps, range):  # a progress bar
                steps.close()
    outputs = []
    for instance in instances:
        instance.completed.extend(instance.beams)
        best = sorted(instance.completed, key=sort_beams_key, reverse=True)[:params.beam_width]
        for beam in best:
            beam.text = _decode(tokenizer, beam.tokens, params.skip_special_tokens)
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs


def _beam_search_step(llm, batch: list[BeamSearchInstance], base_params: SamplingParams, eos_token_ids: set[int],
                      params: BeamSearchParams, sort_beams_key, step: int, pass_priorities: bool) -> bool:
    """One token for every live beam of the batch's prompts (vLLM's `_beam_search_step`);
    → True when no prompt has a live beam left (the search is over)."""
    all_beams = list(itertools.chain.from_iterable(instance.beams for instance in batch))
    if not all_beams:
        return True
    pos = [0, *itertools.accumulate(len(instance.beams) for instance in batch)]
    priorities = [instance.priority for instance in batch for _ in instance.beams] if pass_priorities else None
    try:
        outputs = llm.generate([beam.get_prompt() for beam in all_beams], base_params, use_tqdm=False,
                               priority=priorities)
    except LLMError as e:
        raise LLMError(f"beam search step {step + 1} of {params.max_tokens} (one request per beam): {e}") from None
    for (start, end), instance in zip(zip(pos[:-1], pos[1:]), batch):
        results = outputs[start:end]
        for beam, result in zip(all_beams[start:end], results):
            if result.outputs[0].finish_reason is None:  # refused: kvjax says why in RequestOutput.error
                raise LLMError(f"beam search step {step + 1} of {params.max_tokens}: a beam of "
                               f"{len(beam.tokens)} tokens was refused: {result.error}")
        if any(result.outputs[0].finish_reason == "abort" for result in results):
            for beam in all_beams[start:end]:
                beam.finish_reason = "abort"
                instance.completed.append(beam)
            instance.beams = []
            continue
        new_beams = []
        for beam, result in zip(all_beams[start:end], results):
            logprobs = result.outputs[0].logprobs[0]  # {token id: Logprob}: the sampled token, then the top 2k
            for token_id, logprob in logprobs.items():
                candidate = BeamSearchSequence(beam.orig_prompt, tokens=beam.tokens + [token_id],
                                               logprobs=beam.logprobs + [logprobs],
                                               cum_logprob=beam.cum_logprob + logprob.logprob)
                if token_id in eos_token_ids and not params.ignore_eos:
                    instance.completed.append(candidate)
                else:
                    new_beams.append(candidate)
        instance.beams = sorted(new_beams, key=sort_beams_key, reverse=True)[:params.beam_width]
    return False


# ----------------------------------------------------------------------------------- helpers
def _token_prompt(tokenizer, prompt) -> dict:
    """{"prompt_token_ids": [...]} (and "prompt": its text when it was text) of one prompt in the
    forms LLM.generate takes."""
    text = None
    if isinstance(prompt, dict):
        extra = set(prompt) - {"prompt", "prompt_token_ids"}
        if extra:
            raise LLMError(f"prompt field {sorted(extra)[0]!r} is not implemented in kvjax (a prompt is "
                           "{'prompt': str} or {'prompt_token_ids': [...]})")
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif isinstance(text, str):
            prompt = text
        else:
            raise LLMError(f"a prompt dict needs 'prompt' (a string) or 'prompt_token_ids', got {prompt!r:.80}")
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple, np.ndarray)) and all(is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise LLMError(f"a prompt must be a string, a prompt dict or a list of token ids, got {prompt!r:.80}")
    return {"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text}


def _priorities(priority, n: int) -> list[int]:
    """One priority per prompt (vLLM's `_priority_to_seq`): 0 for None, or the one given for all."""
    if priority is None:
        return [0] * n
    if is_int(priority):
        return [int(priority)] * n
    if not isinstance(priority, (list, tuple)) or len(priority) != n:
        raise LLMError(f"priority must be an int or one per prompt ({n}), got {priority!r:.80}")
    return [check_int(p, "a priority", -INT32_MAX - 1, INT32_MAX, LLMError) for p in priority]


def _progress(use_tqdm, max_tokens: int):
    """range(max_tokens), with a progress bar of steps when asked."""
    if use_tqdm is False or use_tqdm is None:
        return range(max_tokens)
    if use_tqdm is True:
        from tqdm import tqdm

        return tqdm(range(max_tokens), desc="Beam search", unit="token", unit_scale=False)
    if callable(use_tqdm):
        return use_tqdm(range(max_tokens), desc="Beam search", unit="token")
    raise LLMError(f"use_tqdm must be True, False or a tqdm-like class, got {use_tqdm!r:.40}")


def _decode(tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    """A beam's text: special tokens skipped (every tokenizer's default decode), or kept."""
    return tokenizer.decode(ids) if skip_special_tokens else tokenizer.decode(ids, skip_special_tokens=False)


__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "BeamSearchInstance", "beam_search",
           "get_beam_search_score", "create_sort_beams_key_function"]
