"""The sampler's logit_bias, allowed_token_ids and bad words, in vLLM 0.33's order, against NumPy.

`_np_process` is vLLM 0.33's `Sampler.apply_logits_processors` for one row, written here in NumPy
from its source (`v1/sample/sampler.py`: allowed-token mask, `ops/bad_words.py`, then the
built-in processors in `BUILTIN_LOGITS_PROCESSORS` order, MinTokens then LogitBias, then
`apply_penalties`); the order cases are worked out by hand. The static-shape test compares the
jaxpr of a step without these features with the sampler as it was before them (`_old_*`, copied
here from kvjax.engine.sampling before the change), so such a step compiles the same program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import _np_penalties, rows_for

from kvjax.engine.sampling import (SAMPLING_EPS, SamplingParams, SamplingParamsError, SamplingRows, filter_mask,
                                   process_logits, sample)


def with_words(sp: SamplingParams, words) -> SamplingParams:
    """sp with bad words already tokenized (what update_from_tokenizer leaves)."""
    sp._bad_words_token_ids = [list(w) for w in words]
    sp.bad_words = [f"w{i}" for i in range(len(words))]
    return sp


def _np_process(logits, sp: SamplingParams, prompt, output, eos) -> np.ndarray:
    """vLLM 0.33's logits processing for one row, before temperature (see the module docstring)."""
    x = logits.astype(np.float64).copy()
    if sp.allowed_token_ids:
        masked = np.ones(x.shape, bool)
        masked[sp.allowed_token_ids] = False
        x[masked] = -np.inf
    for word in sp.bad_words_token_ids or []:  # _apply_bad_words_single_batch
        if len(word) > len(output) + 1:
            continue
        prefix = list(output[len(output) - (len(word) - 1):]) if len(word) > 1 else []
        if prefix == list(word[:-1]):
            x[word[-1]] = -np.inf
    if sp.min_tokens and len(output) < sp.min_tokens:  # MinTokensLogitsProcessor: all_stop_token_ids
        x[sorted(set(sp.stop_token_ids) | set(eos))] = -np.inf
    for token, bias in (sp.logit_bias or {}).items():  # LogitBiasLogitsProcessor
        x[token] += bias
    if sp.has_penalties:
        x = _np_penalties(x, prompt, output, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
    return x


def _positions(prompts, outputs):
    return jnp.asarray([len(p) + len(o) for p, o in zip(prompts, outputs)], jnp.int32)


def test_every_feature_matches_numpy():
    rng = np.random.default_rng(3)
    vocab, eos = 16, [15]
    cases = [
        SamplingParams(logit_bias={1: 2.5, 4: -3.0, 9: 100}),
        SamplingParams(allowed_token_ids=[2, 3, 15, 11]),
        with_words(SamplingParams(), [[5], [2, 7], [1, 2, 3], [6, 8]]),
        SamplingParams(min_tokens=3, logit_bias={15: 50.0, 0: 1.0}, presence_penalty=0.5, repetition_penalty=1.4,
                       allowed_token_ids=[0, 1, 2, 15]),
        with_words(SamplingParams(logit_bias={7: 5.0}, frequency_penalty=0.3), [[2, 7], [4]]),
        SamplingParams(),  # a row with none of them in a batch that has all
        None,  # an empty row
    ]
    prompts = [[3, 1], [4], [0, 6, 1, 2], [1, 1], [9, 2], [5], []]
    outputs = [[1, 1], [], [9, 6, 1, 2], [2], [5, 2], [4], []]
    logits = rng.normal(size=(len(cases), vocab)).astype(np.float32) * 3
    rows = rows_for(cases, prompts, outputs, eos=eos, vocab=vocab,
                    keys=np.zeros((len(cases), 2), np.uint32))
    got = np.asarray(process_logits(jnp.asarray(logits), rows, _positions(prompts, outputs)))
    for i, sp in enumerate(cases):
        want = logits[i] if sp is None else _np_process(logits[i], sp, prompts[i], outputs[i], eos)
        np.testing.assert_array_equal(np.isneginf(got[i]), np.isneginf(want), err_msg=f"row {i}")
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
    # the features did something: row 2's output ends with 1 2, so 7 and 3 (and always 5) are banned, not 8
    assert np.isneginf(got[2]).nonzero()[0].tolist() == [3, 5, 7]


def test_order_worked_by_hand():
    eos = [0]
    # logit_bias cannot lift min_tokens' ban: -inf + 100 stays -inf; token 2 wins
    sp = SamplingParams(temperature=0, min_tokens=1, logit_bias={0: 100})
    out = sample(jnp.asarray([[5.0, 1.0, 4.0, 0.0]]), rows_for([sp], eos=eos), jnp.asarray([1]))
    assert int(out.tokens[0]) == 2
    # the bias comes before the repetition penalty: (2 + 2) / 2 = 2 < 2.5 (after it, 2 / 2 + 2 = 3 would win)
    sp = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={1: 2.0})
    out = sample(jnp.asarray([[0.0, 2.0, 2.5, 0.0]]), rows_for([sp], prompts=[[1]]), jnp.asarray([1]))
    assert int(out.tokens[0]) == 2
    # allowed ids first, then bad words: of {1, 2} only 1 is left, though 3 is the most likely
    sp = with_words(SamplingParams(temperature=0, allowed_token_ids=[1, 2]), [[2]])
    out = sample(jnp.asarray([[0.0, 1.0, 2.0, 3.0]]), rows_for([sp]), jnp.asarray([1]), 2)
    assert int(out.tokens[0]) == 1
    # the reported log-probabilities are the raw model's, before any of them (vLLM's raw_logprobs)
    raw = np.log(np.exp([0.0, 1.0, 2.0, 3.0]) / np.exp([0.0, 1.0, 2.0, 3.0]).sum())
    np.testing.assert_allclose(float(out.logprobs[0]), raw[1], rtol=1e-5)
    assert int(out.ranks[0]) == 3 and np.asarray(out.top_ids[0]).tolist() == [3, 2]
    # allowed ids with min_tokens: the allowed EOS is banned while short, so 3
    sp = SamplingParams(temperature=0, allowed_token_ids=[0, 3], min_tokens=2)
    out = sample(jnp.asarray([[9.0, 8.0, 7.0, 1.0]]), rows_for([sp], eos=eos), jnp.asarray([1]))
    assert int(out.tokens[0]) == 3


def test_bias_applies_before_temperature():
    # logits [0, 0] + bias ln 3 on token 1, then T = 2: p1 = 3^(1/2) / (1 + 3^(1/2)) = 0.634
    # (a bias after the temperature would give 0.75)
    n = 20000
    sp = SamplingParams(temperature=2.0, seed=5, logit_bias={1: float(np.log(3.0))})
    keys = np.broadcast_to(rows_for([sp], vocab=2).keys[0], (n, 2))
    rows = rows_for([sp] * n, vocab=2, keys=np.asarray(keys))
    tokens = jax.jit(sample, static_argnums=3)(jnp.zeros((n, 2)), rows, jnp.arange(n, dtype=jnp.int32), 0).tokens
    assert abs(float(np.mean(np.asarray(tokens))) - np.sqrt(3) / (1 + np.sqrt(3))) < 0.015


def test_bad_words_count_output_tokens_only():
    # vLLM passes the output tokens alone: a prompt ending with a word's prefix bans nothing
    logits = jnp.asarray([[0.0, 1.0, 3.0, 2.0]] * 3)
    sp = with_words(SamplingParams(temperature=0), [[3, 2], [1, 1, 2]])
    rows = rows_for([sp] * 3, prompts=[[3], [1, 3], [0]], outputs=[[], [3], [1, 1]], keys=np.zeros((3, 2), np.uint32))
    assert np.asarray(sample(logits, rows, jnp.asarray([1, 3, 3])).tokens).tolist() == [2, 3, 3]


def test_device_loop_keeps_bad_words_and_penalties_right():
    """Rows built once and carried through a lax.scan with add_tokens sample what rows rebuilt on
    the host every step sample, and what NumPy's greedy loop samples."""
    rng = np.random.default_rng(4)
    vocab, steps = 5, 12
    params = [with_words(SamplingParams(temperature=0), [[1, 1], [2, 1], [2, 2, 2]]),
              with_words(SamplingParams(temperature=0, presence_penalty=0.2), [[1, 2], [2, 2], [0, 3, 4]]),
              with_words(SamplingParams(temperature=0), [[4], [3, 3, 3, 3]]),
              SamplingParams(temperature=0, logit_bias={2: 0.5})]
    b = len(params)
    prompts = [[2, 2], [1, 2], [3], [0]]
    logits = rng.normal(size=(steps, b, vocab)).astype(np.float32)
    logits[:, :, 2:4] += 1.0  # 2 and 3 are likely, so the bad words come up
    logits[:, 0] = [0.0, 4.0, 3.0, 2.0, 1.0]  # by hand below

    def loop(rows, logits):
        def body(rows, step):
            out = sample(logits[step], rows, jnp.full(b, 10, jnp.int32) + step)
            return rows.add_tokens(out.tokens, jnp.ones(b, bool)), out.tokens
        return jax.lax.scan(body, rows, jnp.arange(steps))[1]

    device = np.asarray(jax.jit(loop)(rows_for(params, prompts, vocab=vocab), jnp.asarray(logits))).T.tolist()
    host, ref = [[] for _ in params], [[] for _ in params]
    for step in range(steps):
        rows = rows_for(params, prompts, [list(o) for o in host], vocab=vocab)
        tokens = np.asarray(sample(jnp.asarray(logits[step]), rows, jnp.full(b, 10, jnp.int32) + step).tokens)
        for i in range(b):
            host[i].append(int(tokens[i]))
            ref[i].append(int(np.argmax(_np_process(logits[step, i], params[i], prompts[i], ref[i], ()))))
    assert device == host == ref
    # row 0 by hand: 1; then [1, 1] bans 1: 2; [2, 1] bans 1: 2; now [2, 1] and [2, 2, 2] ban 1 and 2: 3; again
    assert device[0] == [1, 2, 2, 3] * 3
    assert [int(t) for t in np.argmax(logits[:, 2], axis=-1)] != ref[2]  # the bans changed row 2's output


def test_unused_features_build_nothing_and_widths_are_powers_of_two():
    rows = rows_for([SamplingParams(), None], keys=np.zeros((2, 2), np.uint32))
    assert (rows.bias_ids, rows.bias_values, rows.allowed_ids, rows.bad_ids, rows.recent) == (None,) * 5
    rows = rows_for([SamplingParams(logit_bias={1: 1.0, 2: 2.0, 3: 3.0}), SamplingParams(allowed_token_ids=[0, 1, 2]),
                     with_words(SamplingParams(), [[1], [1, 2, 3], [0]])], vocab=8, keys=np.zeros((3, 2), np.uint32))
    assert rows.bias_ids.shape == rows.bias_values.shape == (3, 4) and rows.allowed_ids.shape == (3, 4)
    assert rows.bad_ids.shape == (3, 4, 4) and rows.recent.shape == (3, 3)
    with pytest.raises(SamplingParamsError, match=r"bad_words need update_from_tokenizer\(tokenizer\)"):
        rows_for([SamplingParams(bad_words=["x"])])


# ----------------------------------------------------------------------------------- the same program as before
def _old_apply_penalties(logits, rows):
    if rows.counts is None:
        return logits
    seen = rows.prompt_mask | (rows.counts > 0)
    penalty = jnp.where(seen, rows.repetition[:, None], 1.0)
    logits = logits * jnp.where(logits > 0, 1.0 / penalty, penalty)
    logits = logits - rows.frequency[:, None] * rows.counts
    return logits - rows.presence[:, None] * (rows.counts > 0)


def _old_mask_min_tokens(logits, rows, positions):
    b = logits.shape[0]
    short = (positions < rows.min_position)[:, None] & (rows.banned >= 0)
    at = jnp.where(short, rows.banned, logits.shape[1])
    return logits.at[jnp.arange(b)[:, None], at].set(-jnp.inf, mode="drop")


def _old_sample(logits, rows, positions, num_logprobs=0):
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    logits = _old_apply_penalties(_old_mask_min_tokens(logits, rows, positions), rows)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = rows.temperature >= SAMPLING_EPS

    def draw(logits):
        scaled = logits / jnp.where(sampling, rows.temperature, 1.0)[:, None]
        if rows.any_filtered:
            scaled = jnp.where(filter_mask(scaled, rows.top_k, rows.top_p, rows.min_p), scaled, -jnp.inf)
        row_keys = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.wrap_key_data(k), p))(rows.keys, positions)
        return jax.vmap(jax.random.categorical)(row_keys, scaled).astype(jnp.int32)

    drawn = draw(logits) if rows.any_drawn else greedy
    tokens = jnp.where(sampling, drawn, greedy)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)
    ranks = (raw >= chosen).sum(axis=-1).astype(jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
    return tokens, chosen[:, 0], ranks, top_ids.astype(jnp.int32), top_logprobs


def _old_add_tokens(rows, tokens, mask):
    if rows.counts is None:
        return rows
    counts = jnp.asarray(rows.counts)
    return rows.replace(counts=counts.at[jnp.arange(tokens.shape[0]), tokens].add(jnp.asarray(mask, jnp.int32)))


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0), SamplingParams(top_p=0.9, min_tokens=2, stop_token_ids=[3]), None],
    [SamplingParams(presence_penalty=0.5), SamplingParams(temperature=0, repetition_penalty=1.2)],
], ids=["plain", "penalties"])
def test_a_step_without_the_features_traces_the_old_program(params):
    b, vocab = len(params), 32
    rows = rows_for(params, vocab=vocab, eos=[1], keys=np.zeros((b, 2), np.uint32))
    logits, positions = jnp.zeros((b, vocab)), jnp.ones(b, jnp.int32)
    for j in (0, 4):
        new = jax.make_jaxpr(functools.partial(sample, num_logprobs=j))(logits, rows, positions)
        old = jax.make_jaxpr(functools.partial(_old_sample, num_logprobs=j))(logits, rows, positions)
        assert str(new) == str(old)
    tokens, mask = jnp.zeros(b, jnp.int32), jnp.ones(b, bool)
    assert str(jax.make_jaxpr(SamplingRows.add_tokens)(rows, tokens, mask)) == \
        str(jax.make_jaxpr(_old_add_tokens)(rows, tokens, mask))
