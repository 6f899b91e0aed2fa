"""The simulator (kvjax.simulator): the engine's own scheduler on a clock.

- A real engine run, stepped with the simulator's arrival rule and timed, then simulated with
  its recorded step times: the same plans step by step (requests, tokens each, preemptions), on a
  pool small enough to preempt, with chunked prefill and prefix hits.
- A schedule worked out by hand on a constant cost: token times, TTFT / TPOT / E2EL, the client's
  max_concurrency.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineArgs, LLMEngine, SamplingParams
from kvjax.benchmarks.serve import calculate_metrics
from kvjax.config.scheduler import SchedulerConfig
from kvjax.engine.stats import StepLog
from kvjax.errors import KvjaxError
from kvjax.simulator.clock import SimulationError, simulate


def workload(seed=0, n=10):
    """Prompts with a shared 32-token prefix, lengths 20-90, outputs 3-12, arriving over ~1.5 s."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 250, 32).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(1, 250, int(rng.integers(20, 60))).tolist() for i in range(n)]
    outputs = rng.integers(3, 13, n).tolist()
    arrivals = np.cumsum(rng.exponential(0.15, n))
    return prompts, outputs, arrivals


def test_a_simulated_run_given_a_real_runs_step_times_makes_its_decisions():
    prompts, outputs, arrivals = workload()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="small-gqa", block_size=16, num_gpu_blocks_override=14, max_num_seqs=4, max_num_batched_tokens=48,
        steps_per_call=1, enable_prefix_caching=True, seed=0))
    core = engine.engine
    core.step_log = log = StepLog()
    clock, nxt, params = 0.0, 0, [SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.0) for k in outputs]
    while nxt < len(prompts) or engine.has_unfinished_requests():  # the simulator's loop, on measured time
        while nxt < len(prompts) and arrivals[nxt] <= clock:
            engine.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]}, params[nxt])
            nxt += 1
        if not engine.has_unfinished_requests():
            clock = float(arrivals[nxt])
            continue
        engine.step()
        clock += log.records[-1].end - log.records[-1].start
    real = log.records
    assert sum(r.num_preempted for r in real) > 0, "the pool is meant to preempt"
    assert any(r.prefill_tokens and r.decode_tokens for r in real), "mixed steps"
    sampled = {}  # the real run's tokens, fed back in the same order
    result = simulate(core.scheduler.config, prompts, outputs, arrivals, lambda f: 0.0,
                      step_times=[r.end - r.start for r in real],
                      tokens=lambda rid, k: sampled.setdefault((rid, k), 1 + (int(rid) * 31 + k) % 200))
    assert [(s.req_ids, s.num_scheduled, s.preempted) for s in result.steps] == [
        (tuple(r for r, _ in rec.scheduled), tuple(n for _, n in rec.scheduled), rec.preempted) for rec in real]
    assert [s.features.context_tokens for s in result.steps] == [r.context_tokens for r in real]
    assert result.preemptions == sum(r.num_preempted for r in real)


def test_a_schedule_worked_out_by_hand():
    """Budget 16, 1 s a step. A: 8 prompt tokens + 3 out at t=0; B: 12 + 2 at t=0.5.
    step 1 [0, 1]: A's 8 (first token at 1). B arrives during it.
    step 2 [1, 2]: A decodes (token 2 at 2), B's 12 (first token at 2).
    step 3 [2, 3]: A's last token, B's last token, both at 3."""
    config = SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    result = simulate(config, [list(range(1, 9)), list(range(100, 112))], [3, 2], [0.0, 0.5], lambda f: 1.0)
    assert [(s.start, s.end, s.req_ids, s.num_scheduled) for s in result.steps] == [
        (0.0, 1.0, ("0",), (8,)), (1.0, 2.0, ("0", "1"), (1, 12)), (2.0, 3.0, ("0", "1"), (1, 1))]
    a, b = result.outputs
    assert (a.ttft, a.itl, a.latency) == (1.0, [1.0, 1.0], 3.0)
    assert (b.start_time, b.ttft, b.itl, b.latency) == (0.5, 1.5, [1.0], 2.5)
    metrics, _ = calculate_metrics(result.outputs, result.duration)
    assert metrics.stats["ttft"]["mean"] == pytest.approx(1250.0)  # (1 + 1.5) / 2 s
    assert metrics.stats["tpot"]["mean"] == pytest.approx(1000.0)  # (latency − TTFT) / (out − 1) = 1 s each
    assert metrics.stats["e2el"]["mean"] == pytest.approx(2750.0)
    # max_concurrency 1: B is sent when A finishes (t = 3), prefilled in [3, 4], its last token at 5
    held = simulate(config, [list(range(1, 9)), list(range(100, 112))], [3, 2], [0.0, 0.5], lambda f: 1.0,
                    max_concurrency=1)
    b = held.outputs[1]
    assert (b.start_time, b.ttft, b.latency) == (3.0, 1.0, 2.0)


def test_bad_workloads_are_refused_by_value():
    config = SchedulerConfig(num_blocks=9, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    with pytest.raises(KvjaxError, match="arrival times must be finite"):
        simulate(config, [[1, 2]], [1], [-1.0], lambda f: 1.0)
    with pytest.raises(KvjaxError, match="2 prompts, 1 output lengths"):
        simulate(config, [[1], [2]], [1], [0.0, 0.0], lambda f: 1.0)
    with pytest.raises(SimulationError, match="a step time of nan"):
        simulate(config, [[1, 2]], [1], [0.0], lambda f: float("nan"))
