"""kvjax.sampling: top-k / top-p on hand-built distributions, SamplingParams' rules.

The nucleus of each case is worked out by hand from vLLM's rule (temperature, then top-k,
then top-p over the renormalized survivors; a token is kept while the probability of the
tokens ranked above it is < p), and the draws are counted over many positions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.sampling import SamplingParams, SamplingParamsError, request_key, sample, top_k_top_p_mask

PROBS = np.array([0.05, 0.5, 0.15, 0.3])  # ranked: token 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
LOGITS = np.log(PROBS).astype(np.float32)


def kept(top_k=0, top_p=1.0, temperature=1.0) -> set[int]:
    mask = top_k_top_p_mask(jnp.asarray(LOGITS / temperature)[None], jnp.asarray([top_k]), jnp.asarray([top_p]))
    return set(np.flatnonzero(np.asarray(mask[0])).tolist())


@pytest.mark.parametrize("top_k, top_p, temperature, nucleus", [
    (0, 1.0, 1.0, {0, 1, 2, 3}),
    (1, 1.0, 1.0, {1}),
    (2, 1.0, 1.0, {1, 3}),
    (0, 0.5, 1.0, {1}),  # 0.5 before token 3 is not < 0.5
    (0, 0.8, 1.0, {1, 3}),  # before token 2: 0.8, not < 0.8
    (0, 0.81, 1.0, {1, 3, 2}),
    (0, 0.7, 1.0, {1, 3}),
    # temperature first: T = 2 flattens to p ∝ sqrt(p) = [.224, .707, .387, .548] / 1.866 = [.120, .379, .208, .294];
    # before token 2: .379 + .294 = .673 < .7, so it is kept
    (0, 0.7, 2.0, {1, 3, 2}),
    # top-k first, then top-p over the renormalized top 3: [.5, .3, .15] / .95 = [.526, .316, .158]
    (3, 0.8, 1.0, {1, 3}),  # before token 2: .842
    (3, 0.85, 1.0, {1, 3, 2}),
])
def test_top_k_top_p_keep_exactly_the_nucleus(top_k, top_p, temperature, nucleus):
    assert kept(top_k, top_p, temperature) == nucleus


def test_draws_follow_the_renormalized_nucleus():
    n = 20000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, 4))
    keys = jnp.broadcast_to(jnp.asarray(request_key(0, 0, 42)), (n, 2))
    positions = jnp.arange(n, dtype=jnp.int32)  # every position draws with its own key
    draw = jax.jit(sample)
    tokens, logprobs = draw(logits, keys, positions, jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.full(n, 0.8))
    counts = np.bincount(np.asarray(tokens), minlength=4) / n
    np.testing.assert_allclose(counts, [0, 0.5 / 0.8, 0, 0.3 / 0.8], atol=0.015)
    # the reported log-prob is the raw model's, before temperature and the filters (vLLM's default)
    np.testing.assert_allclose(np.asarray(logprobs), np.log(PROBS)[np.asarray(tokens)], rtol=1e-5)
    # top_k = 1 at any temperature is the argmax
    tokens, _ = draw(logits, keys, positions, jnp.full(n, 3.0), jnp.ones(n, jnp.int32), jnp.ones(n))
    assert set(np.asarray(tokens).tolist()) == {1}


def test_greedy_and_sampled_rows_in_one_batch():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)).astype(np.float32))
    keys = jnp.asarray(np.stack([request_key(0, i, None) for i in range(6)]))
    temp = jnp.asarray([0, 1.0, 0, 2.0, 0, 0.5], jnp.float32)
    tokens, _ = sample(logits, keys, jnp.zeros(6, jnp.int32), temp, jnp.zeros(6, jnp.int32), jnp.ones(6))
    argmax = np.argmax(np.asarray(logits), -1)
    np.testing.assert_array_equal(np.asarray(tokens)[[0, 2, 4]], argmax[[0, 2, 4]])
    # a sampled row draws the same token whatever the other rows are
    alone, _ = sample(logits[1:2], keys[1:2], jnp.zeros(1, jnp.int32), temp[1:2], jnp.zeros(1, jnp.int32), jnp.ones(1))
    assert int(alone[0]) == int(tokens[1])


@pytest.mark.parametrize("kw, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=2.5), "max_tokens must be an integer >= 1, got 2.5"),
    (dict(temperature=-1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(seed=-3), "seed must be an integer >= 0"),
    (dict(stop_token_ids=[1, -2]), "a stop token id must be an integer >= 0, got -2"),
    (dict(stop_token_ids="12"), "stop_token_ids must be a sequence of token ids"),
    (dict(ignore_eos=1), "ignore_eos must be True or False"),
    (dict(logprobs=5), "logprobs=5: kvjax returns the chosen token's log-probability only"),
])
def test_sampling_params_refuse_bad_values(kw, message):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert message in str(e.value)


def test_stop_ids_follow_ignore_eos():
    assert SamplingParams(stop_token_ids=[7]).stop_ids([2]) == {2, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).stop_ids([2]) == {7}
