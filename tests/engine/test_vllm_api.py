"""A vLLM user's script against kvjax.LLM: vLLM's names, defaults, output shapes and engine lifetime.

References: vLLM 0.33's rules as written in its source (parallel sampling's seed + j, check_stop,
stop strings, Logprob ranks, generation_config defaults), worked out by hand here, and kvjax's
teacher-forced scoring (`score_windows`, a separate prefill of the whole window) as an
independent path for log-probabilities and penalties.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from kvjax import LLM, Logprob, SamplingParams
from kvjax.core.kv_cache_manager import request_blocks
from kvjax.engine.arg_utils import LLMError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEM = "You are a careful assistant who answers in Python. "  # 51 bytes: 3 full blocks of 16
GREEDY = dict(temperature=0)


@pytest.fixture(scope="module")
def llm():
    return LLM("small-gqa", block_size=16, num_gpu_blocks_override=96, max_num_seqs=4, seed=0)


@pytest.fixture
def fresh(llm):
    assert llm.reset_prefix_cache()
    return llm


def test_a_vllm_script_runs_unchanged():
    # the acceptance script, as a vLLM user writes it
    llm = LLM("small-gqa", kv_cache_dtype="fp8", block_size=16, gpu_memory_utilization=None,
              num_gpu_blocks_override=64, enable_prefix_caching=True, max_num_seqs=4, seed=0)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, seed=7, n=2, logprobs=1)
    outs = llm.generate(["def fib(n):", "import os"], params, use_tqdm=False)
    assert len(outs) == 2
    for out in outs:
        assert len(out.outputs) == 2 and [c.index for c in out.outputs] == [0, 1]
        assert out.num_cached_tokens >= 0 and out.metrics.num_generation_tokens == sum(
            len(c.token_ids) for c in out.outputs)
        for c in out.outputs:
            assert isinstance(c.text, str) and c.finish_reason in ("length", "stop")
            assert c.stop_reason is None or c.finish_reason == "stop"
            assert len(c.logprobs) == len(c.token_ids)
            for t, entry in zip(c.token_ids, c.logprobs):
                lp = entry[t].logprob
                assert isinstance(entry[t], Logprob) and entry[t].rank >= 1 and lp <= 0
                assert 1 <= len(entry) <= 2  # the sampled token and the most likely one (vLLM: logprobs + 1 at most)
                assert min(e.rank for e in entry.values()) == 1
            assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    assert SamplingParams().temperature == 1.0


def test_a_second_generate_hits_the_prefix_cache_until_reset(fresh):
    prompts = [SYSTEM + "def add(a, b):", SYSTEM + "class Stack:"]
    first = fresh.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    second = fresh.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    # call 1: the first prompt computes everything; the second hits the 3 shared system-prompt blocks
    assert [o.num_cached_tokens for o in first] == [0, 48]
    # call 2: each prompt hits its own full blocks, cached by call 1 ((len - 1) // 16 of them)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    assert second.summary.requests == 2 and second.summary.prefix_hit_tokens == sum(o.num_cached_tokens for o in second)
    assert fresh.reset_prefix_cache()
    third = fresh.generate(prompts[:1], SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    assert third[0].num_cached_tokens == 0 and third[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_reset_prefix_cache_is_refused_while_requests_run(fresh):
    answers = []
    fresh.generate([SYSTEM], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False,
                   progress=lambda n: answers.append(fresh.reset_prefix_cache()))
    # refused while the request runs; the last call comes after it finished, with nothing running
    assert answers == [False, False, True]


def test_reset_running_requests_preempts_them_and_they_recompute(fresh):
    # vLLM's reset_prefix_cache(reset_running_requests=True): every running request is preempted
    # (its blocks freed, recomputed when next scheduled), then the cache is reset
    params = SamplingParams(max_tokens=6, **GREEDY)
    want = fresh.generate([SYSTEM + "def add(a, b):"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert fresh.reset_prefix_cache()
    answers = []

    def reset(_):
        if not answers:
            answers.append(fresh.reset_prefix_cache(reset_running_requests=True))
            assert fresh.engine.scheduler.num_free_blocks() == fresh.num_blocks - 1, "a running request kept blocks"

    out = fresh.generate([SYSTEM + "def add(a, b):"], params, use_tqdm=False, progress=reset)
    assert answers == [True] and out[0].outputs[0].token_ids == want
    assert out.summary.preemptions == 1 and out[0].metrics.num_preemptions == 1


def test_parallel_samples_share_the_prompt_blocks_and_follow_seed_plus_j(fresh):
    prompt = SYSTEM[:40]  # 2 full blocks + 8 tokens
    held = []

    def look(_):
        state = fresh.engine.scheduler.state
        if not held:
            slots = [r.slot for r in fresh.engine.scheduler.running]
            tables = [request_blocks(state, s) for s in slots]
            held.append((tables, np.asarray(state.pool.ref_cnt)))

    outs = fresh.generate(prompt, SamplingParams(n=3, seed=5, max_tokens=4), use_tqdm=False, progress=look)
    tables, ref_cnt = held[0]
    assert len(tables) == 3 and tables[0][:2] == tables[1][:2] == tables[2][:2]  # one copy of the prompt's full blocks
    assert [int(ref_cnt[b]) for b in tables[0][:2]] == [3, 3]
    assert len({t[2] for t in tables}) == 3  # each sample its own last, partial block
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    # vLLM's ParentRequest: sample j of a seeded request uses seed + j
    fresh.reset_prefix_cache()
    alone = fresh.generate(prompt, SamplingParams(seed=6, max_tokens=4), use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[0].outputs[1].token_ids


def _next_logprobs(llm, ids):
    """log p(next | ids) from a teacher-forced prefill of ids alone (kvjax.LLM.score_windows)."""
    return llm.score_windows(np.asarray([ids]))[0, -1]


def test_logprobs_k_match_a_teacher_forced_prefill(fresh):
    prompt = list(b"def square(x):")
    out = fresh.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, logprobs=3, **GREEDY),
                         use_tqdm=False)[0].outputs[0]
    ids = list(prompt)
    for token, entry in zip(out.token_ids, out.logprobs):
        ref = _next_logprobs(fresh, ids)
        top = np.argsort(-ref, kind="stable")[:3]
        assert token == top[0] and list(entry)[0] == token  # greedy: the chosen token first, rank 1
        assert set(entry) == set(top.tolist())
        for r, t in enumerate(top, start=1):
            assert entry[int(t)].rank == r and entry[int(t)].decoded_token == chr(t)
            assert entry[int(t)].logprob == pytest.approx(float(ref[t]), abs=2e-4)
        ids.append(token)


def test_prompt_logprobs_match_the_engines_decode(fresh):
    prompt = list(b"for i in")
    out = fresh.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY),
                         use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    # the paged engine's own log-probabilities for each prefix's next token are an independent path
    prefixes = [{"prompt_token_ids": prompt[:s]} for s in range(1, len(prompt))]
    decoded = fresh.generate(prefixes, SamplingParams(max_tokens=1, logprobs=2, **GREEDY), use_tqdm=False)
    for s, (entry, d) in enumerate(zip(out.prompt_logprobs[1:], decoded), start=1):
        token = prompt[s]
        assert token in entry and entry[token].rank >= 1
        engine_top = {t: e for t, e in d.outputs[0].logprobs[0].items() if e.rank <= 2}
        mine_top = {t: e for t, e in entry.items() if e.rank <= 2}
        assert set(engine_top) == set(mine_top)
        for t in mine_top:
            assert mine_top[t].logprob == pytest.approx(engine_top[t].logprob, abs=2e-4)


@pytest.mark.slow  # 40 s: eight teacher-forced prefills of eight lengths, and an LLM of its own
def test_detokenize_false_gives_no_text_as_vllm(fresh):
    # vLLM's output processor makes no detokenizer and no logprobs tokenizer for such a request: text "" and every
    # Logprob's decoded_token None, the prompt's included; the token ids and numbers are the same as with text
    kw = dict(max_tokens=5, logprobs=2, prompt_logprobs=1, **GREEDY)
    plain, bare = fresh.generate(["def f(x):"] * 2, [SamplingParams(**kw), SamplingParams(detokenize=False, **kw)],
                                 use_tqdm=False)
    assert plain.outputs[0].text and bare.outputs[0].text == ""
    assert bare.outputs[0].token_ids == plain.outputs[0].token_ids
    for got, want in [(bare.outputs[0].logprobs, plain.outputs[0].logprobs), (bare.prompt_logprobs[1:],
                                                                             plain.prompt_logprobs[1:])]:
        for g, w in zip(got, want):
            assert list(g) == list(w) and all(lp.decoded_token is None for lp in g.values())
            assert all(w[t].decoded_token is not None and g[t].rank == w[t].rank
                       and abs(g[t].logprob - w[t].logprob) < 1e-5 for t in g)


def test_frequency_and_presence_penalties_match_a_numpy_greedy_loop(fresh):
    # penalties are additive, so argmax over log-probs minus penalties is argmax over logits minus penalties
    prompt = list(b"aaaa bbbb aaaa")
    sp = SamplingParams(max_tokens=8, presence_penalty=0.7, frequency_penalty=0.4, **GREEDY)
    for steps in (1, 4):  # the ragged step and the device decode loop (counts carried in its carry)
        llm = fresh if steps == 1 else LLM("small-gqa", block_size=16, num_gpu_blocks_override=96, max_num_seqs=4,
                                           steps_per_call=4)
        got = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids
        ids, out = list(prompt), []
        for _ in range(8):
            counts = np.bincount(np.asarray(out, np.int64), minlength=256)
            scores = _next_logprobs(fresh, ids) - 0.4 * counts - 0.7 * (counts > 0)
            out.append(int(np.argmax(scores)))
            ids.append(out[-1])
        assert got == out, steps


def test_min_tokens_and_stop_token_ids(fresh):
    prompt = "def f(x):"
    plain = fresh.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY),
                           use_tqdm=False)[0].outputs[0]
    stop = plain.token_ids[0]
    stopped = fresh.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[stop], **GREEDY),
                             use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [stop] and stopped.finish_reason == "stop" and stopped.stop_reason == stop
    late = fresh.generate(prompt, SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[stop], **GREEDY),
                          use_tqdm=False)[0].outputs[0]
    assert stop not in late.token_ids[:3] and len(late.token_ids) >= 3
    # vLLM's check_stop: a stop token on the last allowed step is "stop", not "length"
    last = fresh.generate(prompt, SamplingParams(max_tokens=1, stop_token_ids=[stop], **GREEDY),
                          use_tqdm=False)[0].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)


def test_stop_strings_cut_the_text_as_vllm(fresh):
    prompt = "class Node:"
    plain = fresh.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY),
                           use_tqdm=False)[0].outputs[0]
    text = plain.text  # the byte vocabulary: one character per token
    stop = text[4:6]
    at = text.find(stop)
    cut = fresh.generate(prompt, SamplingParams(max_tokens=12, stop=[stop, "\x00never"], **GREEDY),
                         use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[:at], "stop", stop)
    assert cut.token_ids == plain.token_ids[:at + len(stop)]  # up to the token that completed the string
    kept = fresh.generate(prompt, SamplingParams(max_tokens=12, stop=stop, include_stop_str_in_output=True,
                                                 **GREEDY), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:at + len(stop)]


def test_prompt_forms_priority_and_defaults(fresh):
    want = fresh.generate("x = 1", SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    for form in ({"prompt": "x = 1"}, {"prompt_token_ids": list(b"x = 1")}, list(b"x = 1")):
        got = fresh.generate([form], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
        assert got[0].outputs[0].token_ids == want
    assert fresh.generate({"prompt": "x = 1"}, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0].prompt \
        == "x = 1"
    with pytest.raises(LLMError, match="prompt field 'multi_modal_data' is not implemented"):
        fresh.generate({"prompt": "x", "multi_modal_data": {}}, use_tqdm=False)
    # sampling_params=None is vLLM's default: max_tokens 16, temperature 1.0
    assert fresh.get_default_sampling_params() == SamplingParams()
    assert len(fresh.generate("y", use_tqdm=False)[0].outputs[0].token_ids) == 16  # the model has no EOS
    assert fresh.get_tokenizer() is fresh.tokenizer


def test_an_int_priority_and_use_tqdm():
    llm = LLM("small-gqa", num_gpu_blocks_override=64, max_num_seqs=2, scheduling_policy="priority")
    out = llm.generate(["a", "b"], SamplingParams(max_tokens=2, **GREEDY), priority=1, use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 2]


def test_generation_config_gives_the_defaults(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(os.path.join(ROOT, "models", "checkpoints", "small-gqa"), folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 5, "do_sample": True}))
    llm = LLM(str(folder), num_gpu_blocks_override=32, max_num_seqs=1)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9, max_tokens=5)
    assert len(llm.generate("z", use_tqdm=False)[0].outputs[0].token_ids) == 5
    vllm = LLM(str(folder), num_gpu_blocks_override=32, max_num_seqs=1, generation_config="vllm")
    assert vllm.get_default_sampling_params() == SamplingParams()


def test_auto_kv_dtype_is_the_models_and_memory_bytes_size_the_pool():
    llm = LLM("small-gqa", num_gpu_blocks_override=8)
    assert llm.config.dtype == "float32" and llm.kv_spec.kv_dtype == "fp32"
    per_block = llm.kv_spec.bytes_per_block(16)
    sized = LLM("small-gqa", kv_cache_memory_bytes=10 * per_block + 5)
    assert sized.num_blocks == 1 + 10


@pytest.mark.parametrize("kw, message", [
    (dict(kv_dtype="fp8"), "LLM() has no argument 'kv_dtype'"),
    (dict(num_blocks=8), "LLM() has no argument 'num_blocks'"),
    (dict(attn_impl="reference"), "LLM() has no argument 'attn_impl'"),
    (dict(quantization="fp8"), "quantization='fp8': weight quantization is not implemented"),
    (dict(trust_remote_code=True), "trust_remote_code=True: kvjax runs no code from checkpoints"),
    (dict(swap_space=4), "swap_space=4: vLLM V1 recomputes on preemption"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer in [1, 256], got 0"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3: tp 3 does not divide the 4 query heads"),
    (dict(attention_backend="FLASH_ATTN"), "attention_backend='FLASH_ATTN': kvjax's backends are reference, pallas"),
    (dict(num_gpu_blocks_override=8, kv_cache_memory_bytes=10**6), "give one of num_gpu_blocks_override or"),
    (dict(kv_transfer_config={"kv_connector": "LMCacheConnectorV1"}), "kvjax has the OffloadingConnector's"),
    (dict(kv_cache_dtype_skip_layers=["full_attention"]), "'full_attention' is neither a layer index in [0, 4) nor "
                                                           "a layer type (sliding_window)"),
    (dict(enforce_eager=True, steps_per_call=4), "enforce_eager=True runs one decode step per device call"),
])
def test_vllm_arguments_that_mean_nothing_here_are_refused_by_name(kw, message):
    with pytest.raises(LLMError) as e:
        LLM("small-gqa", **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_vllms_defaults_spelled_out_are_accepted():
    llm = LLM("small-gqa", num_gpu_blocks_override=8, max_num_seqs=1, enforce_eager=False, trust_remote_code=False,
              quantization=None, tokenizer=None, disable_log_stats=True, pipeline_parallel_size=1,
              kv_offloading_backend="native", use_tqdm_on_load=False)
    assert llm.num_blocks == 8


def test_chat_takes_vllms_arguments(fresh):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}" \
               "<assistant>{% endif %}"
    msgs = [{"role": "user", "content": "hi"}]
    out = fresh.chat(msgs, SamplingParams(max_tokens=2, **GREEDY), chat_template=template, use_tqdm=False)
    assert out[0].prompt == "<user>hi<assistant>"
    out = fresh.chat(msgs, SamplingParams(max_tokens=2, **GREEDY), chat_template=template,
                     add_generation_prompt=False, use_tqdm=False)
    assert out[0].prompt == "<user>hi"
    with pytest.raises(LLMError, match="has no chat template"):
        fresh.chat(msgs, use_tqdm=False)


def test_an_interrupted_generate_leaves_the_llm_usable(fresh):
    def interrupt(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fresh.generate(["abc", "def"], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False, progress=interrupt)
    sched = fresh.engine.scheduler
    assert not sched.has_unfinished() and not sched.requests
    assert int(sched.state.pool.num_free) == fresh.num_blocks - 1  # every block back in the pool
    out = fresh.generate("abc", SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # a seed + j past the seed range is refused before any request goes in
    with pytest.raises(Exception, match="seed must be an integer"):
        fresh.generate("abc", SamplingParams(n=2, seed=2**32 - 1), use_tqdm=False)
    assert not sched.requests


@pytest.mark.slow  # progress bars only (CI's budget)
def test_use_tqdm_on_load_and_use_tqdm_draw_on_stderr_only(capfd):
    llm = LLM("small-gqa", num_gpu_blocks_override=16, max_num_seqs=1, use_tqdm_on_load=True)
    llm.generate("ab", SamplingParams(max_tokens=2, **GREEDY))
    out, err = capfd.readouterr()
    assert out == "" and "load small-gqa: 3/3 stages" in err and "build" in err and "Generating" in err
    quiet = LLM("small-gqa", num_gpu_blocks_override=16, max_num_seqs=1, use_tqdm_on_load=False)
    quiet.generate("ab", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert capfd.readouterr() == ("", "")


def test_each_calls_summary_counts_that_call_only():
    # the host tier's byte counters and the scheduler's preemptions run over the engine's life;
    # two identical calls from an empty pool and tier must report the same figures
    probe = LLM("preset:tiny", num_gpu_blocks_override=11, block_size=8, max_num_seqs=2, max_model_len=40,
                use_tqdm_on_load=False)
    per_block = probe.kv_spec.bytes_per_block(8)
    llm = LLM("preset:tiny", num_gpu_blocks_override=11, block_size=8, max_num_seqs=2, max_model_len=40,
              kv_offloading_size=64 * per_block / 2**30, use_tqdm_on_load=False)
    prompts = [[1 + (i * 7 + j) % 50 for j in range(24)] for i in range(3)] * 2  # repeats hit the host tier
    runs = []
    for _ in range(2):
        llm.reset_prefix_cache(reset_connector=True)
        s = llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False).summary
        runs.append((s.requests, s.generated_tokens, s.preemptions, s.host_hit_tokens, s.host_bytes_stored,
                     s.host_bytes_loaded, s.prefix_hit_tokens))
    assert runs[0] == runs[1] and runs[0][4] > 0 and runs[0][0] == 6


@pytest.mark.slow  # 35 s; the default run has TP 2 against TP 1 in tests/worker/test_tp.py
@pytest.mark.parametrize("tp", [4])  # 4 > the model's 2 kv heads: each head held by 2 ranks (tests/worker/test_tp.py: tp 2)
def test_tensor_parallel_size_decodes_the_same_tokens(tp):
    prompts = [SYSTEM + "def add(a, b):", "import os\n"]
    sp = SamplingParams(max_tokens=6, **GREEDY)
    one = LLM("small-gqa", num_gpu_blocks_override=32, max_num_seqs=2, use_tqdm_on_load=False)
    many = LLM("small-gqa", num_gpu_blocks_override=32, max_num_seqs=2, tensor_parallel_size=tp,
               use_tqdm_on_load=False)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    for _ in range(2):  # the second call hits the prefix cache, on the sharded pages
        got = many.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    assert got[0].num_cached_tokens > 0
    # each rank holds its share of the kv heads: 2 / tp heads, or 1 head (a copy) when tp > 2
    k = many.engine.cache.layers[0].k
    assert len(k.sharding.device_set) == tp
    assert k.sharding.shard_shape(k.shape)[2] == max(1, 2 // tp) and k.shape[2] == max(2, tp)
    with pytest.raises(LLMError, match="the Pallas kernels are not partitioned"):
        LLM("small-gqa", tensor_parallel_size=2, attention_backend="pallas")
