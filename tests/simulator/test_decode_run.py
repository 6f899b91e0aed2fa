"""The simulator's device runs of decode steps (kvjax.simulator.decode) against the host loop.

A run takes, in one call, the steps the host loop would take one `schedule()` + `update()` at a
time. Each workload is simulated both ways (decode_runs on and off) and must give the same steps
(requests, tokens, preemptions, queues, free blocks after each step, features, times), the same
token times and the same pool at the end (free queue order, cached hashes): runs that go past finishes with nothing waiting, that stop at a finish while requests
wait, that go on through arrivals with every row full, with a pool tight enough to preempt, with
prefix hits, a host tier, sliding-window groups and a client's max_concurrency.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax.config.scheduler import SchedulerConfig
from kvjax.core import kv_cache_manager as manager
from kvjax.core.sched.scheduler import Scheduler, SchedulerError
from kvjax.simulator.clock import simulate


def workload(seed, n, rate):
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 250, 12).tolist()
    prompts = [(shared if i % 3 else []) + rng.integers(1, 250, int(rng.integers(4, 30))).tolist() for i in range(n)]
    outputs = rng.integers(1, 40, n).tolist()
    arrivals = np.cumsum(rng.exponential(1 / rate, n)) if rate else np.zeros(n)
    return prompts, outputs, arrivals


def cost(f):
    return 1e-3 + 2e-5 * f.tokens + 1e-7 * f.context_tokens + 1e-4 * f.num_requests


CASES = {
    "roomy, arrivals between runs": (dict(num_blocks=200), 30.0, None),
    "tight pool, preempting": (dict(num_blocks=24), 30.0, None),
    "all at once, rows full": (dict(num_blocks=200, max_num_seqs=3), 0, None),
    "max_concurrency": (dict(num_blocks=200), 60.0, 3),
    "host tier": (dict(num_blocks=40, num_host_blocks=30), 30.0, None),
    "sliding window groups": (dict(num_blocks=60, windows=(None, 8)), 30.0, None),
    "no prefix caching": (dict(num_blocks=30, prefix_caching=False), 30.0, None),
}


FAST = ("roomy, arrivals between runs", "tight pool, preempting", "max_concurrency")  # the rest: slow (CI's budget)


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_device_runs_take_the_host_loops_steps(case):
    kw, rate, concurrency = CASES[case]
    config = SchedulerConfig(**{"block_size": 4, "max_num_seqs": 5, "max_num_batched_tokens": 32,
                                "max_model_len": 80, **kw})
    prompts, outputs, arrivals = workload(len(case), 24, rate)
    fast, slow = (simulate(config, prompts, outputs, arrivals, cost, max_concurrency=concurrency, decode_runs=runs)
                  for runs in (True, False))
    assert fast.steps == slow.steps
    assert fast.outputs == slow.outputs and fast.preemptions == slow.preemptions
    assert fast.recomputed_tokens == slow.recomputed_tokens
    # the pool as the host loop leaves it: free queue order, cached hashes and their ages
    # (block_pool.canonical: the same queue whatever ring layout each call sequence left)
    for x, y in zip(*(jax.tree.leaves(manager.canonical(r.state)) for r in (fast, slow))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    decoding = sum(s.features.prefill_tokens == 0 for s in slow.steps)
    assert decoding > len(slow.steps) // 3, "the workload is meant to have decode runs"
    if case == "tight pool, preempting":
        assert slow.preemptions > 0 and slow.recomputed_tokens > 0


def test_a_run_past_a_finish_cannot_feed_a_host_tier():
    config = SchedulerConfig(num_blocks=40, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=40,
                             num_host_blocks=8)
    sched = Scheduler(config)
    sched.add_request("a", [1, 2, 3], 4)
    plan = sched.schedule()
    sched.update(plan, [7])
    plan = sched.schedule()
    with pytest.raises(SchedulerError, match="host tier"):
        sched.apply_decode_steps(plan, np.array([[5]]), sched.state, np.array([0]), taken=np.array([1]))


def test_runs_start_from_steps_that_finish_prompts(monkeypatch):
    """A step in which every request samples, some finishing their prompts, starts a run as a decode
    step does (kvjax.simulator.clock._runs_on) once every row is taken: the case above with full rows
    takes such runs (and gives the host loop's steps)."""
    from kvjax.simulator import clock
    starts, run = [], clock._decode_run

    def counted(sched, plan, *args):
        starts.append(plan.is_decode)
        return run(sched, plan, *args)

    monkeypatch.setattr(clock, "_decode_run", counted)
    test_device_runs_take_the_host_loops_steps("all at once, rows full")
    assert starts.count(False) > len(starts) // 2
