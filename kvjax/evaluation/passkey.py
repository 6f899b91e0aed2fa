"""Passkey retrieval: does a quantized KV cache change the answer far into the context?

A five-digit number is hidden at a chosen depth of a haystack of the shipped English prose and
asked for at the end; the model answers greedily through the paged cache of each KV format
(kvjax.LLM), exactly as a served request would. A prompt of `length` tokens is

    INTRO | haystack[o : o + a] | " The secret number is 48213. " | haystack[o + a : o + n] | QUESTION

with n the haystack tokens that make the prompt exactly `length` long and a = round(depth × n).
A text shorter than the longest prompt is repeated end to start (`repeat_haystack`): the shipped
prose is 31,818 SmolLM2 tokens, so a 32K prompt on a subword vocabulary reads part of it twice.
The answer is the first run of digits in the continuation (the continuation itself if it has
none); a trial succeeds when the answer is the key, and agrees with the baseline when the two
answers are equal, right or wrong.

Trials: per (length, depth) cell, `trials` keys drawn at random, `per_haystack` of them sharing
one haystack offset. Trials that share an offset share every token before the needle, so the
engine's prefix cache (vLLM's automatic prefix caching, on by default) serves those blocks from
the first trial's prefill: the rest of each prompt is computed again. That is what makes a
passkey grid affordable on a CPU, at a price: trials of one offset are not independent draws of
the haystack. Success rates carry Wilson 95% intervals (`wilson`).
"""
from __future__ import annotations

import math
import re

import numpy as np

from kvjax.errors import KvjaxError
from kvjax.utils.checks import check_int

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
NEEDLE = " The secret number is {key}. "
QUESTION = "\n\nWhat is the secret number? The secret number is"
ANSWER_TOKENS = 7  # a space, five digits and a period in SmolLM2's vocabulary (one digit per token)


def prompt_tokens(tokenizer, haystack, length: int, depth: float, key: int, offset: int) -> tuple[list[int], int]:
    """(the prompt's token ids, exactly `length` of them; the needle's first position)."""
    pre, post = tokenizer.encode(INTRO), tokenizer.encode(QUESTION)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    n = length - len(pre) - len(needle) - len(post)
    if n < 1:
        raise KvjaxError(f"a passkey prompt of {length} tokens leaves no room for a haystack "
                         f"({len(pre) + len(needle) + len(post)} tokens of instructions, needle and question)")
    if not 0 <= offset <= len(haystack) - n:
        raise KvjaxError(f"haystack offset {offset} leaves fewer than {n} of its {len(haystack)} tokens")
    body = [int(t) for t in haystack[offset:offset + n]]
    at = round(depth * n)
    return pre + body[:at] + needle + body[at:] + post, len(pre) + at


def repeat_haystack(tokens, length: int) -> tuple[np.ndarray, int]:
    """(the haystack tokens i32[n] repeated end to start until they hold `length` tokens, the number
    of copies). A text at least `length` long comes back as it is (one copy), so the trials of every
    prompt it holds stay as they were."""
    tokens = np.asarray(tokens)
    if len(tokens) == 0:
        raise KvjaxError("the passkey haystack text has no tokens")
    copies = max(1, -(-length // len(tokens)))
    return (np.tile(tokens, copies) if copies > 1 else tokens), copies


def plan_trials(haystack_tokens: int, lengths, depths, trials: int, per_haystack: int, seed: int = 0) -> list[dict]:
    """The trials of the grid, cell after cell and offset after offset (the order that lets the
    prefix cache serve each offset's shared tokens): [{"length", "depth", "key", "offset"}]."""
    check_int(trials, "passkey trials", 1, None)
    check_int(per_haystack, "trials per haystack", 1, None)
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise KvjaxError(f"a passkey depth must be in [0, 1], got {d}")
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        check_int(length, "a passkey length", 1, None)
        if length > haystack_tokens:
            raise KvjaxError(f"a passkey length of {length} exceeds the haystack's {haystack_tokens} tokens")
        for depth in depths:
            offset = 0
            for i in range(trials):
                if i % per_haystack == 0:
                    offset = int(rng.integers(0, haystack_tokens - length + 1))
                out.append(dict(length=int(length), depth=float(depth), key=int(rng.integers(10_000, 100_000)),
                                offset=offset))
    return out


def answer(text: str) -> str:
    """The answer in a continuation: its first run of digits, or the stripped text if it has none."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else text.strip()


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% at z = 1.96)."""
    if n <= 0:
        raise KvjaxError(f"an interval needs at least one trial, got {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def run(llms: dict, tokenizer, haystack, trials: list[dict], progress=None) -> dict:
    """Every trial through every LLM ({name: kvjax.LLM}, the baseline first); returns
    {"trials": [{length, depth, key, offset, needle_at}], "answers": {name: [answer per trial]},
    "prefix_hit_tokens": {name: prompt tokens the prefix cache served}, "prompt_tokens",
    "cells": {name: [{length, depth, trials, success, low, high, agree}]}, "lengths": {name:
    [the same pooled over depths]}}. progress(message) is called once per LLM."""
    from kvjax.engine.sampling import SamplingParams

    prompts = []
    for t in trials:
        ids, at = prompt_tokens(tokenizer, haystack, t["length"], t["depth"], t["key"], t["offset"])
        prompts.append(ids)
        t["needle_at"] = at
    params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    answers, hits = {}, {}
    for name, llm in llms.items():
        if progress:
            progress(f"passkey: {len(prompts)} prompts through {name}")
        outs = llm.generate(prompts, params, use_tqdm=False)
        answers[name] = [answer(tokenizer.decode(o.outputs[0].token_ids)) for o in outs]
        hits[name] = int(outs.summary.prefix_hit_tokens)
    base = answers[next(iter(llms))]
    keys = [str(t["key"]) for t in trials]

    def summary(fields):  # one row per distinct value of the trials' `fields`, per LLM
        groups = {}
        for i, t in enumerate(trials):
            groups.setdefault(tuple(t[f] for f in fields), []).append(i)
        out = {}
        for name, got in answers.items():
            rows = []
            for key, idx in groups.items():
                ok = sum(got[i] == keys[i] for i in idx)
                lo, hi = wilson(ok, len(idx))
                rows.append(dict(zip(fields, key), trials=len(idx), success=ok / len(idx), low=lo, high=hi,
                                 agree=sum(got[i] == base[i] for i in idx) / len(idx)))
            out[name] = rows
        return out

    return dict(trials=trials, answers=answers, prefix_hit_tokens=hits,
                prompt_tokens=sum(t["length"] for t in trials), cells=summary(("length", "depth")),
                lengths=summary(("length",)))
