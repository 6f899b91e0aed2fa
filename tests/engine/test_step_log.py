"""Engine.step_log: the scheduler's view of every step (kvjax.engine.stats.StepLog), checked by
counting tokens. Without prefix caching every token a request ever computes is either needed once
(its prompt and every output token but the last: prompt + output - 1 positions) or recomputed after
a preemption freed it, so a run's recomputed tokens must equal what it computed less that minimum;
a roomy pool recomputes nothing. The tiny model and pool sizes are tests/engine/test_engine.py's
(the same compiled steps)."""
from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import Z, assert_pool_empty, engine, greedy, tiny  # noqa: F401 (a fixture)

from kvjax.engine.stats import StepLog


def prompts(seed=0, lengths=(5, 9, 13, 3, 7, 11)):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(0, 128, size=n)) for n in lengths]


@pytest.mark.parametrize("num_blocks, steps_per_call, preempts", [(10, 8, True), pytest.param(64, 8, False, marks=pytest.mark.slow)])
def test_recomputed_tokens_are_what_a_run_computed_beyond_the_minimum(tiny, num_blocks, steps_per_call, preempts):
    eng = engine(tiny, num_blocks, steps_per_call=steps_per_call, enable_prefix_caching=False)
    eng.step_log = log = StepLog()
    run = eng.generate(prompts(), greedy(10))
    recs = log.records
    computed = sum(r.prefill_tokens + r.decode_tokens for r in recs)
    minimum = sum(len(p) + len(r.output) - 1 for p, r in zip(prompts(), run.results))
    recomputed = sum(r.recomputed_tokens for r in recs)
    assert (run.summary.preemptions > 0) == preempts
    assert recomputed == computed - minimum
    assert (recomputed > 0) == preempts
    # the log and the run's Summary count the same steps, tokens, preemptions and blocks
    assert computed == run.summary.prefill_tokens + run.summary.decode_tokens
    assert sum(r.num_preempted for r in recs) == run.summary.preemptions
    assert sum(r.steps for r in recs) == run.summary.steps
    assert max(r.blocks_in_use for r in recs) == run.summary.peak_blocks_used <= num_blocks - 1
    assert all(r.recomputed_tokens <= r.prefill_tokens for r in recs)
    assert all(a.end <= b.start for a, b in zip(recs, recs[1:]))
    assert recs[-1].num_running == recs[-1].num_waiting == 0
    # tail waste: each running request's last block is partly empty, by fewer than a block's tokens
    waste = [(r.blocks_in_use * Z - r.tokens_held, max(r.num_scheduled, r.num_running)) for r in recs]
    assert all(0 <= w < max(n, 1) * Z for w, n in waste), waste
    assert not log._high, "finished requests' marks are forgotten"
    assert_pool_empty(eng)
