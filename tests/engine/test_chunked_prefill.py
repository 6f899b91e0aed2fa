"""Chunked prefill (vLLM V1's default) does not change the tokens.

A tiny random-init Llama with a 512-token context: prompts of 1 to 300 tokens, two after
the same 48-token prefix, are generated greedily with chunked prefill off (each prompt in one
step) and on with step budgets of 8, 64 and 2048 tokens, and at 64 with a pool so small that
requests are preempted and recomputed. Every run gives the same tokens. A budget smaller than a prompt
splits it over several steps, and the request samples only when its last chunk has run; a
prefix-cache hit followed by a chunked rest computes only the rest. (tests/engine/test_engine_hf.py
checks chunked runs against transformers.)
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from engine_fixtures import engine_config

from kvjax.config.presets import preset
from kvjax.core import kv_cache_manager as manager
from kvjax.engine.core import Engine
from kvjax.engine.sampling import SamplingParams
from kvjax.models import build_model, init_params

Z = 16
MAX_LEN = 512
LENGTHS = (1, 40, 130, 300)
NEW = 8


@pytest.fixture(scope="module")
def tiny():
    config = preset("tiny").replace(max_position_embeddings=MAX_LEN, dtype="float32", name="tiny-512")
    model = build_model(config)
    return config, model, init_params(model, jax.random.key(0))


def prompts():
    rng = np.random.RandomState(0)
    shared = rng.randint(0, 128, size=48).tolist()  # three full blocks
    return [(shared if i in (1, 2) else []) + rng.randint(0, 128, size=n).tolist() for i, n in enumerate(LENGTHS)]


def generate(tiny, **kw):
    config, model, params = tiny
    cfg = engine_config(config, **{"num_blocks": 160, "block_size": Z, "max_num_seqs": 4, "max_model_len": MAX_LEN,
                                   **kw})
    eng = Engine(model, params, cfg)
    run = eng.generate(prompts(), SamplingParams(max_tokens=NEW, temperature=0.0))
    assert all(r.finish_reason in ("stop", "length") for r in run.results), [r.finish_reason for r in run.results]
    state = eng.scheduler.state
    manager.check_invariants(state)
    assert int(state.pool.num_free) == cfg.num_blocks - 1 and not bool(state.reqs.active.any()), "leaked blocks or slots"
    return run


@pytest.fixture(scope="module")
def unchunked(tiny):
    run = generate(tiny, enable_chunked_prefill=False)
    assert run.summary.prefix_hit_tokens >= 48
    return run


@pytest.mark.parametrize("budget", [pytest.param(8, marks=pytest.mark.slow), pytest.param(64, marks=pytest.mark.slow),
                                    pytest.param(2048, marks=pytest.mark.slow)])
def test_chunked_prefill_gives_the_same_tokens(tiny, unchunked, budget):
    run = generate(tiny, max_num_batched_tokens=budget)
    assert [r.output for r in run.results] == [r.output for r in unchunked.results]
    s = run.summary
    assert s.prefill_tokens == s.prompt_tokens - s.prefix_hit_tokens  # a hit's chunked rest computes only the rest
    if budget < max(LENGTHS):  # a 300-token prompt needs ceil(300 / budget) steps before it samples
        assert s.steps >= -(-max(LENGTHS) // budget) + NEW - 1
        assert s.steps > unchunked.summary.steps


@pytest.mark.slow
def test_chunked_prefill_with_preemption_gives_the_same_tokens(tiny, unchunked):
    # 21 usable blocks of 16 = 336 tokens for 4 rows: the 308-token request cannot stay beside the others.
    run = generate(tiny, num_blocks=22, max_num_batched_tokens=64)
    assert run.summary.preemptions > 0
    assert [r.output for r in run.results] == [r.output for r in unchunked.results]


def test_a_prompt_longer_than_the_budget_samples_once_at_its_last_chunk(tiny):
    config, model, params = tiny
    eng = Engine(model, params, engine_config(config, num_blocks=160, block_size=Z, max_num_seqs=4,
                                             max_model_len=MAX_LEN, max_num_batched_tokens=64))  # the shapes of the runs above: no new compile
    sched_plans = []
    from kvjax.core.sched import scheduler as sched_mod

    original = sched_mod.Scheduler.schedule

    def spy(self):
        plan = original(self)
        sched_plans.append(plan)
        return plan

    sched_mod.Scheduler.schedule = spy
    try:
        # 200 tokens, budget 64
        run = eng.generate([list(range(1, 101)) * 2], SamplingParams(max_tokens=2, temperature=0.0))
    finally:
        sched_mod.Scheduler.schedule = original
    assert [int(p.num_scheduled[0]) for p in sched_plans] == [64, 64, 64, 8, 1]
    assert [bool(p.sample[0]) for p in sched_plans] == [False, False, False, True, True]
    assert len(run.results[0].output) == 2
