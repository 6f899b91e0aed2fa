"""The scheduler's SchedulerStats (vLLM's `Scheduler.make_stats` → `SchedulerStats`, kvjax.core.sched.stats):
one per engine step, the only way the engine learns what the scheduler did (issue 51).

A hand-worked scenario with vLLM's rules (blocks of 4, 6 usable blocks; a decoding request allocates the
block its next position needs when it is scheduled; a request admitted again after a preemption is
counted apart in the prefix-cache stats; a preempted request's blocks are freed last first, so its tail
block is evicted first), stepping the scheduler with fixed sampled tokens; then a check that the engine,
its run statistics and its metrics read no scheduler queue or request table."""
from __future__ import annotations

import ast
import os

import numpy as np
import pytest

from kvjax.config.scheduler import SchedulerConfig
from kvjax.core.sched.scheduler import Scheduler
from kvjax.core.sched.stats import PrefixCacheStats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
A, B, C = list(range(1, 9)), list(range(1, 9)) + [30], list(range(40, 52))


def step(sched: Scheduler, token: int = 0):
    plan = sched.schedule()
    finished = sched.update(plan, np.full(plan.num_requests, token, np.int32))
    return plan, finished, sched.make_stats()


def test_one_stats_object_per_step_as_worked_by_hand():
    sched = Scheduler(SchedulerConfig(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=24))
    sched.add_request("A", A, 6)
    # 1: A admitted, 8 tokens looked up, none found; its prompt fills 2 blocks
    _, _, s = step(sched, 20)
    assert (s.num_running_reqs, s.num_waiting_reqs, s.blocks_in_use, s.kv_cache_usage) == (1, 0, (2,), 2 / 6)
    assert s.prefix_cache_stats == PrefixCacheStats(requests=1, queries=8, hits=0)
    assert s.preempted_req_ids == () and s.finished_req_ids == frozenset()
    sched.add_request("B", B, 3)
    # 2: A's position 8 takes a 3rd block; B finds A's two full blocks (8 of its 9 tokens) and takes one more
    _, _, s = step(sched, 21)
    assert (s.num_running_reqs, s.blocks_in_use) == (2, (4,))
    assert s.prefix_cache_stats == PrefixCacheStats(requests=1, queries=9, hits=8)
    sched.add_request("C", C, 3)
    # 3: C's 12 tokens need 3 blocks, 2 are free: it waits (a lookup that is not admitted is not counted)
    _, _, s = step(sched)
    assert (s.num_running_reqs, s.num_waiting_reqs, s.blocks_in_use) == (2, 1, (4,))
    assert s.prefix_cache_stats == PrefixCacheStats()
    sched.finish_request("B", "abort")  # between two steps: the next stats say so
    sched.forget("B")
    # 4: B's own block is free again: C is admitted, and the pool is full
    _, _, s = step(sched)
    assert (s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage) == (2, 0, 1.0)
    assert s.finished_req_ids == {"B"} and s.prefix_cache_stats == PrefixCacheStats(requests=1, queries=12, hits=0)
    # 5: C's position 12 needs a 4th block and none is free: C, the last admitted, is preempted; its 3 full
    # blocks stay cached in the free queue
    plan, _, s = step(sched)
    assert plan.req_ids == ("A",) and s.preempted_req_ids == ("C",) and s.num_preempted_reqs == 1
    assert (s.num_running_reqs, s.num_waiting_reqs, s.blocks_in_use, s.kv_cache_usage) == (1, 1, (3,), 0.5)
    # 6: A's position 12 takes the free queue's head, C's last block; C then finds 2 blocks but needs 2 more and
    # waits; A generates its 6th token and finishes, freeing its 4 blocks
    _, finished, s = step(sched)
    assert finished == ["A"] and s.finished_req_ids == {"A"} and s.preempted_req_ids == ()
    assert (s.num_running_reqs, s.num_waiting_reqs, s.blocks_in_use) == (0, 1, (0,))
    sched.forget("A")
    # 7: C admitted again: its 13 tokens looked up, 8 found, counted as a preempted request's lookup
    plan, _, s = step(sched)
    assert plan.req_ids == ("C",) and list(plan.num_scheduled) == [5]
    assert s.prefix_cache_stats == PrefixCacheStats(preempted_requests=1, preempted_queries=13, preempted_hits=8)
    assert (s.num_running_reqs, s.num_waiting_reqs, s.blocks_in_use) == (1, 0, (4,))


def test_a_device_loops_blocks_per_step_and_a_reset_between_steps():
    sched = Scheduler(SchedulerConfig(num_blocks=9, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=32))
    sched.add_request("A", [1, 2, 3], 10)
    step(sched, 5)  # A: 4 tokens, 1 block
    plan = sched.schedule()  # a decode plan; a "device loop" runs it and 2 more steps (positions 3, 4, 5)
    state = sched.state  # (the loop's pool: here the scheduler's own, its blocks counted by the loop)
    sched.decode_steps(plan, lambda pool: (pool, np.array([[6], [7], [8]]), np.zeros(1, np.int32),
                                           np.array([1, 2, 2]), None))
    assert sched.state is state
    s = sched.make_stats()
    assert s.blocks_in_use == (1, 2, 2) and s.kv_cache_usage == 2 / 8
    assert sched.reset_prefix_cache(reset_running=True)  # preempts A outside any step
    s = sched.make_stats()
    assert s.preempted_req_ids == ("A",) and (s.num_running_reqs, s.num_waiting_reqs) == (0, 1)


ENGINE_FILES = ("kvjax/engine/core.py", "kvjax/engine/stats.py", "kvjax/engine/metrics.py",
                "kvjax/engine/llm_engine.py", "kvjax/engine/llm.py", "kvjax/engine/async_llm.py",
                "kvjax/benchmarks/serve.py")


@pytest.mark.parametrize("path", ENGINE_FILES)
def test_the_engine_reads_no_scheduler_queue(path):
    # vLLM's engine and loggers read a SchedulerStats; none of these walks `sched.requests`, `.running`,
    # `.waiting` or the lifetime counters behind them
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    reads = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and node.attr in ("requests", "running", "waiting", "num_preemptions", "host_hit_tokens")
             and "sched" in ast.unparse(node.value)}
    assert not reads, reads
