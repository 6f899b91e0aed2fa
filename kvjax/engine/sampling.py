"""The token sampler (vLLM V1's `v1/sample/sampler.py`): a step's logits and each request's
SamplingParams (kvjax.engine.sampling_params, re-exported here) → the next tokens.

The sampler works on a whole step at once, one row per request, each row's parameters as
arrays (`SamplingRows`), so a batch that mixes greedy and sampled requests compiles once. It
follows vLLM's `Sampler.forward` order:

    structured outputs: tokens the grammar's bitmask leaves out → −inf  (vLLM masks the model's
                  logits before its sampler, so the log-probabilities are of the masked ones)
    raw log-probs = log_softmax(logits)                           (what logprobs report)
    allowed_token_ids: every other token → −inf
    bad words:    a word's last token → −inf when the output so far ends with its other tokens
    min_tokens:   stop tokens (stop_token_ids and every EOS) → −inf while the output is short
    logit_bias:   + the request's bias (clamped to [−100, 100]; −inf stays −inf)
    penalties:    repetition (prompt or output tokens: logit / r if > 0 else logit × r),
                  then frequency (− f × count in output), presence (− p × [in output])
    greedy rows (temperature < 1e-5): argmax (lowest id on a tie, as torch.argmax)
    temperature → min_p (drop p < min_p × max p) → top-k → top-p → a draw

(vLLM: the allowed-token mask and bad words in `apply_logits_processors`, then its built-in
non-argmax-invariant processors in `BUILTIN_LOGITS_PROCESSORS` order, MinTokens then LogitBias,
then `apply_penalties`; MinP after temperature.) Bad words are vLLM's `_apply_bad_words_single_
batch`: a word of k tokens bans its last token when the last k - 1 *output* tokens (the prompt
does not count) are its first k - 1; a one-token word is always banned.

`top_k` keeps the k largest logits; `top_p` the smallest set of the most likely tokens whose
probability (after temperature, min_p and top-k) reaches p; tokens tied with the last kept one
are kept too.

Each feature a step's rows may not use is None in `SamplingRows` (penalties' [B, V] arrays, the
logit biases, allowed ids, bad words), so a step where no row uses it traces exactly the
program it traced before the feature existed; the ones that are used are sparse id lists padded
to a power of two. Bad words follow the output, and the device loop keeps them right on its own:
`add_tokens` shifts each row's window of recent output tokens, as it grows the penalties' counts.
Two static flags do the same for the draw (vLLM's `SamplingMetadata.all_greedy`, `no_top_k`,
`no_top_p`): `any_drawn` (some row samples) and `any_filtered` (some sampling row has top-k, top-p
or min_p). The device decode loop's steps of greedy rows trace no draw, and no branch: on a GPU a
`lax.cond` inside the loop copies its predicate to the host and waits for it, every step. A ragged
step sets both to None (`decided_on_device`): `lax.cond`s decide, one program for any rows.

Each sampled token draws its randomness from `fold_in(request_key, position)`, where the
request key is `key(seed)` for a request with its own seed (vLLM's per-request generator;
the j-th of n parallel samples uses seed + j, as vLLM's `ParentRequest`) and `fold_in(key(engine
seed), request number)` otherwise, and position is the index the new token takes in its
sequence. A token's draw therefore depends on nothing the scheduler decides (step, row, how
many steps one device call runs, preemption), so the same seed gives the same tokens under any
schedule.

Log-probabilities are the model's raw distribution (vLLM V1's default `raw_logprobs`), before
any of the steps above; a token's rank is the number of vocabulary entries with a
log-probability >= its own (vLLM's `batched_count_greater_than`), so the most likely token has
rank 1. Trace replay (vLLM's `trace_decode_token_ids`, `replay_trace`) replaces a row's drawn
token with its trace's next one before they are read, so they are the forced token's.

Axes: the kvjax package docstring's legend; `bias`, `allowed`, `words` and `length` are the
padded widths of a step's logit biases, allowed ids, bad words and bad-word tokens.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.engine.sampling_params import (  # noqa: F401 (re-exported: the sampler's parameters)
    SAMPLING_EPS, RequestOutputKind, SamplingParams, SamplingParamsError, needs_host_every_token)
from kvjax.math_utils import pow2_bucket

def request_key(engine_seed: int, request_number: int, seed: int | None) -> np.ndarray:
    """The raw key data u32[2] of one request's random stream (see the module docstring). The
    unseeded case is one jitted call on the engine seed's key (eager JAX would dispatch each of
    key, fold_in and key_data on its own: ~1 ms a request)."""
    if seed is not None:
        return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
    return np.asarray(_fold_in(_seed_key(engine_seed), np.uint32(request_number)))


@functools.lru_cache(maxsize=16)
def _seed_key(engine_seed: int) -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.key(engine_seed)), np.uint32)


@jax.jit
def _fold_in(key_data, number):
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key_data), number))


_ANY = -2  # a bad word's padding before its first token: matches whatever token (or none) is there


def _padded(rows: list, fill, dtype) -> np.ndarray:
    """Rows of different lengths as one [B, width] array, width the longest bucketed to a power
    of two (so a new length seldom means a new compile), padded with fill."""
    out = np.full((len(rows), pow2_bucket(max(1, max(map(len, rows))))), fill, dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def _bad_words(words: list[list[list[int]]], outputs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(bad_ids i32[B, words, length], recent i32[B, length - 1]): each row's bad words right-aligned
    (last token in the last column, _ANY before the first; unused words all -1), and the row's
    last length - 1 output tokens right-aligned (-1 before the output's first)."""
    length = pow2_bucket(max(len(s) for row in words for s in row))
    bad_ids = np.full((len(words), pow2_bucket(max(map(len, words))), length), -1, np.int32)
    recent = np.full((len(words), length - 1), -1, np.int32)
    for i, row in enumerate(words):
        for j, s in enumerate(row):
            bad_ids[i, j, :length - len(s)], bad_ids[i, j, length - len(s):] = _ANY, s
        tail = list(outputs[i])[max(0, len(outputs[i]) - (length - 1)):] if row and length > 1 else []
        recent[i, length - 1 - len(tail):] = tail
    return bad_ids, recent


@struct.dataclass
class SamplingRows:
    """Each row's sampling parameters as arrays (one compile serves any mix). Empty rows are
    greedy and unused. Each optional field is None when no row of the step uses its feature."""

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
    prompt_mask: jax.Array | None = None  # bool[B, V] token occurs in the prompt (penalties)
    counts: jax.Array | None = None  # i32[B, V] occurrences in the output so far (penalties)
    bias_ids: jax.Array | None = None  # i32[B, bias] logit_bias token ids (-1 padding)
    bias_values: jax.Array | None = None  # f32[B, bias] their biases (0 padding)
    allowed_ids: jax.Array | None = None  # i32[B, allowed] allowed_token_ids (-1 padding; all -1: no limit)
    bad_ids: jax.Array | None = None  # i32[B, words, length] bad words, right-aligned (see _bad_words)
    recent: jax.Array | None = None  # i32[B, length - 1] the last output tokens, right-aligned (-1: none)
    token_bitmask: jax.Array | None = None  # i32[B, cdiv(V, 32)] structured outputs: bit t % 32 of word t // 32 = allowed
    trace_ids: jax.Array | None = None  # i32[B, trace] trace replay: the output tokens each row emits (-1 padding)
    trace_start: jax.Array | None = None  # i32[B] the position its first output token takes (its prompt's length)
    any_drawn: bool | None = struct.field(pytree_node=False, default=None)  # a row samples (None: a cond decides)
    any_filtered: bool | None = struct.field(pytree_node=False, default=None)  # a sampling row filters (likewise)

    @staticmethod
    def build(params: Sequence[SamplingParams | None], keys, prompts: Sequence[Sequence[int]],
              outputs: Sequence[Sequence[int]], eos_token_ids: Sequence[int], vocab_size: int,
              token_bitmask: np.ndarray | None = None) -> "SamplingRows":
        """Rows from each row's params (None = an empty row), key u32[2], prompt and output so far.
        A row with bad_words needs `update_from_tokenizer` to have run on its params. token_bitmask:
        the structured outputs' masks of this step (kvjax.engine.structured_output; None: no row has one)."""
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
            if p.bad_words and not p.bad_words_token_ids:
                raise SamplingParamsError("bad_words need update_from_tokenizer(tokenizer) before sampling")
        biases = [(p.logit_bias or {}) if p is not None else {} for p in params]
        allowed = [sorted(set(p.allowed_token_ids or ())) if p is not None else [] for p in params]
        words = [(p.bad_words_token_ids or []) if p is not None else [] for p in params]
        bias_ids = _padded([list(d) for d in biases], -1, np.int32) if any(biases) else None
        bias_values = _padded([list(d.values()) for d in biases], 0, np.float32) if any(biases) else None
        bad_ids, recent = _bad_words(words, outputs) if any(words) else (None, None)
        drawn = temp >= SAMPLING_EPS
        return SamplingRows(key_rows, temp, top_k, top_p, min_p, banned, min_position, pres, freq, rep,
                            prompt_mask, counts, bias_ids, bias_values,
                            _padded(allowed, -1, np.int32) if any(allowed) else None, bad_ids, recent,
                            token_bitmask, **_trace_rows(params, prompts), any_drawn=bool(drawn.any()),
                            any_filtered=bool((drawn & ((top_k > 0) | (top_p < 1) | (min_p > 0))).any()))

    def decided_on_device(self) -> "SamplingRows":
        """The rows with the draw and the filter left to `lax.cond`s (see the module docstring)."""
        return self.replace(any_drawn=None, any_filtered=None)

    def add_tokens(self, tokens: jax.Array, mask: jax.Array) -> "SamplingRows":
        """The rows after appending tokens i32[B] where mask bool[B]: the output counts grow and
        the bad words' window of recent tokens moves on (what the device loop needs between steps)."""
        rows = self
        if self.counts is not None:
            counts = jnp.asarray(self.counts)
            rows = rows.replace(counts=counts.at[jnp.arange(tokens.shape[0]), tokens].add(jnp.asarray(mask, jnp.int32)))
        if self.recent is not None and self.recent.shape[1]:
            recent = jnp.asarray(self.recent)
            moved = jnp.concatenate([recent[:, 1:], tokens[:, None].astype(recent.dtype)], axis=1)
            rows = rows.replace(recent=jnp.where(jnp.asarray(mask)[:, None], moved, recent))
        return rows


@struct.dataclass
class Sampled:
    """What `sample` returns per row."""

    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B] the chosen token's raw log-probability
    ranks: jax.Array  # i32[B] its rank (1 = most likely)
    top_ids: jax.Array  # i32[B, J] the J most likely tokens
    top_logprobs: jax.Array  # f32[B, J]


def _trace_rows(params: Sequence[SamplingParams | None], prompts: Sequence[Sequence[int]]) -> dict:
    """SamplingRows' trace replay fields: each row's trace_decode_token_ids (padded with -1) and
    its prompt's length; none when no row replays a trace."""
    traces = [(p.trace_decode_token_ids or []) if p is not None else [] for p in params]
    if not any(traces):
        return {}
    return dict(trace_ids=_padded(traces, -1, np.int32), trace_start=np.array([len(t) for t in prompts], np.int32))


def replay_trace(tokens: jax.Array, rows: SamplingRows, positions: jax.Array) -> jax.Array:
    """vLLM's trace replay (`apply_trace_tokens`): a row with a trace emits its next trace token
    instead of the one it sampled, the trace's k-th token at output position k (positions i32[B]
    minus the prompt's length: it depends on no schedule, so a preempted request recomputes into
    the same tokens). The log-probabilities and ranks are then the forced token's, from the same
    distribution. tokens i32[B]."""
    if rows.trace_ids is None:
        return tokens
    k = positions - rows.trace_start  # i32[B] the output index of each row's new token
    width = rows.trace_ids.shape[1]
    forced = jnp.take_along_axis(rows.trace_ids, jnp.clip(k, 0, width - 1)[:, None], axis=1)[:, 0]
    return jnp.where((k >= 0) & (k < width) & (forced >= 0), forced, tokens)


def _scatter(logits: jax.Array, ids: jax.Array, where: jax.Array | None = None):
    """(row index i32[B, 1], column ids i32[B, n]) for `.at[]`: padding (id < 0), and ids not
    selected by where bool[B, n], point past the vocabulary, so that mode="drop" skips them."""
    ok = ids >= 0 if where is None else (ids >= 0) & where
    return jnp.arange(logits.shape[0])[:, None], jnp.where(ok, ids, logits.shape[1])


def mask_grammar(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """Tokens a structured output's grammar does not allow next → −inf (vLLM's
    `apply_grammar_bitmask`, on the model's logits before the sampler). logits f32[B, V]."""
    if rows.token_bitmask is None:
        return logits
    ids = jnp.arange(logits.shape[1])
    words = jnp.asarray(rows.token_bitmask)[:, ids // 32]  # i32[B, V] each token's word
    allowed = ((words >> (ids % 32)) & 1).astype(bool)  # arithmetic shift: bit 31 of a negative word reads as 1
    return jnp.where(allowed, logits, -jnp.inf)


def mask_allowed(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """Rows with allowed_token_ids: every other token → −inf (vLLM's allowed_token_ids_mask).
    logits f32[B, V]."""
    if rows.allowed_ids is None:
        return logits
    keep = jnp.zeros(logits.shape, bool).at[_scatter(logits, rows.allowed_ids)].set(True, mode="drop")  # bool[B, V]
    limited = (rows.allowed_ids >= 0).any(axis=-1)  # bool[B]
    return jnp.where(limited[:, None] & ~keep, -jnp.inf, logits)


def mask_bad_words(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """A bad word's last token → −inf where the row's last output tokens are its other tokens
    (vLLM's `apply_bad_words`: a word longer than the output + 1 never matches). logits f32[B, V]."""
    if rows.bad_ids is None:
        return logits
    prefix, last = rows.bad_ids[:, :, :-1], rows.bad_ids[:, :, -1]  # [B, words, length - 1], [B, words]
    match = ((prefix == _ANY) | (prefix == rows.recent[:, None, :])).all(axis=-1)  # bool[B, words]
    return logits.at[_scatter(logits, last, match)].set(-jnp.inf, mode="drop")


def add_logit_bias(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """logits f32[B, V] + each row's logit_bias (vLLM's LogitBiasLogitsProcessor)."""
    if rows.bias_ids is None:
        return logits
    return logits.at[_scatter(logits, rows.bias_ids)].add(rows.bias_values, mode="drop")


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


def process_logits(logits: jax.Array, rows: SamplingRows, positions: jax.Array) -> jax.Array:
    """The logits f32[B, V] the greedy argmax reads: allowed ids, bad words, min_tokens, logit
    bias, then penalties (vLLM's `apply_logits_processors`; positions i32[B] as in `sample`)."""
    logits = mask_min_tokens(mask_bad_words(mask_allowed(logits, rows), rows), rows, positions)
    return apply_penalties(add_logit_bias(logits, rows), rows)


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
    recompile; the draw is left out when every row is greedy (the B × V threefry numbers cost
    ~8× the argmax on a CPU) and the sort when no row filters: by the rows' static flags, or by
    `lax.cond`s where they are None.
    """
    logits = mask_grammar(logits.astype(jnp.float32), rows)  # before the log-probabilities, as vLLM masks
    raw = jax.nn.log_softmax(logits, axis=-1)
    logits = process_logits(logits, rows, positions)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = rows.temperature >= SAMPLING_EPS

    def draw(logits):
        scaled = logits / jnp.where(sampling, rows.temperature, 1.0)[:, None]
        keep = lambda x: jnp.where(filter_mask(x, rows.top_k, rows.top_p, rows.min_p), x, -jnp.inf)  # noqa: E731
        if rows.any_filtered is None:
            filtered = jnp.any(sampling & ((rows.top_k > 0) | (rows.top_p < 1) | (rows.min_p > 0)))
            scaled = jax.lax.cond(filtered, keep, lambda x: x, scaled)
        elif rows.any_filtered:
            scaled = keep(scaled)
        row_keys = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.wrap_key_data(k), p))(rows.keys, positions)
        return jax.vmap(jax.random.categorical)(row_keys, scaled).astype(jnp.int32)

    if rows.any_drawn is None:
        drawn = jax.lax.cond(jnp.any(sampling), draw, lambda lg: greedy, logits)
    else:
        drawn = draw(logits) if rows.any_drawn else greedy
    tokens = replay_trace(jnp.where(sampling, drawn, greedy), rows, positions)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)  # [B, 1]
    ranks = (raw >= chosen).sum(axis=-1).astype(jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
    return Sampled(tokens, chosen[:, 0], ranks, top_ids.astype(jnp.int32), top_logprobs)
