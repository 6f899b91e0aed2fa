"""Sampling parameters and the token sampler (vLLM V1 `sampling_params.py`, `v1/sample/sampler.py`).

`SamplingParams` has vLLM's fields, defaults and ranges for everything kvjax implements: n,
presence/frequency/repetition penalties, temperature (default 1.0), top_p, top_k (0 or -1 =
off), min_p, seed, stop strings, stop_token_ids, ignore_eos, max_tokens (default 16; None =
up to max_model_len), min_tokens, logprobs, prompt_logprobs, detokenize and
include_stop_str_in_output. A vLLM field kvjax does not implement (logit_bias, bad_words,
structured outputs, ...) is refused by name, never silently ignored.

The sampler works on a whole step at once, one row per request, each row's parameters as
arrays (`SamplingRows`), so a batch that mixes greedy and sampled requests compiles once. It
follows vLLM's `Sampler.forward` order:

    raw log-probs = log_softmax(logits)                           (what logprobs report)
    min_tokens:   stop tokens (stop_token_ids and every EOS) → −inf while the output is short
    penalties:    repetition (prompt or output tokens: logit / r if > 0 else logit × r),
                  then frequency (− f × count in output), presence (− p × [in output])
    greedy rows (temperature < 1e-5): argmax (lowest id on a tie, as torch.argmax)
    temperature → min_p (drop p < min_p × max p) → top-k → top-p → a draw

`top_k` keeps the k largest logits; `top_p` the smallest set of the most likely tokens whose
probability (after temperature, min_p and top-k) reaches p; tokens tied with the last kept one
are kept too.

Each sampled token draws its randomness from `fold_in(request_key, position)`, where the
request key is `key(seed)` for a request with its own seed (vLLM's per-request generator;
the j-th of n parallel samples uses seed + j, as vLLM's `ParentRequest`) and `fold_in(key(engine
seed), request number)` otherwise, and position is the index the new token takes in its
sequence. A token's draw therefore depends on nothing the scheduler decides (step, row, how
many steps one device call runs, preemption), so the same seed gives the same tokens under any
schedule.

Log-probabilities are the model's raw distribution (vLLM V1's default `raw_logprobs`); a
token's rank is the number of vocabulary entries with a log-probability >= its own (vLLM's
`batched_count_greater_than`), so the most likely token has rank 1.

Axes: the kvjax package docstring's legend.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.errors import INT32_MAX, MAX_SEED, KvjaxError, check_int

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default

# vLLM SamplingParams fields that kvjax does not implement: refused by name, with the reason.
_NOT_IMPLEMENTED = {
    "logit_bias": "logit biases", "allowed_token_ids": "allowed-token masks", "bad_words": "bad-word bans",
    "structured_outputs": "structured outputs", "guided_decoding": "structured outputs",
    "logits_processors": "custom logits processors", "truncate_prompt_tokens": "prompt truncation",
    "output_kind": "streaming outputs", "stream_interval": "streaming outputs",
    "logprob_token_ids": "log-probabilities of chosen token ids",
    "prompt_logprob_token_ids": "log-probabilities of chosen token ids",
    "prompt_logprob_start": "log-probabilities of chosen token ids", "flat_logprobs": "flat log-probabilities",
    "extra_args": "extra arguments", "thinking_token_budget": "thinking budgets",
    "repetition_detection": "repetition detection", "watermarking": "watermarks",
    "spaces_between_special_tokens": "detokenizer options", "skip_reading_prefix_cache": "per-request cache reads",
}


class SamplingParamsError(KvjaxError):
    """A sampling parameter outside its range; the message names it and the rule."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request generates: vLLM's `SamplingParams` fields, in vLLM's order, with vLLM's
    defaults and ranges (see the module docstring for the order they apply in).

    n: independent samples of the prompt (they share its KV blocks). max_tokens: None = up to
    max_model_len. stop: strings that end the output (finish_reason "stop", stop_reason the
    string, cut from the text unless include_stop_str_in_output). stop_token_ids: tokens that end
    it (stop_reason the id; the token stays in the output). logprobs / prompt_logprobs: k most
    likely alternatives per token (plus the chosen one), -1 = the whole vocabulary (up to the
    LLM's max_logprobs). seed: -1 = None.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __new__(cls, *args, **kwargs):
        # A vLLM field kvjax lacks would be a TypeError from the dataclass __init__: name it instead.
        for name in kwargs:
            if name in _NOT_IMPLEMENTED:
                raise SamplingParamsError(f"SamplingParams({name}=...): {_NOT_IMPLEMENTED[name]} are not "
                                          "implemented in kvjax")
            if name not in _FIELDS:
                raise SamplingParamsError(f"SamplingParams has no parameter {name!r}")
        if len(args) > len(_FIELDS):
            raise SamplingParamsError(f"SamplingParams takes at most {len(_FIELDS)} arguments, got {len(args)}")
        return super().__new__(cls)

    def __post_init__(self):
        def integer(name, value, low, high):
            return check_int(value, name, low, high, SamplingParamsError)

        def real(name, value, low, high, rule):
            if not _real(value) or not low <= value <= high:
                raise SamplingParamsError(f"{name} must be {rule}, got {value!r}")
            return float(value)

        def flag(name):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be True or False, got {getattr(self, name)!r}")

        def put(name, value):
            object.__setattr__(self, name, value)

        put("n", integer("n", self.n, 1, MAX_N))
        put("presence_penalty", real("presence_penalty", self.presence_penalty, -2, 2, "in [-2, 2]"))
        put("frequency_penalty", real("frequency_penalty", self.frequency_penalty, -2, 2, "in [-2, 2]"))
        put("repetition_penalty", real("repetition_penalty", self.repetition_penalty, 0, math.inf,
                                       "a finite number > 0"))
        if not 0 < self.repetition_penalty < math.inf:
            raise SamplingParamsError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        put("temperature", real("temperature", self.temperature, 0, 2, "in [0, 2] (0 = greedy)"))
        put("top_p", real("top_p", self.top_p, 0, 1, "in (0, 1]"))
        if self.top_p <= 0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        put("top_k", integer("top_k", self.top_k, -1, INT32_MAX))
        put("min_p", real("min_p", self.min_p, 0, 1, "in [0, 1]"))
        if self.seed is not None:
            # JAX's threefry key keeps a seed's low 32 bits: a larger seed would alias a smaller one
            put("seed", None if self.seed == -1 else integer("seed", self.seed, 0, MAX_SEED))
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Sequence) or \
                not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        put("stop", tuple(dict.fromkeys(stop)))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise SamplingParamsError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        put("stop_token_ids", tuple(dict.fromkeys(integer("a stop token id", t, 0, INT32_MAX) for t in ids)))
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output"):
            flag(name)
        if not self.skip_special_tokens:
            raise SamplingParamsError("skip_special_tokens=False is not implemented in kvjax (text always skips "
                                      "special tokens)")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop strings need detokenize=True")
        if self.max_tokens is not None:
            put("max_tokens", integer("max_tokens", self.max_tokens, 1, INT32_MAX))
        put("min_tokens", integer("min_tokens", self.min_tokens, 0, self.max_tokens))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                value = 1
            if value is not None:
                put(name, integer(name, value, -1, INT32_MAX))
        if self.temperature < SAMPLING_EPS:  # greedy: vLLM resets the filters and refuses n > 1
            put("top_p", 1.0), put("top_k", 0), put("min_p", 0.0)
            if self.n > 1:
                raise SamplingParamsError(f"n must be 1 when using greedy sampling, got {self.n}")
        elif self.temperature < MIN_TEMPERATURE:
            put("temperature", MIN_TEMPERATURE)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def stop_ids(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """Tokens that end this request: stop_token_ids, plus the model's EOS ids unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    def banned_until_min_tokens(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """Tokens masked while fewer than min_tokens were generated: vLLM's all_stop_token_ids
        (stop_token_ids and every EOS id, even with ignore_eos)."""
        return frozenset(self.stop_token_ids) | frozenset(eos_token_ids) if self.min_tokens else frozenset()


_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def _real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and x == x


def request_key(engine_seed: int, request_number: int, seed: int | None) -> np.ndarray:
    """The raw key data u32[2] of one request's random stream (see the module docstring)."""
    key = jax.random.key(seed) if seed is not None else jax.random.fold_in(jax.random.key(engine_seed),
                                                                           request_number)
    return np.asarray(jax.random.key_data(key), np.uint32)


@struct.dataclass
class SamplingRows:
    """Each row's sampling parameters as arrays (one compile serves any mix). Empty rows are
    greedy and unused. `prompt_mask` and `counts` are None when no row has a penalty."""

    keys: jax.Array  # u32[B, 2] the row's request key
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B], <= 0: off
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    banned: jax.Array  # i32[B, X] stop ids masked while position < min_position (-1 padding)
    min_position: jax.Array  # i32[B] prompt length + min_tokens
    presence: jax.Array  # f32[B]
    frequency: jax.Array  # f32[B]
    repetition: jax.Array  # f32[B]
    prompt_mask: jax.Array | None = None  # bool[B, V] token occurs in the prompt
    counts: jax.Array | None = None  # i32[B, V] occurrences in the output so far

    @staticmethod
    def build(params: Sequence[SamplingParams | None], keys, prompts: Sequence[Sequence[int]],
              outputs: Sequence[Sequence[int]], eos_token_ids: Sequence[int], vocab_size: int) -> "SamplingRows":
        """Rows from each row's params (None = an empty row), key u32[2], prompt and output so far."""
        b = len(params)
        f32 = lambda v: np.full(b, v, np.float32)  # noqa: E731
        temp, top_p, min_p, pres, freq, rep = f32(0), f32(1), f32(0), f32(0), f32(0), f32(1)
        top_k, min_position = np.zeros(b, np.int32), np.zeros(b, np.int32)
        banned_sets = [p.banned_until_min_tokens(eos_token_ids) if p else frozenset() for p in params]
        banned = np.full((b, max(1, max(map(len, banned_sets)))), -1, np.int32)
        penalties = any(p is not None and p.has_penalties for p in params)
        prompt_mask = np.zeros((b, vocab_size), bool) if penalties else None
        counts = np.zeros((b, vocab_size), np.int32) if penalties else None
        key_rows = np.zeros((b, 2), np.uint32)
        for i, p in enumerate(params):
            if p is None:
                continue
            key_rows[i] = keys[i]
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            pres[i], freq[i], rep[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            banned[i, :len(banned_sets[i])] = sorted(banned_sets[i])
            min_position[i] = len(prompts[i]) + p.min_tokens
            if penalties and p.has_penalties:
                prompt_mask[i, np.asarray(prompts[i], np.int64)] = True
                np.add.at(counts[i], np.asarray(outputs[i], np.int64), 1)
        return SamplingRows(key_rows, temp, top_k, top_p, min_p, banned, min_position, pres, freq, rep,
                            prompt_mask, counts)

    def add_tokens(self, tokens: jax.Array, mask: jax.Array) -> "SamplingRows":
        """The rows after appending tokens i32[B] where mask bool[B] (the output counts grow)."""
        if self.counts is None:
            return self
        counts = jnp.asarray(self.counts)
        return self.replace(counts=counts.at[jnp.arange(tokens.shape[0]), tokens].add(jnp.asarray(mask, jnp.int32)))


@struct.dataclass
class Sampled:
    """What `sample` returns per row."""

    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B] the chosen token's raw log-probability
    ranks: jax.Array  # i32[B] its rank (1 = most likely)
    top_ids: jax.Array  # i32[B, J] the J most likely tokens
    top_logprobs: jax.Array  # f32[B, J]


def apply_penalties(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """vLLM's `apply_penalties`: repetition on prompt-or-output tokens, then frequency and presence
    on output tokens. logits f32[B, V]."""
    if rows.counts is None:
        return logits
    seen = rows.prompt_mask | (rows.counts > 0)
    penalty = jnp.where(seen, rows.repetition[:, None], 1.0)
    logits = logits * jnp.where(logits > 0, 1.0 / penalty, penalty)
    logits = logits - rows.frequency[:, None] * rows.counts
    return logits - rows.presence[:, None] * (rows.counts > 0)


def mask_min_tokens(logits: jax.Array, rows: SamplingRows, positions: jax.Array) -> jax.Array:
    """Stop tokens → −inf in rows whose new token (at positions i32[B]) comes before min_position."""
    b = logits.shape[0]
    short = (positions < rows.min_position)[:, None] & (rows.banned >= 0)  # bool[B, X]
    at = jnp.where(short, rows.banned, logits.shape[1])  # out of range: dropped
    return logits.at[jnp.arange(b)[:, None], at].set(-jnp.inf, mode="drop")


def filter_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """bool[B, V]: the tokens each row keeps. logits f32[B, V] (after temperature); top_k i32[B]
    (<= 0 = all); top_p f32[B] (1 = all); min_p f32[B] (0 = all).

    min_p keeps tokens with probability >= min_p × the largest; then top-k and top-p keep a prefix
    of the survivors sorted by logit, so one threshold per row says which: top-k keeps k, top-p
    the shortest prefix whose probability, renormalized over the top-k survivors, reaches p (a
    token is kept while the probability before it is < p).
    """
    vocab = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    logits = jnp.where(probs < min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, logits)
    ordered = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # i32[B]
    in_top_k = (jnp.arange(vocab)[None, :] < k[:, None]) & (ordered > -jnp.inf)  # bool[B, V] in sorted order
    kept = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    before = jnp.cumsum(kept, axis=-1) - kept  # probability of the tokens ahead of each
    keep = in_top_k & (before < top_p[:, None])
    count = jnp.maximum(keep.sum(axis=-1), 1)  # the most likely token always stays
    threshold = jnp.take_along_axis(ordered, (count - 1)[:, None], axis=-1)  # [B, 1]
    return logits >= threshold


def sample(logits: jax.Array, rows: SamplingRows, positions: jax.Array, num_logprobs: int = 0) -> Sampled:
    """The next token of every row from logits f32[B, V] (module docstring's order).

    positions: i32[B] the position each new token takes. num_logprobs (static): J, how many
    most likely tokens to report per row. Traced parameters, so changing one does not
    recompile; `lax.cond`s skip the draw when every row is greedy (the B × V threefry numbers
    cost ~8× the argmax on a CPU) and the sort when no row filters.
    """
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    logits = apply_penalties(mask_min_tokens(logits, rows, positions), rows)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = rows.temperature >= SAMPLING_EPS

    def draw(logits):
        scaled = logits / jnp.where(sampling, rows.temperature, 1.0)[:, None]
        filtered = jnp.any(sampling & ((rows.top_k > 0) | (rows.top_p < 1) | (rows.min_p > 0)))
        scaled = jax.lax.cond(
            filtered, lambda x: jnp.where(filter_mask(x, rows.top_k, rows.top_p, rows.min_p), x, -jnp.inf),
            lambda x: x, scaled)
        row_keys = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.wrap_key_data(k), p))(rows.keys, positions)
        return jax.vmap(jax.random.categorical)(row_keys, scaled).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(sampling), draw, lambda lg: greedy, logits)
    tokens = jnp.where(sampling, drawn, greedy)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)  # [B, 1]
    ranks = (raw >= chosen).sum(axis=-1).astype(jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
    return Sampled(tokens, chosen[:, 0], ranks, top_ids.astype(jnp.int32), top_logprobs)
