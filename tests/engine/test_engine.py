"""The decoding engine on a tiny random-init Llama: schedules that must not change the tokens.

Greedy and temperature sampling give the same tokens with 1 or 8 decode steps per device
call, with a pool so small that requests are preempted and recomputed, and with prefix
caching on or off; greedy tokens equal a full recompute (the whole sequence prefilled again
for every new token, no cache reuse, no scheduler). Bad requests fail alone; stop tokens end
a request in the device loop exactly where the host loop ends it. Every run ends with an
empty pool. (tests/engine/test_engine_hf.py compares against transformers.)

The model is tests/hf_fixtures.py's llama-gqa, saved under the same folder name and run with
the same block size, rows, max_model_len and pool sizes (64 and 10 blocks) as in
tests/engine/test_engine_hf.py and tests/commands/test_decode_cli.py: in one pytest session the three files
share their compiled steps.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import MAX_LEN, Z, assert_pool_empty, engine, greedy, outputs, tiny  # noqa: F401 (a fixture)

import kvjax.engine.steps as steps
from kvjax.config.engine import EngineError
from kvjax.config.scheduler import SchedulerConfig
from kvjax.core.sched.scheduler import Scheduler
from kvjax.engine.arg_utils import EngineArgs, LLMError
from kvjax.engine.core import Engine
from kvjax.engine.sampling import SamplingParams
from kvjax.evaluation.scoring import sequence_logits

SMALL = 10  # a pool of 9 usable blocks (36 tokens) for 4 rows: requests get preempted


def prompts(seed=0, lengths=(5, 9, 13, 3, 7, 11), shared=8):
    """Prompts of different lengths; every other one starts with the same `shared` tokens."""
    rng = np.random.RandomState(seed)
    prefix = list(rng.randint(0, 128, size=shared))
    return [(prefix if i % 2 else []) + list(rng.randint(0, 128, size=n)) for i, n in enumerate(lengths)]


def full_recompute(tiny, prompts, n):
    """Greedy continuations by prefilling each whole sequence again for every new token (padded
    to MAX_LEN, one compile: a causal model's logits at a position ignore what follows it)."""
    config, model, params = tiny
    logits_of = jax.jit(lambda t: sequence_logits(model, params, t, config.kv_spec(), Z))
    outs = []
    for p in prompts:
        seq = list(p)
        for _ in range(n):
            row = jnp.asarray([seq + [0] * (MAX_LEN - len(seq))], jnp.int32)
            seq.append(int(jnp.argmax(logits_of(row)[0, len(seq) - 1])))
        outs.append(seq[len(p):])
    return outs


def test_greedy_matches_a_full_recompute_and_k8_matches_k1(tiny):
    ps = prompts()
    want = full_recompute(tiny, ps, 10)
    for k in (1, 8):
        eng = engine(tiny, steps_per_call=k)
        run = eng.generate(ps, greedy(10))
        assert outputs(run) == want, f"steps_per_call={k}"
        assert run.summary.generated_tokens == 60 and run.summary.preemptions == 0
        assert all(r.finish_reason == "length" for r in run.results)
        assert_pool_empty(eng)
        if k == 8:  # 6 requests, 4 rows: the loop returns to the host when one finishes
            assert run.summary.device_calls < run.summary.steps


@pytest.mark.slow
def test_tiny_pool_preempts_and_recomputes_same_tokens(tiny):
    ps = prompts(1)
    want = outputs(engine(tiny).generate(ps, greedy(12)))
    for k in (1, 8):
        eng = engine(tiny, num_blocks=SMALL, steps_per_call=k)
        run = eng.generate(ps, greedy(12))
        assert run.summary.preemptions > 0
        assert sum(r.preemptions for r in run.results) == run.summary.preemptions
        assert outputs(run) == want, f"steps_per_call={k}"
        assert run.summary.peak_blocks_used <= SMALL - 1
        assert_pool_empty(eng)


@pytest.mark.slow
def test_prefix_cache_hits_do_not_change_tokens(tiny):
    ps = prompts(2, shared=12)  # 3 prompts share 3 full blocks
    on = engine(tiny, steps_per_call=8).generate(ps, greedy(6))
    off = engine(tiny, enable_prefix_caching=False, steps_per_call=8).generate(ps, greedy(6))
    assert outputs(on) == outputs(off)
    assert off.summary.prefix_hit_tokens == 0 and on.summary.prefix_hit_tokens >= 12
    assert on.summary.prefill_tokens == on.summary.prompt_tokens - on.summary.prefix_hit_tokens
    assert off.summary.prefill_tokens == off.summary.prompt_tokens
    assert 0 < on.summary.prefix_hit_rate < 1
    assert sum(r.num_cached_tokens for r in on.results) == on.summary.prefix_hit_tokens  # no preemption


def test_temperature_sampling_is_seeded_and_schedule_independent(tiny):
    ps = prompts(3)
    hot = SamplingParams(max_tokens=10, temperature=1.0)
    a = outputs(engine(tiny, steps_per_call=1, seed=7).generate(ps, hot))
    b = outputs(engine(tiny, steps_per_call=8, seed=7).generate(ps, hot))
    c = engine(tiny, num_blocks=SMALL, steps_per_call=8, seed=7).generate(ps, hot)
    d = outputs(engine(tiny, steps_per_call=8, seed=8).generate(ps, hot))
    assert a == b, "K=8 must sample what K=1 samples"
    assert c.summary.preemptions > 0 and outputs(c) == a, "recomputation must not change the draws"
    assert d != a, "another seed draws other tokens"
    assert a != outputs(engine(tiny, steps_per_call=8).generate(ps, greedy(10)))


def test_a_request_seed_fixes_its_tokens_whatever_the_batch(tiny):
    ps = prompts(3)
    own = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=123)
    alone = outputs(engine(tiny, steps_per_call=8, seed=1).generate([ps[2]], own))[0]
    mixed = [greedy(10), SamplingParams(max_tokens=10, temperature=0.7), own, greedy(4), own, greedy(10)]
    run = engine(tiny, num_blocks=SMALL, steps_per_call=8, seed=2).generate([ps[0], ps[1], ps[2], ps[3], ps[2], ps[5]],
                                                                            mixed)
    assert run.summary.preemptions > 0
    assert outputs(run)[2] == outputs(run)[4] == alone, "a seeded request draws the same tokens in any batch"
    assert outputs(run)[0] == full_recompute(tiny, [ps[0]], 10)[0], "greedy rows beside sampled ones stay greedy"


def test_a_bad_request_is_refused_before_any_request_runs(tiny):
    # vLLM's rule: a request that breaks one is refused (raised) before any request of the call runs
    eng = engine(tiny, num_blocks=SMALL, steps_per_call=8)  # 9 usable blocks: 36 tokens at most
    good = prompts(4, lengths=(5, 7), shared=0)
    free = eng.scheduler.num_free_blocks()
    for bad, message in (([], "prompt 1: The decoder prompt cannot be empty"),  # vLLM's words, kvjax's detail after
                         (list(range(MAX_LEN + 1)), f"prompt 1: This model's maximum context length is {MAX_LEN} "
                                                    f"tokens. However, your prompt contains {MAX_LEN + 1} input tokens"),
                         (list(range(MAX_LEN)), f"prompt 1: The decoder prompt (length {MAX_LEN}) plus the number of "
                                                f"requested output tokens (at least 1) is longer than the maximum model "
                                                f"length of {MAX_LEN}."),
                         (list(range(1, 36)), "prompt 1: needs 10 blocks of 4 tokens (35 prompt + 5 new), but the "
                                              "pool has only 9 usable blocks"),
                         ([3, 200], "prompt 1: Token id 200 is out of vocabulary (the model's token ids are [0, 128))"),
                         ([-3, 200], "prompt 1: Token id -3 is out of vocabulary")):
        with pytest.raises(EngineError, match=re.escape(message)):
            eng.generate([good[0], bad, good[1]], greedy(6))
        assert not eng.has_unfinished_requests() and eng.scheduler.num_free_blocks() == free
        with pytest.raises(EngineError, match=re.escape(message.removeprefix("prompt 1: "))):
            eng.add_request("bad", bad, greedy(6))
        assert not eng.has_unfinished_requests()
    run = eng.generate([good[0], good[0]], greedy(6))
    alone = outputs(engine(tiny, steps_per_call=8).generate([good[0]], greedy(6)))[0]
    assert outputs(run) == [alone, alone]
    assert_pool_empty(eng)
    with pytest.raises(EngineError, match="one SamplingParams for all prompts or one per prompt"):
        eng.generate([good[0]] * 3, [greedy(6)] * 2)


def test_requests_arrive_between_steps_and_abort(tiny):
    # vLLM's EngineCore: add_request between steps joins the running batch; abort frees at once
    eng = engine(tiny, steps_per_call=1)
    ps = prompts(3, shared=0)
    want = full_recompute(tiny, ps, 10)
    a = eng.add_request("a", ps[0], greedy(10))
    seen = eng.step()
    assert seen == [a] and a.new_tokens == 1 and len(a.output) == 1
    b, c = eng.add_request("b", ps[1], greedy(10)), eng.add_request("c", ps[2], greedy(10))
    with pytest.raises(EngineError, match="request id 'b' is already in use"):
        eng.add_request("b", ps[1], greedy(10))
    eng.step()
    assert len(a.output) == 2 and len(b.output) == len(c.output) == 1
    assert eng.abort_requests(["c", "nope"]) == [c] and c.finish_reason == "abort" and not c.stop_reason
    assert eng.get_num_unfinished_requests() == 2 and eng.abort_requests(["c"]) == []
    while eng.has_unfinished_requests():
        for r in eng.step():
            assert r.new_tokens >= 1
    assert [a.output, b.output] == want[:2] and a.finish_reason == b.finish_reason == "length"
    assert c.output == want[2][:len(c.output)]
    assert_pool_empty(eng)


def test_stop_tokens_end_requests_in_the_device_loop_as_in_the_host_loop(tiny):
    ps = prompts(5)
    free_run = outputs(engine(tiny).generate(ps, greedy(12)))
    # Stop at a token each request generates part-way: the output ends with it, one request
    # stops mid-call of the 8-step loop, the others run on.
    stop = free_run[1][4]
    want = [out[: out.index(stop) + 1] if stop in out else out for out in free_run]
    for k in (1, 8):
        eng = engine(tiny, num_blocks=SMALL, steps_per_call=k)
        run = eng.generate(ps, greedy(12, stop_token_ids=[stop]))
        assert outputs(run) == want, f"steps_per_call={k}"
        # vLLM's check_stop looks at stop tokens before the length: a stop token that is also the
        # 12th (last allowed) token is "stop"
        assert [r.finish_reason for r in run.results] == ["stop" if stop in out else "length" for out in free_run]
        assert_pool_empty(eng)
    # The edge itself: a request whose last allowed token is its only stop token.
    last = next(i for i, out in enumerate(free_run) if out[-1] not in out[:-1])
    for k in (1, 8):
        run = engine(tiny, steps_per_call=k).generate([ps[last]], greedy(12, stop_token_ids=[free_run[last][-1]]))
        (res,) = run.results
        assert res.output == free_run[last] and (res.finish_reason, res.stop_reason) == ("stop", free_run[last][-1])
    config, model, params = tiny  # the same stop as the model's EOS id, which ignore_eos skips
    with_eos = engine(tiny, steps_per_call=8, eos_token_ids=[stop])
    assert outputs(with_eos.generate(ps, greedy(12))) == want
    assert outputs(with_eos.generate(ps, greedy(12, ignore_eos=True))) == free_run


def test_logprobs_are_the_models_log_softmax_of_each_chosen_token(tiny):
    config, model, params = tiny
    ps = prompts(6)[:2]
    run = engine(tiny, steps_per_call=8).generate(ps, greedy(5, logprobs=0))
    logits_of = jax.jit(lambda t: sequence_logits(model, params, t, config.kv_spec(), Z))
    for p, res in zip(ps, run.results):
        seq = list(p) + res.output
        row = jnp.asarray([seq + [0] * (MAX_LEN - len(seq))], jnp.int32)
        logp = np.asarray(jax.nn.log_softmax(logits_of(row)[0], axis=-1))
        want = [logp[len(p) - 1 + i, t] for i, t in enumerate(res.output)]
        np.testing.assert_allclose([t.logprob for t in res.logprobs], want, rtol=1e-5, atol=1e-5)
    assert engine(tiny).generate(ps, greedy(3)).results[0].logprobs is None


def test_generation_stops_at_max_model_len(tiny):
    run = engine(tiny, steps_per_call=8).generate([list(range(1, 36))], greedy(20))
    (res,) = run.results
    assert len(res.output) == MAX_LEN - 35 and res.finish_reason == "length"


def test_engine_config_errors(tiny):
    config = tiny[0]
    for kw, says in ((dict(num_gpu_blocks_override=1), r"num_gpu_blocks_override must be an integer in \[2, "),
                     (dict(steps_per_call=0), r"steps_per_call must be an integer in \[1, 1024\], got 0"),
                     # bounded where given: 10**9 steps would abort the process inside XLA's compiler
                     (dict(steps_per_call=10**9), r"steps_per_call must be an integer in \[1, 1024\], got 1000000000"),
                     (dict(seed="x"), "seed"), (dict(seed=2**32), "seed"),
                     (dict(max_num_batched_tokens="x"), "max_num_batched_tokens"),
                     (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                     (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
                     (dict(max_num_seqs=2**31 - 1), "max_num_seqs"),
                     (dict(max_model_len=99999), "max_model_len=99999 must be in")):
        with pytest.raises((EngineError, LLMError), match=says):
            EngineArgs(**{"num_gpu_blocks_override": 8, **kw}).create_engine_config(config)
    with pytest.raises(EngineError, match="num_blocks must be an integer in \\[2, "):
        EngineArgs().create_engine_config(config).with_num_blocks(1)


def test_second_run_compiles_nothing_and_summary_adds_up(tiny):
    eng = engine(tiny, steps_per_call=8)
    eng.generate(prompts(5), greedy(8))
    run = eng.generate(prompts(6), greedy(8))
    s = run.summary
    assert s.compile_s == 0.0, "a second run of the same shapes recompiled"
    assert s.steps == len(s.blocks_in_use) and s.peak_blocks_used == max(s.blocks_in_use)
    assert s.decode_tokens + len(prompts(6)) == s.generated_tokens  # the first token of each comes from prefill
    assert s.decode_tokens_per_s > 0 and s.step_latency_p99_ms >= s.step_latency_p50_ms > 0
    assert set(s.to_json()) >= {"prefix_hit_rate", "blocks_in_use", "preemptions", "usable_blocks"}


def test_scheduler_without_chunked_prefill_admits_whole_prompts_only():
    cfg = dict(num_blocks=SMALL, block_size=Z, max_num_seqs=4, max_num_batched_tokens=20, max_model_len=20)
    with pytest.raises(ValueError, match="without chunked prefill, max_num_batched_tokens=19 must be >= max_model_len"):
        SchedulerConfig(**{**cfg, "max_num_batched_tokens": 19}, chunked_prefill=False)
    sched = Scheduler(SchedulerConfig(**cfg, chunked_prefill=False))
    sched.add_request("a", list(range(12)), 3)
    sched.add_request("b", list(range(20, 32)), 3)  # 12 tokens, 8 left in the budget: waits whole
    plan = sched.schedule()
    assert plan.req_ids == ("a",) and list(plan.num_scheduled) == [12]
    sched.update(plan, [7])
    plan = sched.schedule()  # a decodes 1, b's 12 fit the 19 left
    assert plan.req_ids == ("a", "b") and list(plan.num_scheduled) == [1, 12]


# The device decode loop's program has no branch its step must wait on. On a GPU, XLA runs a
# `lax.cond` (and each turn of a `lax.while_loop`) by copying its predicate to the host and waiting
# for it (issue 52's profile: about five such copies a step). The loop's own `while` and the block
# pool's allocation loops stay; the sampler's draw and filter are chosen on the host from the rows
# (`SamplingRows.any_drawn`, `any_filtered`, as vLLM's `all_greedy`), and the transition allocates
# without a branch. Counted in the program JAX lowers for the engine's real call (StableHLO:
# `stablehlo.if` / `stablehlo.case` are conds), for greedy, sampled and filtered rows.


def lowered_decode_loop(eng, prompts, params, monkeypatch) -> str:
    """The StableHLO of the engine's first decode_loop call for these requests."""
    seen = []
    real = steps.decode_loop

    def record(*args, **kwargs):
        if not seen:
            abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x  # noqa: E731
            seen.append(real.lower(*[args[0]] + [jax.tree.map(abstract, a) for a in args[1:]], **kwargs).as_text())
        return real(*args, **kwargs)

    monkeypatch.setattr(steps, "decode_loop", record)
    eng.generate(prompts, params)
    assert seen, "the engine never called decode_loop"
    return seen[0]


@pytest.mark.parametrize("params, draws", [
    (greedy(6), False),
    (SamplingParams(max_tokens=10, temperature=1.0), True),
    (SamplingParams(max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=123), True),
], ids=["greedy", "sampled", "filtered"])
def test_the_decode_loop_has_no_cond(tiny, monkeypatch, params, draws):  # noqa: F811
    text = lowered_decode_loop(engine(tiny, steps_per_call=8), prompts(), params, monkeypatch)
    assert text.count("stablehlo.if") + text.count("stablehlo.case") == 0
    assert ("threefry" in text) == draws  # the draw is traced only when a row samples
    assert text.count("stablehlo.sort") == (1 if params.top_k > 0 else 0)  # the filter's sort only when one filters
