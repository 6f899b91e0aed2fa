"""kvjax.engine.sampling against hand-worked cases and an independent NumPy statement of vLLM's rules.

The nucleus cases are worked out by hand from vLLM's rule (temperature, then min_p, top-k, then
top-p over the renormalized survivors; a token is kept while the probability of the tokens
ranked above it is < p). Penalties, min_p, min_tokens, ranks and top-k log-probabilities are
checked against `_np_*`, written here from vLLM 0.33's own code (`model_executor/layers/utils.py
apply_penalties`, `_custom_ops.apply_repetition_penalties_torch`, `MinPLogitsProcessor.apply`,
`MinTokensLogitsProcessor`, `Sampler.gather_logprobs`), on hand-built logits.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine.sampling import (RequestOutputKind, SamplingParams, SamplingParamsError, SamplingRows,
                                   apply_penalties, filter_mask, mask_min_tokens, request_key, sample)

PROBS = np.array([0.05, 0.5, 0.15, 0.3])  # ranked: token 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
LOGITS = np.log(PROBS).astype(np.float32)


def rows_for(params, prompts=None, outputs=None, eos=(), vocab=4, keys=None):
    b = len(params)
    keys = np.stack([request_key(0, i, p.seed) for i, p in enumerate(params)]) if keys is None else keys
    return SamplingRows.build(params, keys, prompts or [[0]] * b, outputs or [[]] * b, eos, vocab)


def kept(top_k=0, top_p=1.0, temperature=1.0, min_p=0.0) -> set[int]:
    mask = filter_mask(jnp.asarray(LOGITS / temperature)[None], jnp.asarray([top_k]), jnp.asarray([top_p]),
                       jnp.asarray([min_p]))
    return set(np.flatnonzero(np.asarray(mask[0])).tolist())


@pytest.mark.parametrize("engine_seed", [0, 1, 2**31, 2**32 - 1])
def test_request_keys_are_jax_random_keys_folded_with_the_request_number(engine_seed):
    # the module docstring's streams, with JAX's own eager calls as the reference
    for number in (0, 5, 2**20, 2**31 - 1, 2**32 - 1):
        want = jax.random.key_data(jax.random.fold_in(jax.random.key(engine_seed), number))
        np.testing.assert_array_equal(request_key(engine_seed, number, None), np.asarray(want, np.uint32))
    for seed in (0, 7, 2**32 - 1, 2**40):  # a request's own seed: key(seed), whatever the engine's
        want = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
        np.testing.assert_array_equal(request_key(engine_seed, 3, seed), want)


@pytest.mark.parametrize("top_k, top_p, temperature, nucleus", [
    (0, 1.0, 1.0, {0, 1, 2, 3}),
    (-1, 1.0, 1.0, {0, 1, 2, 3}),  # vLLM: -1 is off too
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


@pytest.mark.parametrize("min_p, nucleus", [
    (0.0, {0, 1, 2, 3}),
    (0.09, {0, 1, 2, 3}),  # 0.05 >= 0.09 × 0.5
    (0.11, {1, 2, 3}),  # 0.05 < 0.055
    (0.29, {1, 2, 3}),  # 0.15 >= 0.145
    (0.31, {1, 3}),  # 0.15 < 0.155
    (1.0, {1}),
])
def test_min_p_keeps_tokens_above_its_share_of_the_top(min_p, nucleus):
    assert kept(min_p=min_p) == nucleus


def test_draws_follow_the_renormalized_nucleus():
    n = 20000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, 4))
    rows = rows_for([SamplingParams(top_p=0.8, seed=42)] * n, keys=np.broadcast_to(request_key(0, 0, 42), (n, 2)))
    positions = jnp.arange(n, dtype=jnp.int32)  # every position draws with its own key
    draw = jax.jit(sample, static_argnums=3)
    out = draw(logits, rows, positions, 0)
    counts = np.bincount(np.asarray(out.tokens), minlength=4) / n
    np.testing.assert_allclose(counts, [0, 0.5 / 0.8, 0, 0.3 / 0.8], atol=0.015)
    # the reported log-prob is the raw model's, before temperature and the filters (vLLM's default)
    np.testing.assert_allclose(np.asarray(out.logprobs), np.log(PROBS)[np.asarray(out.tokens)], rtol=1e-5)
    # min_p = 0.31 keeps tokens 1 and 3 (see above): drawn in proportion 0.5 : 0.3
    rows = rows_for([SamplingParams(min_p=0.31, seed=42)] * n, keys=np.broadcast_to(request_key(0, 0, 42), (n, 2)))
    counts = np.bincount(np.asarray(draw(logits, rows, positions, 0).tokens), minlength=4) / n
    np.testing.assert_allclose(counts, [0, 0.5 / 0.8, 0, 0.3 / 0.8], atol=0.015)
    # top_k = 1 at any temperature is the argmax
    rows = rows_for([SamplingParams(temperature=2.0, top_k=1)] * n, keys=np.broadcast_to(request_key(0, 0, 1), (n, 2)))
    assert set(np.asarray(draw(logits, rows, positions, 0).tokens).tolist()) == {1}


def test_greedy_and_sampled_rows_in_one_batch():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)).astype(np.float32))
    params = [SamplingParams(temperature=t) for t in (0, 1.0, 0, 2.0, 0, 0.5)]
    rows = rows_for(params, vocab=50)
    out = sample(logits, rows, jnp.zeros(6, jnp.int32))
    argmax = np.argmax(np.asarray(logits), -1)
    np.testing.assert_array_equal(np.asarray(out.tokens)[[0, 2, 4]], argmax[[0, 2, 4]])
    # a sampled row draws the same token whatever the other rows are
    alone = sample(logits[1:2], rows_for(params[1:2], vocab=50, keys=np.asarray(rows.keys)[1:2]), jnp.zeros(1, jnp.int32))
    assert int(alone.tokens[0]) == int(out.tokens[1])


# ----------------------------------------------------------------------------------- NumPy references
def _np_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM 0.33 apply_penalties for one row, in NumPy."""
    logits = logits.astype(np.float64).copy()
    vocab = logits.shape[0]
    counts = np.bincount(np.asarray(output, np.int64), minlength=vocab)
    seen = np.zeros(vocab, bool)
    seen[list(prompt)] = True
    seen |= counts > 0
    for t in range(vocab):
        if seen[t]:
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    return logits - frequency * counts - presence * (counts > 0)


def test_penalties_match_vllms_formula():
    rng = np.random.default_rng(1)
    vocab = 12
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 3
    cases = [dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
             dict(presence_penalty=-1.0, frequency_penalty=2.0, repetition_penalty=0.7),
             dict()]  # a row without penalties in a batch that has them
    prompts = [[1, 2, 2, 5], [0, 11], [3]]
    outputs = [[5, 5, 7, 1], [4, 4, 4], [3, 3]]
    params = [SamplingParams(**c) for c in cases]
    rows = rows_for(params, prompts, outputs, vocab=vocab)
    got = np.asarray(apply_penalties(jnp.asarray(logits), rows))
    for i, (c, p, o) in enumerate(zip(cases, prompts, outputs)):
        want = logits[i] if not c else _np_penalties(logits[i], p, o, c["presence_penalty"], c["frequency_penalty"],
                                                     c["repetition_penalty"])
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    # without any penalty in the batch, no [B, V] arrays are built at all
    assert rows_for([SamplingParams()] * 2, vocab=vocab).counts is None


def test_greedy_takes_the_argmax_after_penalties():
    logits = np.array([[0.0, 3.0, 2.9, 1.0]], np.float32)
    sp = SamplingParams(temperature=0, presence_penalty=0.5)
    out = sample(jnp.asarray(logits), rows_for([sp], outputs=[[1]]), jnp.asarray([3]))
    assert int(out.tokens[0]) == 2  # 3.0 - 0.5 < 2.9
    # counts grow as the decode loop appends tokens
    rows = rows_for([sp], outputs=[[1]]).add_tokens(jnp.asarray([2]), jnp.asarray([True]))
    assert np.asarray(rows.counts).tolist() == [[0, 1, 1, 0]]
    assert int(sample(jnp.asarray(logits), rows, jnp.asarray([4])).tokens[0]) == 1  # both penalized now


def test_min_tokens_bans_every_stop_token_until_reached():
    # vLLM's all_stop_token_ids: stop_token_ids and the EOS ids, even with ignore_eos
    logits = np.array([[5.0, 1.0, 4.0, 0.0]] * 3, np.float32)
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)] * 3
    rows = rows_for(params, prompts=[[1, 1, 1]] * 3, eos=[0])
    positions = jnp.asarray([3, 4, 5])  # outputs of 0, 1 and 2 tokens so far
    masked = np.asarray(mask_min_tokens(jnp.asarray(logits), rows, positions))
    assert np.isneginf(masked[:2, [0, 2]]).all() and (masked[2] == logits[2]).all()
    assert np.asarray(sample(jnp.asarray(logits), rows, positions).tokens).tolist() == [1, 1, 0]
    assert SamplingParams(min_tokens=0).banned_until_min_tokens([0]) == frozenset()


def test_logprobs_ranks_and_top_k_match_numpy():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 30)).astype(np.float32)
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie at the top
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    out = jax.device_get(sample(jnp.asarray(logits), rows_for(params, vocab=30), jnp.arange(4, dtype=jnp.int32), 5))
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for i in range(4):
        t = int(out.tokens[i])
        np.testing.assert_allclose(out.logprobs[i], raw[i, t], rtol=1e-5)
        assert out.ranks[i] == int((raw[i] >= raw[i, t]).sum())  # vLLM counts >=: ties share the worse rank
        np.testing.assert_allclose(np.sort(out.top_logprobs[i])[::-1], np.sort(raw[i])[::-1][:5], rtol=1e-5)
        assert set(out.top_ids[i].tolist()) == set(np.argsort(-raw[i], kind="stable")[:5].tolist())


# ----------------------------------------------------------------------------------- SamplingParams
def test_defaults_are_vllms():
    # vLLM 0.33 vllm/sampling_params.py field defaults, read from its source
    # (stop, stop_token_ids and bad_words None, made [] by vLLM's __post_init__)
    vllm = dict(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0, top_p=1.0,
                top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False, max_tokens=16,
                min_tokens=0, logprobs=None, prompt_logprobs=None, detokenize=True, skip_special_tokens=True,
                spaces_between_special_tokens=True, include_stop_str_in_output=False,
                output_kind=RequestOutputKind.CUMULATIVE, skip_clone=False, structured_outputs=None,
                logit_bias=None, allowed_token_ids=None,
                bad_words=[], _bad_words_token_ids=None, trace_decode_token_ids=None)
    sp = SamplingParams()
    assert {k: getattr(sp, k) for k in vllm} == vllm
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(vllm)  # vLLM's order
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_vllms_normalisations():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "a")).stop == ["a", "a"]  # vLLM keeps stop strings as given, in a list
    assert SamplingParams(stop_token_ids=(3, 3, 1)).stop_token_ids == [3, 1]
    assert SamplingParams(bad_words=("x", "y", "x")).bad_words == ["x", "y"]
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(temperature=1e-3).temperature == 1e-2  # vLLM's _MAX_TEMP floor
    greedy = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)
    assert dataclasses.replace(SamplingParams(n=3, seed=1), n=1, seed=2) == SamplingParams(seed=2)


@pytest.mark.parametrize("kw, message", [
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),  # vLLM's words where vLLM has the rule
    (dict(max_tokens=2.5), "max_tokens must be an integer in [1, 2147483647], got 2.5"),
    (dict(temperature=-1), "temperature must be non-negative, got -1."),
    (dict(temperature=2.5), "temperature must be in [0, 2], got 2.5."),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan."),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(presence_penalty=3), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number, got inf."),
    (dict(seed=-3), "seed must be an integer in [0, 4294967295]"),
    (dict(seed=2**32), "seed must be an integer in [0, 4294967295]"),  # JAX keeps 32 bits: it would alias seed 0
    (dict(top_k=2**40), "top_k must be an integer in [-1, 2147483647]"),
    (dict(stop_token_ids=[2**70]), "a stop token id must be an integer in [0, 2147483647]"),
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(n=2, temperature=0), "n must be 1 when using greedy sampling, got 2."),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be less than or equal to max_tokens=10, got 20."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(stop=["a", ""]), "stop cannot contain an empty string."),
    (dict(stop=[3]), "stop must be a non-empty string or a list of them"),
    (dict(stop=["x"], detokenize=False),
     "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."),
    (dict(stop_token_ids=[1, -2]), "a stop token id must be an integer in [0, 2147483647], got -2"),
    (dict(stop_token_ids="12"), "stop_token_ids must be a sequence of token ids"),
    (dict(ignore_eos=1), "ignore_eos must be True or False"),
    (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2."),
    (dict(prompt_logprobs=-5), "prompt_logprobs must be non-negative or -1, got -5."),
    (dict(logprobs=2**40), "logprobs must be an integer in [-1, 2147483647]"),  # kvjax's: int32 ids
    (dict(skip_special_tokens=False, spaces_between_special_tokens=False),
     "spaces_between_special_tokens=False with skip_special_tokens=False is not implemented"),
    (dict(spaces_between_special_tokens=0), "spaces_between_special_tokens must be True or False"),
    (dict(structured_outputs={"regex": "a+", "choice": ["a"]}),
     "You can only use one kind of structured outputs constraint but multiple are specified"),
    (dict(structured_outputs={"regexp": "a+"}), "structured_outputs has no option 'regexp'"),
    (dict(logits_processors=[print]), "SamplingParams(logits_processors=...): custom logits processors are not"),
    (dict(stream_interval=2), "SamplingParams(stream_interval=...): streaming outputs are not implemented"),
    (dict(temprature=0.5), "SamplingParams has no parameter 'temprature'"),
])
def test_sampling_params_refuse_bad_values(kw, message):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_stop_ids_follow_ignore_eos():
    assert SamplingParams(stop_token_ids=[7]).stop_ids([2]) == {2, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).stop_ids([2]) == {7}
