"""Sampling parameters and the token sampler (vLLM V1 `SamplingParams`, `v1/sample/sampler.py`).

`SamplingParams` is the per-request part of vLLM's offline API that kvjax implements:
max_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos and logprobs. The
sampler works on a whole step at once with one row per request, each row with its own
parameters as arrays, so a batch that mixes greedy and sampled requests compiles once:

    logits → temperature → top-k → top-p → a draw     (vLLM's order)

A row with temperature 0 is greedy: the argmax, the lowest id on a tie (as torch.argmax and
transformers' greedy search), ignoring top-k and top-p as vLLM does. `top_k` keeps the k
largest logits (0: all); `top_p` keeps the smallest set of the most likely tokens whose
probability (after temperature and top-k) reaches p (1.0: all); tokens tied with the last
kept one are kept too.

Each sampled token draws its randomness from `fold_in(request_key, position)`, where the
request key is `key(seed)` for a request with its own seed (vLLM's per-request generator)
and `fold_in(key(engine seed), request index)` otherwise, and position is the index the new
token takes in its sequence. A token's draw therefore depends on nothing the scheduler
decides — which step it lands in, which row, how many steps one device call runs, whether
the request was preempted and recomputed — so the same seed gives the same tokens under any
schedule, and `steps_per_call=8` samples exactly what `steps_per_call=1` does.

The log-probability reported for a token is that of the model's raw distribution,
log_softmax(logits), before temperature, top-k and top-p (vLLM V1's default `raw_logprobs`).

Axis legend: B rows (requests in a step), V vocabulary.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import KvjaxError


class SamplingParamsError(KvjaxError):
    """A sampling parameter outside its range; the message names it and the rule."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request generates (vLLM `SamplingParams`, the fields kvjax implements).

    max_tokens: tokens to generate at most (fewer if the request reaches max_model_len or stops).
    temperature: 0 is greedy; above 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0: all). top_p: keep the nucleus of probability p.
    seed: this request's own random stream; None draws from the engine's seed and the
        request's index in the batch.
    stop_token_ids: tokens that end the request (finish_reason "stop"); the stop token is
        part of the output, as in vLLM.
    ignore_eos: keep generating past the model's EOS token (stop_token_ids still stop).
    logprobs: None, or 0 to return each generated token's log-probability. vLLM's N > 0
        (the N most likely alternatives as well) is not implemented.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        def integer(name, value, low):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise SamplingParamsError(f"{name} must be an integer >= {low}, got {value!r}")

        integer("max_tokens", self.max_tokens, 1)
        integer("top_k", self.top_k, 0)
        if not _real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise SamplingParamsError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                                      f"{self.temperature!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            integer("seed", self.seed, 0)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
            raise SamplingParamsError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            integer("a stop token id", t, 0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None and self.logprobs != 0:
            raise SamplingParamsError(f"logprobs={self.logprobs!r}: kvjax returns the chosen token's "
                                      "log-probability only; pass logprobs=0 (or None for none)")

    def stop_ids(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """Tokens that end this request: stop_token_ids, plus the model's EOS unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


def _real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and x == x


def request_key(engine_seed: int, request_index: int, seed: int | None) -> np.ndarray:
    """The raw key data u32[2] of one request's random stream (see the module docstring)."""
    key = jax.random.key(seed) if seed is not None else jax.random.fold_in(jax.random.key(engine_seed),
                                                                           request_index)
    return np.asarray(jax.random.key_data(key), np.uint32)


def top_k_top_p_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """bool[B, V]: the tokens each row keeps. logits f32[B, V] (after temperature); top_k i32[B]
    (0 = all); top_p f32[B] (1 = all).

    Both filters keep a prefix of the tokens sorted by logit, so one threshold per row says
    which: top-k keeps k, top-p the shortest prefix whose probability, renormalized over the
    top-k survivors, reaches p (a token is kept while the probability before it is < p).
    """
    vocab = logits.shape[-1]
    ordered = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # i32[B]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]  # bool[B, V] in sorted order
    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ahead of each
    keep = in_top_k & (before < top_p[:, None])
    count = jnp.maximum(keep.sum(axis=-1), 1)  # the most likely token always stays
    threshold = jnp.take_along_axis(ordered, (count - 1)[:, None], axis=-1)  # [B, 1]
    return logits >= threshold


def sample(logits: jax.Array, keys: jax.Array, positions: jax.Array, temperature: jax.Array,
           top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Next tokens i32[B] and their log-probabilities f32[B] from logits f32[B, V].

    keys: u32[B, 2] each row's request key (`request_key`); positions: i32[B] the position the
    new token takes; temperature, top_p: f32[B]; top_k: i32[B]. Traced arrays, so changing a
    parameter does not recompile. `lax.cond`s skip the draw when every row is greedy (the B × V
    threefry numbers cost ~8× the argmax on a CPU) and the sort when no row filters.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = temperature > 0

    def draw(logits):
        scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None]
        filtered = jnp.any(sampling & ((top_k > 0) | (top_p < 1)))
        scaled = jax.lax.cond(filtered, lambda x: jnp.where(top_k_top_p_mask(x, top_k, top_p), x, -jnp.inf),
                              lambda x: x, scaled)
        row_keys = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.wrap_key_data(k), p))(keys, positions)
        return jax.vmap(jax.random.categorical)(row_keys, scaled).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(sampling), draw, lambda lg: greedy, logits)
    tokens = jnp.where(sampling, drawn, greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
