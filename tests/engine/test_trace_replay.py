"""Trace replay as vLLM 0.33 has it (`LLM(..., enable_trace_replay=True)`,
`SamplingParams(trace_decode_token_ids=[...])`; vLLM's `v1/engine/input_processor.py`,
`sampling_params.py` `_validate_trace_replay` and `v1/worker/gpu/sample/trace_replay.py`): the engine
emits exactly the given tokens, and their log-probabilities, ranks and text are those of the real
distribution.

The reference is a teacher-forced score of prompt + trace (`LLM.score_windows`: one prefill of the
whole window into a fresh cache of the same KV format, no scheduler, no sampler): the forced token k's
log-probability is the score of trace[k] at position len(prompt) - 1 + k, its rank the number of
vocabulary entries scored at least as high (vLLM's rank), its text the tokenizer's decoding. The
engine decodes token by token through the paged cache, so the two agree to float32 rounding; ranks
are compared with that much slack. Also run through preemption (a pool too small for the batch),
prefix-cache hits, the multi-step device loop and every KV format; vLLM's refusals are checked word
for word, and its truncation at max_model_len worked out here.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvjax import LLM, SamplingParams
from kvjax.quant.kv_formats import KV_FORMATS

PROMPTS = ["def fib(n):", "The capital of France is", "import numpy as np\nx = np."]
TRACES = [[32, 32, 32, 32, 114, 101, 116, 117, 114, 110], [0, 255, 80, 97, 114, 105, 115, 46],
          [97, 114, 114, 97, 121, 40, 91, 49, 44, 50, 93, 41]]  # likely and unlikely bytes alike
TOL = 2e-4  # float32: a decode step and a whole-window prefill round differently
KV_TOL = 2e-3  # quantized or 16-bit pages: the same stored values, read back by kernels that round differently


@pytest.fixture(scope="module")
def llm():
    return LLM("small-gqa", enable_trace_replay=True, max_num_seqs=4, use_tqdm_on_load=False)


def reference(llm, prompt_ids: list[int], trace: list[int]):
    """(log-probabilities f32[len(trace)], f32[len(trace), V] the scores they come from) of trace after
    prompt_ids, teacher-forced."""
    window = np.array([prompt_ids + trace], np.int32)
    scores = llm.score_windows(window)[0, len(prompt_ids) - 1:len(prompt_ids) - 1 + len(trace)]
    return scores[np.arange(len(trace)), trace], scores


def check_replayed(llm, out, prompt_ids: list[int], trace: list[int], k: int, tol: float = TOL):
    """out (a CompletionOutput with logprobs=k) replayed trace exactly, with the teacher-forced log-probabilities,
    ranks, top-k and text (within tol)."""
    assert list(out.token_ids) == trace and out.finish_reason == "length"
    lps, scores = reference(llm, prompt_ids, trace)
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(trace)
    for j, (t, entry) in enumerate(zip(trace, out.logprobs)):
        chosen = entry[t]
        assert abs(chosen.logprob - lps[j]) < tol, (j, chosen.logprob, lps[j])
        assert (scores[j] > lps[j] + tol).sum() + 1 <= chosen.rank <= (scores[j] >= lps[j] - tol).sum()
        assert chosen.decoded_token == tok.decode([t])
        top = sorted(set(entry) - {t} | ({t} if chosen.rank <= k else set()), key=lambda i: -entry[i].logprob)
        assert len(entry) == k + (chosen.rank > k)  # the chosen token, then the k most likely
        assert np.allclose([entry[i].logprob for i in top], np.sort(scores[j])[::-1][:len(top)], atol=tol)
    assert abs(out.cumulative_logprob - float(lps.sum())) < tol * len(trace)


def test_the_forced_tokens_logprobs_ranks_and_text_are_a_teacher_forced_score(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, [SamplingParams(trace_decode_token_ids=t, logprobs=3, max_tokens=64) for t in TRACES],
                        use_tqdm=False)
    for prompt, trace, out in zip(PROMPTS, TRACES, outs):
        check_replayed(llm, out.outputs[0], tok.encode(prompt), trace, 3)


def test_nothing_ends_a_replay_early_and_max_tokens_cuts_it(llm):
    """vLLM's normalisation: EOS ignored, stop strings, stop token ids and min_tokens cleared; max_tokens becomes
    min(trace length, max_tokens), here vLLM's default 16 against a trace of 20."""
    trace = [101, 110, 100] * 6 + [10, 10]
    params = SamplingParams(trace_decode_token_ids=trace, stop=["nd"], stop_token_ids=[100], min_tokens=2,
                            temperature=0.7, seed=3)
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == trace[:16] and out.finish_reason == "length" and out.stop_reason is None
    assert params.stop == ["nd"] and params.max_tokens == 16  # the caller's params are not changed


def test_a_trace_is_cut_at_max_model_len():
    # vLLM: trace[:max(max_model_len - prompt_len, 1)]; a prompt of 15 bytes leaves 5 of max_model_len 20
    llm = LLM("small-gqa", enable_trace_replay=True, max_model_len=20, max_num_seqs=2, use_tqdm_on_load=False)
    trace = list(range(65, 75))
    outs = llm.generate(["a" * 15, "b" * 19], SamplingParams(trace_decode_token_ids=trace, max_tokens=None),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [trace[:5], trace[:1]]
    with pytest.raises(ValueError, match="prompt"):  # a prompt at max_model_len is refused before any replay
        llm.generate(["c" * 20], SamplingParams(trace_decode_token_ids=trace), use_tqdm=False)


def test_through_preemption_prefix_hits_and_the_device_loop():
    """Replays in a pool of 35 usable blocks of 4 tokens, 8 decode steps per device call: three that fit it
    whole (9 + 13 + 13 blocks), whose prompts the next call finds in the prefix cache, then six at once, which
    preempt one another (a preempted replay recomputes, its replayed tokens computed again from their positions)."""
    llm = LLM("small-gqa", enable_trace_replay=True, block_size=4, num_gpu_blocks_override=36, max_num_seqs=6,
              steps_per_call=8, use_tqdm_on_load=False)
    tok = llm.get_tokenizer()
    prompts = [p + " " * 9 for p in PROMPTS]
    traces = [t + t[:6] for t in TRACES]
    first = llm.generate(prompts, [SamplingParams(trace_decode_token_ids=t, logprobs=1) for t in traces],
                         use_tqdm=False)
    outs = llm.generate(prompts * 2, [SamplingParams(trace_decode_token_ids=t, logprobs=1) for t in traces * 2],
                        use_tqdm=False)
    assert first.summary.preemptions == 0 and outs.summary.preemptions > 0
    assert outs[0].num_cached_tokens == 16  # 4 of its prompt's 5 blocks (the last token is always computed)
    for prompt, trace, out in zip(prompts * 3, traces * 3, [*first, *outs]):
        check_replayed(llm, out.outputs[0], tok.encode(prompt), trace[:16], 1)


@pytest.mark.parametrize("kv_cache_dtype", [f if f == "fp8_e4m3" else pytest.param(f, marks=pytest.mark.slow)
                                            for f in KV_FORMATS])
def test_every_kv_format(kv_cache_dtype):
    # the teacher-forced score reads a cache of the same format: the quantized keys and values are the same
    llm = LLM("small-gqa", enable_trace_replay=True, kv_cache_dtype=kv_cache_dtype, max_num_seqs=4,
              use_tqdm_on_load=False)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS[:2], [SamplingParams(trace_decode_token_ids=t, logprobs=2) for t in TRACES[:2]],
                        use_tqdm=False)
    for prompt, trace, out in zip(PROMPTS, TRACES, outs):
        check_replayed(llm, out.outputs[0], tok.encode(prompt), trace, 2, TOL if kv_cache_dtype == "fp32" else KV_TOL)


@pytest.mark.parametrize("params, message", [  # vLLM 0.33's words (sampling_params.py _validate_trace_replay)
    (dict(trace_decode_token_ids=[]), "trace_decode_token_ids must be a non-empty list."),
    (dict(trace_decode_token_ids=[1], n=2), "trace_decode_token_ids requires n=1."),
    (dict(trace_decode_token_ids=[1, -2]), "trace_decode_token_ids must contain non-negative integers."),
    (dict(trace_decode_token_ids=[1, 2.5]), "trace_decode_token_ids must contain non-negative integers."),
    (dict(trace_decode_token_ids=[1], prompt_logprobs=1), "trace_decode_token_ids is not supported with prompt_logprobs."),
    (dict(trace_decode_token_ids=[1], bad_words=["ab"]), "trace_decode_token_ids is not supported with bad_words."),
    (dict(trace_decode_token_ids=[1], structured_outputs={"choice": ["a", "b"]}),
     "trace_decode_token_ids is not supported with structured outputs."),
    (dict(trace_decode_token_ids=[3, 256, 999]),
     "token_id(s) [256, 999] in trace_decode_token_ids contain out-of-vocab token ids. Vocabulary size: 256"),
])
def test_vllms_refusals_at_generate(llm, params, message):
    sp = SamplingParams(**params)  # as in vLLM, the constructor takes them: the input processor refuses
    with pytest.raises(ValueError) as e:
        llm.generate(["x"], sp, use_tqdm=False)
    assert str(e.value) == message


def test_refused_unless_the_engine_enables_it():
    llm = LLM("small-gqa", max_num_seqs=2, use_tqdm_on_load=False)
    with pytest.raises(ValueError) as e:
        llm.generate(["x"], SamplingParams(trace_decode_token_ids=[1, 2]), use_tqdm=False)
    assert str(e.value) == ("trace_decode_token_ids is set but trace replay is not enabled. Start the engine with "
                            "--enable-trace-replay to use it.")
