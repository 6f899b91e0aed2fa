"""Beam search (vLLM's LLM.beam_search on kvjax's generate): against a plain NumPy beam search over
teacher-forced log-probabilities (LLM.score_windows, an independent path through the same KV
format), and hand-worked cases of the score's length penalty, EOS and abort handling on a fake LLM
whose log-probabilities are a table."""
from types import SimpleNamespace

import numpy as np
import pytest

from kvjax import LLM, LLMError, Logprob
from kvjax.engine.beam_search import BeamSearchParams, beam_search, get_beam_search_score
from kvjax.engine.sampling import SamplingParamsError
from kvjax.models.hub import load_model

EOS = 32  # " " in small-gqa's byte vocabulary: its code continues with spaces, so beams finish early
PROMPTS = ["def fib(n):", "The quick brown"]
PAD = 32  # reference windows padded to one length (causal: the padding changes nothing before it)
# f32 log-probabilities from two paths (a cached prefix plus a chunk vs a fresh prefill of the
# window): a beam's sum of at most 5 of them differed by at most 6.2e-6 here (CPU, XLA -O0).
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm():
    model = load_model("small-gqa").replace(eos_token_ids=(EOS,))
    return LLM(model, block_size=16, num_gpu_blocks_override=256, max_num_seqs=8, seed=0, use_tqdm_on_load=False)


def _next_logprobs(llm, seqs: list[list[int]], rows: int) -> np.ndarray:
    """f64[len(seqs), V]: log p(next token | seq) for each seq, from score_windows."""
    windows = np.zeros((rows, PAD), np.int32)  # always [rows, PAD]: one compiled program
    for i, s in enumerate(seqs):
        windows[i, :len(s)] = s
    lp = llm.score_windows(windows)  # [rows, PAD, V]: row s predicts token s + 1
    return lp[np.arange(len(seqs)), [len(s) - 1 for s in seqs]].astype(np.float64)


def numpy_beam_search(llm, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
                      eos: tuple[int, ...]) -> list[tuple[list[int], float]]:
    """[(generated tokens, cumulative log-prob)] of the best `width` beams, best first: each step
    extends every live beam by its 2 × width most likely tokens; an EOS ends a beam; the width
    best by cumulative log-prob live on (they all have the same length, so that is the score's
    order); at the end finished and live beams are ranked by cum / length ** length_penalty."""
    seqs, cum = [list(prompt)], np.zeros(1)
    finished = []  # (generated tokens, cum), in the order they finished
    for _ in range(max_tokens):
        if not seqs:
            break
        lp = _next_logprobs(llm, seqs, width)  # [B, V]
        top = np.argsort(-lp, axis=1, kind="stable")[:, :2 * width]  # [B, 2k], most likely first
        cand = cum[:, None] + np.take_along_axis(lp, top, axis=1)  # [B, 2k]
        ends = np.isin(top, eos)
        finished += [(seqs[b][len(prompt):] + [int(top[b, j])], cand[b, j]) for b, j in zip(*np.nonzero(ends))]
        b, j = np.nonzero(~ends)  # row-major: beam by beam, each's candidates most likely first
        keep = np.argsort(-cand[b, j], kind="stable")[:width]
        seqs, cum = [seqs[b[k]] + [int(top[b[k], j[k]])] for k in keep], cand[b[keep], j[keep]]
    beams = finished + [(s[len(prompt):], c) for s, c in zip(seqs, cum)]
    scores = np.array([c / max(len(t), 1) ** length_penalty for t, c in beams])
    return [(beams[i][0], float(beams[i][1])) for i in np.argsort(-scores, kind="stable")[:width]]


@pytest.mark.parametrize("width, max_tokens, length_penalty, ignore_eos", [
    (2, 5, 1.0, False), pytest.param(3, 4, 0.0, True, marks=pytest.mark.slow), (2, 5, -0.5, False)])
def test_matches_a_numpy_beam_search_over_score_windows(llm, width, max_tokens, length_penalty, ignore_eos):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty,
                              ignore_eos=ignore_eos)
    outs = beam_search(llm, PROMPTS, params)
    tokenizer = llm.get_tokenizer()
    eos_seen = 0
    for text, out in zip(PROMPTS, outs):
        prompt = tokenizer.encode(text)
        want = numpy_beam_search(llm, prompt, width, max_tokens, length_penalty, () if ignore_eos else (EOS,))
        got = [(s.tokens[len(prompt):], s.cum_logprob) for s in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in want], text
        np.testing.assert_allclose([c for _, c in got], [c for _, c in want], rtol=0, atol=ATOL)
        for s in out.sequences:
            assert s.tokens[:len(prompt)] == prompt and s.text == tokenizer.decode(s.tokens)
            assert len(s.logprobs) == len(s.tokens) - len(prompt)  # one dict per generated token
            assert s.cum_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(s.logprobs, s.tokens[len(prompt):])))
            generated = s.tokens[len(prompt):]
            eos_seen += EOS in generated
            if ignore_eos:  # EOS is an ordinary token: every beam runs max_tokens
                assert len(generated) == max_tokens
            else:  # an EOS ends its beam
                assert EOS not in generated[:-1]
    assert eos_seen > 0  # the prompts reach EOS: the rule above was exercised


def test_concurrency_limit_changes_nothing(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    together = beam_search(llm, PROMPTS, params)
    one_at_a_time = beam_search(llm, PROMPTS, params, concurrency_limit=1)
    for a, b in zip(together, one_at_a_time):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        np.testing.assert_allclose([s.cum_logprob for s in a.sequences], [s.cum_logprob for s in b.sequences],
                                   rtol=0, atol=ATOL)


# ----------------------------------------------------------------------------------- hand-worked
def test_score_is_the_cumulative_logprob_over_length_to_the_penalty():
    assert get_beam_search_score(4, -2.0, 1.0) == -0.5  # the mean log-prob per token
    assert get_beam_search_score(4, -2.0, 0.0) == -2.0  # the cumulative log-prob alone
    assert get_beam_search_score(4, -2.0, 2.0) == -0.125
    assert get_beam_search_score(2, -3.0, -1.0) == -6.0  # a negative penalty favours short beams
    assert get_beam_search_score(0, -1.5, 1.0) == -1.5  # no token generated (an aborted beam): length 1


class FakeLLM:
    """An LLM whose next-token log-probabilities are table[prefix] ({token: logprob}, in the
    order kvjax reports them); prefixes in `abort` are aborted. Records each generate call."""

    def __init__(self, table, eos, abort=()):
        self.table, self.abort, self.calls = table, set(abort), []
        self.model = SimpleNamespace(eos_token_ids=tuple(eos))

    def get_tokenizer(self):
        return SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))

    def generate(self, prompts, params, use_tqdm=True, priority=None):
        self.calls.append(([p["prompt_token_ids"] for p in prompts], params, use_tqdm, priority))
        outs = []
        for p in prompts:
            ids = tuple(p["prompt_token_ids"])
            if ids not in self.table and ids not in self.abort:  # kvjax's refusal of one request
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(logprobs=None, finish_reason=None)],
                                            error="prompt too long"))
                continue
            lps = None if ids in self.abort else [
                {t: Logprob(lp, r) for r, (t, lp) in enumerate(self.table[ids].items(), 1)}]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(logprobs=lps, finish_reason=(
                "abort" if ids in self.abort else "length"))], error=None))
        return outs


# Prompt [1], EOS 0. Each step one ordinary token and EOS; the finished beams and the live one:
#   A = [1, 0]        cum -1.0  1 token     C = [1, 5, 6, 0]  cum -4.1  3 tokens
#   B = [1, 5, 0]     cum -2.5  2 tokens    D = [1, 5, 6, 7]  cum -1.8  3 tokens (live at the end)
TABLE = {(1,): {5: -0.5, 0: -1.0}, (1, 5): {6: -0.6, 0: -2.0}, (1, 5, 6): {7: -0.7, 0: -3.0}}
A, B, C, D = [1, 0], [1, 5, 0], [1, 5, 6, 0], [1, 5, 6, 7]


@pytest.mark.parametrize("length_penalty, best", [
    (1.0, [D, A, B, C]),  # scores -0.6, -1.0, -1.25, -1.367
    (0.0, [A, D, B, C]),  # -1.0, -1.8, -2.5, -4.1
    (-1.0, [A, B, D, C]),  # -1.0, -5.0, -5.4, -12.3
])
def test_finished_beams_compete_by_length_penalised_score(length_penalty, best):
    fake = FakeLLM(TABLE, eos=[0])
    [out] = beam_search(fake, [[1]], BeamSearchParams(beam_width=4, max_tokens=3, length_penalty=length_penalty))
    assert [s.tokens for s in out.sequences] == best  # EOS kept in tokens
    cums = {tuple(A): -1.0, tuple(B): -2.5, tuple(C): -4.1, tuple(D): -1.8}
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([cums[tuple(t)] for t in best])
    assert [s.text for s in out.sequences] == [" ".join(map(str, t)) for t in best]
    assert [len(s.logprobs) for s in out.sequences] == [len(t) - 1 for t in best]
    # One request per live beam per step, each one token with 2 × beam_width log-probabilities.
    assert [c[0] for c in fake.calls] == [[[1]], [[1, 5]], [[1, 5, 6]]]
    params = fake.calls[0][1]
    assert (params.logprobs, params.max_tokens, params.temperature, fake.calls[0][2]) == (8, 1, 0.0, False)
    [top] = beam_search(fake, [[1]], BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=length_penalty))
    assert [s.tokens for s in top.sequences] == [best[0]]


def test_ignore_eos_makes_eos_an_ordinary_token():
    fake = FakeLLM(TABLE, eos=[0])
    [out] = beam_search(fake, [[1]], BeamSearchParams(beam_width=1, max_tokens=3, ignore_eos=True))
    # step 1: [1, 5] -0.5 beats [1, 0] -1.0; step 2: [1, 5, 6] -1.1 beats [1, 5, 0] -2.5; step 3: D
    assert [(s.tokens, s.finish_reason) for s in out.sequences] == [(D, None)]
    assert out.sequences[0].cum_logprob == pytest.approx(-1.8)


def test_search_ends_when_every_beam_has_finished():
    fake = FakeLLM({(1,): {9: -0.2, 0: -0.1}}, eos=[0, 9])  # every EOS id ends a beam
    [out] = beam_search(fake, [[1]], BeamSearchParams(beam_width=2, max_tokens=5))
    assert [s.tokens for s in out.sequences] == [[1, 0], [1, 9]]
    assert len(fake.calls) == 1  # no live beam after step 1: no second step


def test_an_aborted_prompt_keeps_its_beams_and_the_others_go_on():
    table = {**TABLE, (2,): {8: -0.3, 0: -0.4}}
    fake = FakeLLM(table, eos=[0], abort=[(2, 8)])
    aborted, normal = beam_search(fake, [[2], [1]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert [(s.tokens, s.finish_reason) for s in aborted.sequences] == [([2, 8], "abort"), ([2, 0], None)]
    assert [s.tokens for s in normal.sequences] == [D, A]
    assert [c[0] for c in fake.calls] == [[[2], [1]], [[2, 8], [1, 5]], [[1, 5, 6]]]


def test_a_refused_beam_fails_the_search_naming_the_step():
    with pytest.raises(LLMError, match=r"step 4 of 5: a beam of 4 tokens was refused: prompt too long"):
        beam_search(FakeLLM(TABLE, eos=[0]), [[1]], BeamSearchParams(beam_width=1, max_tokens=5))

    class Raising(FakeLLM):  # an engine that raises for the refused request, as vLLM's does
        def generate(self, prompts, params, use_tqdm=True, priority=None):
            if len(prompts[0]["prompt_token_ids"]) == 3:
                raise LLMError("prompt 0: prompt has 3 tokens; the model's max length is 3 tokens")
            return super().generate(prompts, params, use_tqdm, priority)

    with pytest.raises(LLMError, match=r"beam search step 3 of 5 \(one request per beam\): prompt 0: prompt has 3"):
        beam_search(Raising(TABLE, eos=[0]), [[1]], BeamSearchParams(beam_width=1, max_tokens=5))


def test_priorities_go_to_every_beam_of_their_prompt_and_a_limited_search_has_no_bar():
    fake = FakeLLM({**TABLE, (2,): {8: -0.3, 0: -0.4}, (2, 8): {0: -0.1}}, eos=[0])
    beam_search(fake, [[2], [1]], BeamSearchParams(beam_width=2, max_tokens=2), priority=[3, 4])
    assert [(c[0], c[3]) for c in fake.calls] == [([[2], [1]], [3, 4]), ([[2, 8], [1, 5]], [3, 4])]
    with pytest.warns(UserWarning, match="Progress bar is not supported when using concurrency_limit"):
        beam_search(fake, [[1]], BeamSearchParams(beam_width=1, max_tokens=1), use_tqdm=True, concurrency_limit=1)
    with pytest.raises(LLMError, match="priority must be an int or one per prompt"):
        beam_search(fake, [[1]], BeamSearchParams(beam_width=1, max_tokens=1), priority=[1, 2])


def test_prompt_forms_and_refused_params():
    fake = FakeLLM({(1, 2): {0: -1.0}}, eos=[0])
    fake.get_tokenizer = lambda: SimpleNamespace(encode=lambda text: [1, 2], decode=lambda ids: "x")
    for prompt in ("ab", {"prompt": "ab"}, {"prompt_token_ids": [1, 2]}, [1, 2]):
        [out] = beam_search(fake, prompt, BeamSearchParams(beam_width=1, max_tokens=2))
        assert out.sequences[0].tokens == [1, 2, 0]
    assert out.sequences[0].orig_prompt == {"prompt_token_ids": [1, 2]}
    for bad in (dict(beam_width=0), dict(max_tokens=-1), dict(length_penalty=float("nan")), dict(temperature=-1.0),
                dict(ignore_eos=1), dict(structured_outputs={"json": {}}), dict(allowed_token_ids=[1]),
                dict(watermarking=True)):
        with pytest.raises(SamplingParamsError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
